//! `--request-log PATH`: one JSON line per finished request, the "proxy log" that `pdgate bench`
//! replays and that analysis reads (format in docs/goodput.md).
//!
//! Lines go through a bounded channel to a writer thread of their own (file writes block, so
//! they stay off the async runtime). A request never waits for the log: when the channel is
//! full the line is dropped and counted in `pdgate_request_log_dropped_total`.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};

use prometheus::IntCounter;

/// Lines that may wait for the writer; beyond them, lines are dropped.
pub const CAPACITY: usize = 8192;

pub struct RequestLog {
    tx: SyncSender<String>,
    dropped: IntCounter,
}

impl RequestLog {
    /// Opens (appends to, creating) `path` and starts the writer thread, which ends when the
    /// log is dropped (with the gateway).
    pub fn open(path: &str, dropped: IntCounter) -> std::io::Result<RequestLog> {
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        let (log, rx) = Self::channel(CAPACITY, dropped);
        std::thread::Builder::new().name("pdgate-request-log".into()).spawn(move || write_lines(&rx, BufWriter::new(file)))?;
        Ok(log)
    }

    /// The log's sending side and the receiver a writer reads (tests hold it to fill the channel).
    pub fn channel(capacity: usize, dropped: IntCounter) -> (RequestLog, Receiver<String>) {
        let (tx, rx) = sync_channel(capacity);
        (RequestLog { tx, dropped }, rx)
    }

    /// Queues one line; never waits. A full channel (or a writer that died) drops it, counted.
    pub fn write(&self, line: String) {
        match self.tx.try_send(line) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => self.dropped.inc(),
            Err(TrySendError::Disconnected(_)) => self.dropped.inc(),
        }
    }
}

/// The writer: waits for a line, takes every line already queued, then flushes once, so a
/// burst costs one write and a quiet log is on disk at once.
fn write_lines(rx: &Receiver<String>, mut out: BufWriter<File>) {
    while let Ok(first) = rx.recv() {
        let mut ok = writeln!(out, "{first}").is_ok();
        while let Ok(line) = rx.try_recv() {
            ok &= writeln!(out, "{line}").is_ok();
        }
        if !(ok && out.flush().is_ok()) {
            tracing::warn!("cannot write the request log (--request-log); lines are being lost");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counter() -> IntCounter {
        IntCounter::new("dropped", "test").unwrap()
    }

    #[test]
    fn a_full_channel_drops_and_counts_without_waiting() {
        let dropped = counter();
        let (log, rx) = RequestLog::channel(2, dropped.clone());
        for i in 0..5 {
            log.write(format!("{{\"n\":{i}}}"));
        }
        assert_eq!(dropped.get(), 3);
        let kept: Vec<String> = rx.try_iter().collect();
        assert_eq!(kept, ["{\"n\":0}", "{\"n\":1}"]);
        // Room again once the writer caught up.
        log.write("{\"n\":5}".into());
        assert_eq!((dropped.get(), rx.try_recv().ok().as_deref()), (3, Some("{\"n\":5}")));
        drop(rx);
        log.write("late".into());
        assert_eq!(dropped.get(), 4, "a writer that is gone drops (and counts) too");
    }

    #[test]
    fn lines_reach_the_file_in_order() {
        let dir = std::env::temp_dir().join(format!("pdgate-reqlog-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("requests.jsonl");
        let _ = std::fs::remove_file(&path);
        let log = RequestLog::open(path.to_str().unwrap(), counter()).unwrap();
        for i in 0..100 {
            log.write(format!("{{\"n\":{i}}}"));
        }
        drop(log);
        // The writer flushes after each burst; poll (bounded) for the last line.
        let mut text = String::new();
        for _ in 0..200 {
            text = std::fs::read_to_string(&path).unwrap_or_default();
            if text.lines().count() == 100 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let ns: Vec<u64> = text.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["n"].as_u64().unwrap()).collect();
        assert_eq!(ns, (0..100).collect::<Vec<_>>());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
