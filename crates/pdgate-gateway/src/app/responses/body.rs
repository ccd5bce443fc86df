//! The `/v1/responses` stream's answer body: the chat stream's frames through the
//! [`StreamTranslator`] as the client's connection polls them, the Response kept in the store
//! before the client sees its terminal event (a `GET` right after it finds the response). A
//! body of its own, not `Body::from_stream` over an `unfold`, as `messages_body.rs` is (the
//! unfold's layers cost ~6 k instructions per request; docs/performance.md, "Fifth pass").

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use axum::body::{Body, Bytes};
use hyper::body::{Body as HttpBody, Frame};
use pdgate_protocol::responses::StreamTranslator;

use super::store::ResponseStore;
use super::{keep, Turn};

type Keeping = Pin<Box<dyn Future<Output = ()> + Send>>;

/// The chat stream (`inner`) is read to its end, even after the terminal event, so the relay
/// finishes (accounting, breakers) as for a chat client; `over` once the translator's `end`
/// ran.
pub(super) struct ResponsesBody {
    inner: Body,
    t: StreamTranslator,
    /// `response.created` and `response.in_progress`, sent first.
    head: Option<Bytes>,
    over: bool,
    /// The response's id and this turn, until the response is kept.
    unkept: Option<(String, Turn)>,
    store: Arc<dyn ResponseStore>,
    /// The store's put in flight, and the events (the terminal one among them) held until it
    /// is done.
    keeping: Option<(Keeping, Vec<u8>)>,
}

impl ResponsesBody {
    pub(super) fn new(inner: Body, mut t: StreamTranslator, id: String, turn: Turn, store: Arc<dyn ResponseStore>) -> Self {
        let head = Some(Bytes::from(t.start()));
        ResponsesBody { inner, t, head, over: false, unkept: Some((id, turn)), store, keeping: None }
    }
}

fn data(out: Vec<u8>) -> Poll<Option<Result<Frame<Bytes>, std::convert::Infallible>>> {
    Poll::Ready(Some(Ok(Frame::data(Bytes::from(out)))))
}

impl HttpBody for ResponsesBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        if let Some(h) = this.head.take() {
            return Poll::Ready(Some(Ok(Frame::data(h))));
        }
        if let Some((put, _)) = this.keeping.as_mut() {
            ready!(put.as_mut().poll(cx));
            if let Some((_, out)) = this.keeping.take().filter(|(_, out)| !out.is_empty()) {
                return data(out);
            }
        }
        while !this.over {
            let out = match ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(bytes) => this.t.feed(&bytes),
                    // Trailers: nothing to translate.
                    Err(_) => continue,
                },
                // The relay ends a broken stream with its own error event; a body error here
                // is the client side going away or a bug: end the Responses stream validly.
                Some(Err(_)) | None => {
                    this.over = true;
                    this.t.end()
                }
            };
            // Both taken only once the terminal is there (a tuple would take the turn at once).
            if let Some((done, (id, turn))) = this.t.take_terminal().and_then(|done| Some((done, this.unkept.take()?))) {
                let store = this.store.clone();
                let mut put: Keeping = Box::pin(async move { keep(store.as_ref(), &id, turn, Bytes::from(done.json), done.output, done.status).await });
                if put.as_mut().poll(cx).is_pending() {
                    this.keeping = Some((put, out));
                    return Poll::Pending;
                }
            }
            if !out.is_empty() {
                return data(out);
            }
        }
        Poll::Ready(None)
    }

    fn is_end_stream(&self) -> bool {
        self.over && self.head.is_none() && self.keeping.is_none()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use axum::body::{Body, Bytes};
    use http_body_util::BodyExt;
    use pdgate_protocol::responses::{parse_responses, ResponseMeta, StreamTranslator};

    use super::super::store::{Bounds, MemoryStore, ResponseStore};
    use super::super::Turn;
    use super::ResponsesBody;

    const CHAT: &str = concat!(
        "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"finish_reason\":null}]}\n\n",
        "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Paris\"},\"finish_reason\":null}]}\n\n",
        "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n",
        "data: [DONE]\n\n",
    );

    /// The response is kept before the frame with its terminal event goes out, and only then:
    /// the frames before it (the head, the deltas) leave the turn unkept.
    #[tokio::test]
    async fn the_response_is_kept_before_its_terminal_event_is_sent() {
        let store: Arc<dyn ResponseStore> = Arc::new(MemoryStore::new(Bounds { max_entries: 8, max_bytes: 1 << 20, ttl: Duration::from_secs(60) }));
        let req = parse_responses(br#"{"model":"m","input":"The capital of France is","stream":true}"#).unwrap_or_else(|e| panic!("{e:?}"));
        let id = "resp_0123456789abcdef0123456789abcdef".to_string();
        let meta = ResponseMeta { id: id.clone(), created_at: 1, echo: req.echo.clone() };
        let chunks = CHAT.split_inclusive("\n\n").map(|c| Ok::<_, std::convert::Infallible>(Bytes::from(c)));
        let inner = Body::from_stream(futures_util::stream::iter(chunks));
        let mut body = ResponsesBody::new(inner, StreamTranslator::new(meta), id.clone(), Turn { req, history: Vec::new() }, store.clone());
        let mut seen = Vec::new();
        while let Some(frame) = body.frame().await {
            let Ok(data) = frame.unwrap_or_else(|e| match e {}).into_data() else { continue };
            let mark = b"event: response.completed\n";
            let terminal = data.windows(mark.len()).any(|w| w == mark);
            assert_eq!(store.get(&id).await.is_some(), terminal || seen.iter().any(|t: &bool| *t), "kept exactly from the terminal frame on");
            seen.push(terminal);
        }
        assert!(seen.iter().any(|t| *t), "a response.completed event went out");
        let kept = store.get(&id).await.unwrap_or_else(|| panic!("not kept"));
        assert_eq!(kept.input.len(), 1);
        assert!(String::from_utf8_lossy(&kept.response).contains("Paris"));
    }
}
