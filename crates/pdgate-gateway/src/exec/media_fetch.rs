//! Remote images for EPD (`--allowed-media-domains`, vLLM's flag name): an `http(s)://`
//! `image_url` whose host is listed is fetched by the gateway, once per request, and put back
//! in the body as a `data:` URL, so every leg (encode, prefill, decode) sees the same bytes and
//! no engine fetches anything. Without the flag nothing is fetched and `encode::find_images`
//! refuses the URL (400).
//!
//! Only listed hosts (exact match, any port) are fetched: the gateway sits inside the fleet's
//! network, and a client must not make it GET an internal address. A fetch must answer 200 with
//! an `image/*` type within `--media-fetch-timeout-secs` and the request's deadline, at most
//! `--max-image-bytes`; redirects are not followed (a redirect could leave the list). Every
//! failure is the client's 400, naming the image, before any leg is sent.

use base64::Engine as _;
use futures_util::future::try_join_all;
use http_body_util::BodyExt;
use hyper::body::Body;
use pdgate_core::{GatewayError, Leg};
use pdgate_protocol::Endpoint;
use tokio::time::Instant;

use super::Ctx;

/// Fetches the request's listed remote images and writes them into its body as `data:` URLs.
/// Does nothing outside EPD, without the flag, or for a body with no remote image.
pub async fn inline_remote_images(ctx: &mut Ctx) -> Result<(), GatewayError> {
    let config = &ctx.state.config;
    if config.allowed_media_domains.is_empty() || !config.epd_disaggregation || ctx.req.endpoint != Endpoint::ChatCompletions {
        return Ok(());
    }
    let remote: Vec<(usize, String)> =
        pdgate_protocol::media::image_urls(&ctx.req.body).into_iter().enumerate().filter_map(|(i, u)| u.filter(|u| is_remote(u)).map(|u| (i, u.to_string()))).collect();
    if remote.is_empty() {
        return Ok(());
    }
    let by = ctx.deadline.min(Instant::now() + std::time::Duration::from_secs(config.media_fetch_timeout_secs));
    let fetches = remote.iter().map(|(i, url)| fetch(ctx, *i, url, by));
    let fetched = try_join_all(fetches).await?;
    let data = remote.into_iter().map(|(i, _)| i).zip(fetched).collect();
    pdgate_protocol::media::replace_image_urls(&mut ctx.req.body, data);
    ctx.req.rewritten = true;
    Ok(())
}

fn is_remote(url: &str) -> bool {
    url.starts_with("http://") || url.starts_with("https://")
}

/// One image, as a `data:` URL.
async fn fetch(ctx: &Ctx, index: usize, url: &str, by: Instant) -> Result<String, GatewayError> {
    let config = &ctx.state.config;
    let refuse = |why: String| GatewayError::invalid(Some("messages"), format!("image {index} ({url}): {why}"));
    let uri: hyper::Uri = url.parse().map_err(|e| refuse(format!("not a valid URL: {e}")))?;
    let host = uri.host().unwrap_or_default();
    if !config.allowed_media_domains.iter().any(|d| d.eq_ignore_ascii_case(host)) {
        return Err(refuse(format!("the host {host:?} is not in --allowed-media-domains; send the image as a data: URL")));
    }
    let secs = config.media_fetch_timeout_secs;
    let timed_out = || refuse(format!("not fetched within {secs}s (--media-fetch-timeout-secs) or the request's deadline"));
    let answer = tokio::time::timeout_at(by, ctx.state.fleet.upstream.get_keyed(url, Leg::Encode, false)).await.map_err(|_| timed_out())?;
    // The client's error names the cause, not the worker wording of the shared client's message.
    let answer = answer.map_err(|e| refuse(format!("could not be fetched: {}", e.message.split_once("unreachable: ").map_or(e.message.as_str(), |(_, cause)| cause))))?;
    let status = answer.status();
    if status != hyper::StatusCode::OK {
        let why = if status.is_redirection() { format!("answered {status}; redirects are not followed") } else { format!("answered {status}") };
        return Err(refuse(why));
    }
    let mime = answer.headers().get(hyper::header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).and_then(|v| v.split(';').next()).unwrap_or_default().trim().to_ascii_lowercase();
    if !mime.starts_with("image/") {
        return Err(refuse(format!("its content type is {mime:?}, not image/*")));
    }
    let limit = config.max_image_bytes;
    let too_large = || refuse(format!("larger than {limit} bytes (--max-image-bytes)"));
    let mut body = answer.into_body();
    if body.size_hint().lower() > limit as u64 {
        return Err(too_large());
    }
    let mut bytes = Vec::new();
    while let Some(frame) = tokio::time::timeout_at(by, body.frame()).await.map_err(|_| timed_out())? {
        let frame = frame.map_err(|e| refuse(format!("broke off while being read: {e}")))?;
        if let Ok(data) = frame.into_data() {
            if bytes.len() + data.len() > limit {
                return Err(too_large());
            }
            bytes.extend_from_slice(&data);
        }
    }
    if bytes.is_empty() {
        return Err(refuse("the answer is empty".into()));
    }
    Ok(format!("data:{mime};base64,{}", base64::engine::general_purpose::STANDARD.encode(&bytes)))
}
