//! Workers behind TLS for the tests: a private CA made in the test (rcgen), mock engines served
//! over TLS with a certificate it signs, and a record of the `Authorization` header of every
//! request a worker receives.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use axum::extract::Request;
use axum::middleware::Next;
use axum::response::Response;
use axum::Router;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::ServerConfig;

/// A certificate authority that exists only for one test.
pub struct TestCa {
    pub pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl TestCa {
    pub fn new(name: &str) -> TestCa {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
        let key = KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        TestCa { pem: cert.pem(), issuer: Issuer::new(params, key) }
    }

    /// A server certificate for `names` (DNS names or IP literals) and its key, signed by this CA.
    pub fn server_config(&self, names: &[&str]) -> Arc<ServerConfig> {
        let params = CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>()).unwrap();
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        let chain = vec![CertificateDer::from(cert.der().to_vec())];
        let key = PrivateKeyDer::from_pem_slice(key.serialize_pem().as_bytes()).unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .unwrap();
        Arc::new(config)
    }

    /// Writes the CA certificate to a fresh file, as `--worker-ca-cert` reads it.
    pub fn write_pem(&self) -> String {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let n = SEQ.fetch_add(1, Ordering::SeqCst);
        let path = std::env::temp_dir().join(format!("pdgate-test-ca-{}-{n}.pem", std::process::id()));
        std::fs::write(&path, &self.pem).unwrap();
        path.to_string_lossy().into_owned()
    }
}

/// The TLS settings a server uses for its next connections (a test swaps them to present
/// another certificate).
pub type ServerTls = Arc<Mutex<Arc<ServerConfig>>>;

/// Serves `app` over TLS on loopback; `keep_alive` false closes each connection after one
/// request, so every request makes a fresh handshake.
pub async fn serve(app: Router, tls: ServerTls, keep_alive: bool) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else { return };
            let acceptor = tokio_rustls::TlsAcceptor::from(tls.lock().unwrap().clone());
            let app = app.clone();
            tokio::spawn(async move {
                // A refused handshake (the gateway does not trust us) just ends the connection.
                let Ok(stream) = acceptor.accept(tcp).await else { return };
                let service = TowerToHyperService::new(app);
                let _ = hyper::server::conn::http1::Builder::new().keep_alive(keep_alive).serve_connection(TokioIo::new(stream), service).await;
            });
        }
    });
    addr
}

/// (path, `Authorization` header or "") of every request a worker received.
#[derive(Clone, Default)]
pub struct Seen(pub Arc<Mutex<Vec<(String, String)>>>);

impl Seen {
    pub fn all(&self) -> Vec<(String, String)> {
        self.0.lock().unwrap().clone()
    }
    pub fn paths(&self) -> Vec<String> {
        self.all().into_iter().map(|(p, _)| p).collect()
    }
}

/// `app` with every request's path and `Authorization` header recorded in `seen`.
pub fn recording(app: Router, seen: Seen) -> Router {
    // An explicit fallback, so that paths the mock does not serve (e.g. /server_info) pass the
    // recording layer too.
    app.fallback(|| async { axum::http::StatusCode::NOT_FOUND }).layer(axum::middleware::from_fn(move |req: Request, next: Next| {
        let seen = seen.clone();
        async move {
            let auth = req.headers().get("authorization").and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
            seen.0.lock().unwrap().push((req.uri().path().to_string(), auth));
            let resp: Response = next.run(req).await;
            resp
        }
    }))
}
