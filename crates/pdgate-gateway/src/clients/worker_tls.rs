//! TLS towards workers: which certificate authorities the gateway trusts for `https://` workers,
//! and how a failed handshake is told apart from other connection failures.
//!
//! By default the system's roots (rustls-native-certs); with `--worker-ca-cert PATH` only the
//! CA certificates in that PEM bundle, as `curl --cacert` does: a fleet behind a private CA
//! should not also trust every public CA for its workers.

use std::error::Error as StdError;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use rustls::{ClientConfig, RootCertStore};

/// Builds the client-side TLS settings for workers; an unusable `--worker-ca-cert` is an error
/// (the gateway refuses to start rather than fail every https worker later).
pub fn client_config(ca_cert: Option<&str>) -> Result<ClientConfig, String> {
    let roots = match ca_cert {
        Some(path) => roots_from_pem(path, &read_bundle(path)?)?,
        None => system_roots(),
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("worker TLS: {e}"))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(config)
}

fn read_bundle(path: &str) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("--worker-ca-cert {path}: cannot read it: {e}"))
}

/// Every certificate of a PEM bundle, as trust anchors; a bundle with none is refused.
pub fn roots_from_pem(path: &str, pem: &[u8]) -> Result<RootCertStore, String> {
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(pem) {
        let cert = cert.map_err(|e| format!("--worker-ca-cert {path}: not a PEM certificate bundle: {e}"))?;
        roots.add(cert).map_err(|e| format!("--worker-ca-cert {path}: unusable CA certificate: {e}"))?;
    }
    if roots.is_empty() {
        return Err(format!("--worker-ca-cert {path}: no CERTIFICATE in it"));
    }
    Ok(roots)
}

/// The operating system's trust store. Missing or partly unreadable stores are logged, not
/// fatal: plain-http fleets need no roots, and an https worker then fails with a clear
/// "unknown issuer" error.
fn system_roots() -> RootCertStore {
    let found = rustls_native_certs::load_native_certs();
    for e in &found.errors {
        tracing::warn!(error = %e, "cannot read part of the system's CA certificates (https workers)");
    }
    let mut roots = RootCertStore::empty();
    let (added, ignored) = roots.add_parsable_certificates(found.certs);
    if ignored > 0 {
        tracing::debug!(added, ignored, "system CA certificates rustls cannot use were skipped");
    }
    roots
}

/// The TLS reason in an error chain (a refused certificate, a failed handshake), if any.
pub fn tls_cause(err: &(dyn StdError + 'static)) -> Option<String> {
    let mut next: Option<&(dyn StdError + 'static)> = Some(err);
    while let Some(e) = next {
        if let Some(tls) = e.downcast_ref::<rustls::Error>() {
            return Some(tls.to_string());
        }
        // tokio-rustls reports a failed handshake as an io::Error wrapping the rustls error, and
        // hyper-rustls wraps that in one more io::Error; io::Error's `source` skips the error it
        // wraps, so unwrap those by hand.
        next = match e.downcast_ref::<std::io::Error>().and_then(|io| io.get_ref()) {
            Some(inner) => Some(inner as &(dyn StdError + 'static)),
            None => e.source(),
        };
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bundle_without_certificates_is_refused_with_its_path() {
        let e = roots_from_pem("/etc/ca.pem", b"not pem at all").unwrap_err();
        assert!(e.contains("/etc/ca.pem") && e.contains("no CERTIFICATE"), "{e}");
        let key_only = b"-----BEGIN PRIVATE KEY-----\nMC4CAQAwBQYDK2VwBCIEIA==\n-----END PRIVATE KEY-----\n";
        assert!(roots_from_pem("k.pem", key_only).unwrap_err().contains("no CERTIFICATE"));
    }

    #[test]
    fn a_missing_bundle_is_refused_with_its_path() {
        let e = client_config(Some("/nonexistent/pdgate-ca.pem")).unwrap_err();
        assert!(e.contains("/nonexistent/pdgate-ca.pem") && e.contains("cannot read"), "{e}");
    }

    #[test]
    fn the_system_store_builds_a_config() {
        assert!(client_config(None).is_ok());
    }

    #[test]
    fn tls_errors_are_found_inside_io_errors() {
        let inner = rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer);
        let io = std::io::Error::new(std::io::ErrorKind::InvalidData, inner);
        let cause = tls_cause(&io).unwrap();
        assert!(cause.contains("invalid peer certificate"), "{cause}");
        // As hyper-rustls hands it over: one more io::Error around tokio-rustls's.
        let inner = rustls::Error::InvalidCertificate(rustls::CertificateError::Expired);
        let twice = std::io::Error::other(std::io::Error::new(std::io::ErrorKind::InvalidData, inner));
        assert!(tls_cause(&twice).unwrap().contains("invalid peer certificate"));
        let plain = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        assert_eq!(tls_cause(&plain), None);
    }
}
