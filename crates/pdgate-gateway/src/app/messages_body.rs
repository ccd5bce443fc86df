//! The `/v1/messages` stream's answer body: the chat stream's frames through the translator as
//! the client's connection polls them. A body of its own, not `Body::from_stream` over an
//! `unfold`: those layers (a data stream, the unfold's future, a stream body) cost ~2 k
//! instructions per request in the translation benchmark (docs/performance.md, fourth pass).

use std::pin::Pin;
use std::task::{ready, Context, Poll};

use axum::body::{Body, Bytes};
use hyper::body::{Body as HttpBody, Frame};
use pdgate_protocol::anthropic::stream::MessagesStream;

/// The chat stream (`inner`) read to its end, even after `message_stop` (the relay's accounting
/// finishes there); `over` once `finish` ran.
pub(crate) struct MessagesBody {
    inner: Body,
    tr: MessagesStream,
    over: bool,
}

impl MessagesBody {
    pub(crate) fn new(inner: Body, tr: MessagesStream) -> Self {
        MessagesBody { inner, tr, over: false }
    }
}

impl HttpBody for MessagesBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        while !this.over {
            let out = match ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(bytes) => this.tr.feed(&bytes),
                    // Trailers: nothing to translate.
                    Err(_) => continue,
                },
                // The relay ends a broken stream with its own error event; a body error is a cut.
                Some(Err(_)) | None => {
                    this.over = true;
                    this.tr.finish()
                }
            };
            if !out.is_empty() {
                return Poll::Ready(Some(Ok(Frame::data(Bytes::from(out)))));
            }
        }
        Poll::Ready(None)
    }

    fn is_end_stream(&self) -> bool {
        self.over
    }
}
