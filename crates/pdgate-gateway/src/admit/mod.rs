//! Admission: `--max-concurrent-requests`, its priority queue, predicted-wait shedding and
//! queue timeouts (`admission.rs`, open it first; the queue itself in `queue.rs`). Runs as a
//! route layer before a request reaches `exec`. May use `observe` and the leaves; nothing of
//! `exec`, `fleet` or `clients`.

pub mod admission;
pub mod queue;
