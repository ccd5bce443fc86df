//! Is this worker URL the gateway itself? A worker registered at the gateway's own listener
//! would send every request back into the gateway until file descriptors run out. Checked for
//! static workers at start-up, for `/workers` registrations and for discovered pods.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::time::Duration;

use url::{Host, Url};

/// Longest wait for resolving a worker's host name.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Clone, Copy, Debug)]
pub struct OwnListener {
    addr: SocketAddr,
}

/// 0.0.0.0 / :: as a destination means this host; an IPv4-mapped IPv6 address is the IPv4 one.
fn normalize(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => normalize(IpAddr::V4(v4)),
            None if v6.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
            None => ip,
        },
        IpAddr::V4(v4) if v4.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V4(_) => ip,
    }
}

/// Whether `ip` is one of this host's addresses: binding a socket to it succeeds only then.
fn is_local(ip: IpAddr) -> bool {
    ip.is_loopback() || UdpSocket::bind((ip, 0)).is_ok()
}

impl OwnListener {
    pub fn new(addr: SocketAddr) -> Self {
        OwnListener { addr }
    }

    fn ip_is_me(&self, ip: IpAddr) -> bool {
        let ip = normalize(ip);
        let own = self.addr.ip();
        if own.is_unspecified() {
            // Listening on every interface: any address of this host reaches the gateway.
            is_local(ip)
        } else {
            ip == normalize(own)
        }
    }

    /// The host and port of `url` when its port is the gateway's port, else `None` (not us).
    fn same_port(&self, url: &str) -> Option<Host<String>> {
        let parsed = Url::parse(url).ok()?;
        let port = parsed.port_or_known_default()?;
        (self.addr.port() != 0 && port == self.addr.port()).then(|| parsed.host().map(|h| h.to_owned()))?
    }

    /// Without name resolution: IP literals and `localhost`. `None` when only DNS can tell.
    pub fn is_me_literal(&self, url: &str) -> Option<bool> {
        let Some(host) = self.same_port(url) else { return Some(false) };
        match host {
            Host::Ipv4(v4) => Some(self.ip_is_me(IpAddr::V4(v4))),
            Host::Ipv6(v6) => Some(self.ip_is_me(IpAddr::V6(v6))),
            Host::Domain(d) if d.eq_ignore_ascii_case("localhost") || d.to_ascii_lowercase().ends_with(".localhost") => {
                Some(self.ip_is_me(IpAddr::V4(Ipv4Addr::LOCALHOST)) || self.ip_is_me(IpAddr::V6(Ipv6Addr::LOCALHOST)))
            }
            Host::Domain(_) => None,
        }
    }

    /// Whether `url` reaches this gateway's listener, resolving its host name (bounded). A
    /// name that does not resolve is not us (the worker then just fails its health checks).
    pub async fn is_me(&self, url: &str) -> bool {
        if let Some(known) = self.is_me_literal(url) {
            return known;
        }
        let Some(Host::Domain(name)) = self.same_port(url) else { return false };
        let port = self.addr.port();
        let resolved = tokio::time::timeout(RESOLVE_TIMEOUT, tokio::net::lookup_host(format!("{name}:{port}"))).await;
        match resolved {
            Ok(Ok(mut addrs)) => addrs.any(|a| self.ip_is_me(a.ip())),
            _ => false,
        }
    }

    /// The error message for a worker that is this gateway.
    pub fn refusal(&self, url: &str) -> String {
        format!("worker {url} is this gateway's own listener ({}): every request would loop back into the gateway", self.addr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn own(addr: &str) -> OwnListener {
        OwnListener::new(addr.parse().unwrap())
    }

    #[test]
    fn loopback_names_of_the_listener_are_us() {
        let gw = own("127.0.0.1:30000");
        for url in ["http://127.0.0.1:30000", "http://localhost:30000", "http://0.0.0.0:30000", "http://[::ffff:127.0.0.1]:30000"] {
            assert_eq!(gw.is_me_literal(url), Some(true), "{url}");
        }
        for url in ["http://127.0.0.1:30001", "http://127.0.0.2:30000", "http://10.1.2.3:30000", "http://127.0.0.1"] {
            assert_eq!(gw.is_me_literal(url), Some(false), "{url}");
        }
        assert_eq!(gw.is_me_literal("http://worker.example:30000"), None);
        assert_eq!(gw.is_me_literal("http://worker.example:30001"), Some(false));
    }

    #[test]
    fn a_gateway_on_every_interface_is_reached_by_any_local_address() {
        let gw = own("0.0.0.0:30000");
        assert_eq!(gw.is_me_literal("http://127.0.0.1:30000"), Some(true));
        assert_eq!(gw.is_me_literal("http://127.0.0.5:30000"), Some(true));
        assert_eq!(gw.is_me_literal("http://localhost:30000"), Some(true));
        // TEST-NET-3: never a local address.
        assert_eq!(gw.is_me_literal("http://203.0.113.7:30000"), Some(false));
        // Port 80 is the default for http.
        assert_eq!(own("127.0.0.1:80").is_me_literal("http://localhost"), Some(true));
    }

    #[tokio::test]
    async fn names_are_resolved() {
        let gw = own("127.0.0.1:30000");
        assert!(gw.is_me("http://localhost:30000").await);
        assert!(!gw.is_me("http://no-such-host.invalid:30000").await);
    }
}
