//! The framework floor for `bench/gateway/standalone_cpu.sh`: the least a reverse proxy built on
//! the same stack as pdgate (tokio, hyper server, hyper-util pooled client) can do per request.
//! It reads the body, forwards it to one upstream and relays the answer: no validation, no
//! routing, no metrics, no deadlines, no error handling. Not a product; a baseline to measure
//! pdgate's own overhead against in the same run.
//!
//!   cargo build --release -p pdgate-gateway --example hyper_floor
//!   target/release/examples/hyper_floor PORT http://127.0.0.1:UPSTREAM_PORT
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the failure report

use std::convert::Infallible;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response, StatusCode};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::{TokioExecutor, TokioIo};

type Upstream = Client<HttpConnector, Full<Bytes>>;

async fn forward(client: Upstream, base: &'static str, req: Request<hyper::body::Incoming>) -> Response<Full<Bytes>> {
    let fail = |_| Response::builder().status(StatusCode::BAD_GATEWAY).body(Full::new(Bytes::new())).unwrap_or_default();
    let (parts, body) = req.into_parts();
    let body = match body.collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return fail(e.to_string()),
    };
    let up = match Request::post(format!("{base}{}", parts.uri.path())).header("content-type", "application/json").body(Full::new(body)) {
        Ok(r) => r,
        Err(e) => return fail(e.to_string()),
    };
    match client.request(up).await {
        Ok(resp) => {
            let (head, body) = resp.into_parts();
            match body.collect().await {
                Ok(b) => Response::from_parts(head, Full::new(b.to_bytes())),
                Err(e) => fail(e.to_string()),
            }
        }
        Err(e) => fail(e.to_string()),
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let (Some(port), Some(upstream)) = (args.get(1), args.get(2)) else {
        return Err("usage: hyper_floor PORT UPSTREAM_URL".into());
    };
    let base: &'static str = Box::leak(upstream.trim_end_matches('/').to_string().into_boxed_str());
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Upstream = Client::builder(TokioExecutor::new()).build(connector);
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port.parse::<u16>()?)).await?;
    loop {
        let (stream, _) = listener.accept().await?;
        stream.set_nodelay(true)?;
        let client = client.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req| {
                let client = client.clone();
                async move { Ok::<_, Infallible>(forward(client, base, req).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), svc).await;
        });
    }
}
