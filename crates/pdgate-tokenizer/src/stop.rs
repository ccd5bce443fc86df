//! Stop strings and stop token ids over a detokenized stream. Text that could still be the start
//! of a stop string is held back until it either completes the stop (and is dropped, with the
//! text after it) or can no longer match (and is released).

use std::collections::HashSet;

use crate::detok::IncrementalDecoder;
use crate::error::TokenizerError;

/// Which stop ended the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopMatch {
    /// One of the request's stop strings (OpenAI `stop`).
    Text(String),
    /// One of the stop token ids (`stop_token_ids`, or the model's EOS).
    TokenId(u32),
}

/// Matches stop strings across chunk boundaries.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

impl StopMatcher {
    /// Empty stop strings are ignored (they would match everywhere).
    pub fn new(stops: impl IntoIterator<Item = String>) -> Self {
        Self { stops: stops.into_iter().filter(|s| !s.is_empty()).collect(), held: String::new() }
    }

    /// Feeds new text; returns what may be emitted now, and the stop when one matched (the stop
    /// string and everything after it are not emitted).
    pub fn push(&mut self, text: &str) -> (String, Option<StopMatch>) {
        self.held.push_str(text);
        if let Some((at, stop)) = self.earliest_match() {
            let emit = self.held[..at].to_owned();
            self.held.clear();
            return (emit, Some(StopMatch::Text(stop)));
        }
        let keep = self.partial_suffix_len();
        let emit = self.held[..self.held.len() - keep].to_owned();
        self.held.drain(..self.held.len() - keep);
        (emit, None)
    }

    /// At the end of the stream: the held text, which no stop can complete any more.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    fn earliest_match(&self) -> Option<(usize, String)> {
        self.stops.iter().filter_map(|s| self.held.find(s.as_str()).map(|at| (at, s))).min_by_key(|(at, _)| *at).map(|(at, s)| (at, s.clone()))
    }

    /// Length of the longest suffix of the held text that is a proper prefix of some stop.
    fn partial_suffix_len(&self) -> usize {
        let held = self.held.as_str();
        let mut best = 0;
        for stop in &self.stops {
            let longest = stop.len().saturating_sub(1).min(held.len());
            for len in (best + 1..=longest).rev() {
                let start = held.len() - len;
                if held.is_char_boundary(start) && stop.starts_with(&held[start..]) {
                    best = len;
                    break;
                }
            }
        }
        best
    }
}

/// One step's output of a [`StreamDecoder`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StreamStep {
    /// Text safe to send to the client now.
    pub text: String,
    /// Set once, when a stop ended the stream; later tokens are ignored.
    pub stop: Option<StopMatch>,
}

/// What an engine's text does with a tail that decodes to U+FFFD (an incomplete or invalid
/// UTF-8 sequence at the end of the answer). The engines differ, and a gateway that writes the
/// text from token ids must write what the engine's own HTTP surface would.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ReplacementTail {
    /// Sent as U+FFFD at the end, as a one-shot decode of the whole answer shows it (SGLang,
    /// the reference engine).
    #[default]
    Lossy,
    /// vLLM's detokenizer (tokenizers' `DecodeStream`, vllm/v1/engine/detokenizer.py): text
    /// since the last emission is held while it ends in U+FFFD, and what is still held when the
    /// answer ends is never sent.
    Dropped,
}

const REPLACEMENT: char = '\u{FFFD}';

/// Incremental detokenizer plus stop handling: what a streaming route feeds token ids into.
pub struct StreamDecoder<'t> {
    decoder: IncrementalDecoder<'t>,
    stop_strings: StopMatcher,
    stop_ids: HashSet<u32>,
    stopped: bool,
    tail: ReplacementTail,
    /// With [`ReplacementTail::Dropped`]: decoded text not yet released (it ends in U+FFFD).
    held: String,
}

impl<'t> StreamDecoder<'t> {
    pub fn new(decoder: IncrementalDecoder<'t>, stop_strings: StopMatcher, stop_ids: impl IntoIterator<Item = u32>) -> Self {
        Self { decoder, stop_strings, stop_ids: stop_ids.into_iter().collect(), stopped: false, tail: ReplacementTail::Lossy, held: String::new() }
    }

    /// The same decoder with the engine's rule for a U+FFFD tail.
    pub fn with_tail(mut self, tail: ReplacementTail) -> Self {
        self.tail = tail;
        self
    }

    /// New decoded text, minus what the tail rule holds back.
    fn release(&mut self, delta: String) -> String {
        if self.tail == ReplacementTail::Lossy {
            return delta;
        }
        self.held.push_str(&delta);
        if self.held.ends_with(REPLACEMENT) {
            return String::new();
        }
        std::mem::take(&mut self.held)
    }

    /// The decoder's last text at the end of the answer, after the tail rule.
    fn end_text(&mut self) -> Result<String, TokenizerError> {
        let rest = self.decoder.finish()?;
        if self.tail == ReplacementTail::Lossy {
            return Ok(rest);
        }
        let rest = std::mem::take(&mut self.held) + &rest;
        Ok(if rest.ends_with(REPLACEMENT) { String::new() } else { rest })
    }

    /// Feeds one generated token. A stop token id ends the stream without its text; the text
    /// held for stop strings is released first (a stop id means no stop string can complete).
    pub fn push(&mut self, id: u32) -> Result<StreamStep, TokenizerError> {
        if self.stopped {
            return Ok(StreamStep::default());
        }
        if self.stop_ids.contains(&id) {
            self.stopped = true;
            let mut text = self.end_text()?;
            let (emit, stop) = self.stop_strings.push(&text);
            if let Some(stop) = stop {
                return Ok(StreamStep { text: emit, stop: Some(stop) });
            }
            text = emit + &self.stop_strings.finish();
            return Ok(StreamStep { text, stop: Some(StopMatch::TokenId(id)) });
        }
        let delta = self.decoder.push(&[id])?;
        let delta = self.release(delta);
        let (text, stop) = self.stop_strings.push(&delta);
        self.stopped = stop.is_some();
        Ok(StreamStep { text, stop })
    }

    /// At the end of the stream (length limit or the worker finished): everything still held.
    pub fn finish(&mut self) -> Result<String, TokenizerError> {
        if self.stopped {
            return Ok(String::new());
        }
        self.stopped = true;
        let tail = self.end_text()?;
        let (emit, stop) = self.stop_strings.push(&tail);
        if stop.is_some() {
            return Ok(emit);
        }
        Ok(emit + &self.stop_strings.finish())
    }
}

#[cfg(test)]
mod tests {
    use super::{StopMatch, StopMatcher};

    fn run(stops: &[&str], chunks: &[&str]) -> (String, Option<StopMatch>) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()));
        let mut out = String::new();
        for c in chunks {
            let (emit, stop) = m.push(c);
            out += &emit;
            if stop.is_some() {
                return (out, stop);
            }
        }
        out += &m.finish();
        (out, None)
    }

    #[test]
    fn stop_spanning_three_chunks_is_found_and_dropped() {
        let (out, stop) = run(&["<|end|>"], &["hello <|", "en", "d|> tail"]);
        assert_eq!(out, "hello ");
        assert_eq!(stop, Some(StopMatch::Text("<|end|>".into())));
    }

    #[test]
    fn partial_stop_is_released_when_it_cannot_match() {
        let mut m = StopMatcher::new(["STOP".to_string()]);
        assert_eq!(m.push("a ST"), ("a ".into(), None));
        assert_eq!(m.push("OP?"), (String::new(), Some(StopMatch::Text("STOP".into()))));
        let mut m = StopMatcher::new(["STOP".to_string()]);
        assert_eq!(m.push("a ST"), ("a ".into(), None));
        assert_eq!(m.push("ack"), ("STack".into(), None));
    }

    #[test]
    fn earliest_of_several_stops_wins() {
        let (out, stop) = run(&["bcd", "abcx"], &["zab", "cd"]);
        assert_eq!(out, "za");
        assert_eq!(stop, Some(StopMatch::Text("bcd".into())));
    }

    #[test]
    fn multibyte_stop_split_mid_string_is_held() {
        let (out, stop) = run(&["終わり"], &["これで終", "わり。"]);
        assert_eq!(out, "これで");
        assert_eq!(stop, Some(StopMatch::Text("終わり".into())));
    }

    #[test]
    fn unmatched_tail_is_released_at_finish() {
        assert_eq!(run(&["###"], &["x #", "#"]), ("x ##".into(), None));
    }

    #[test]
    fn every_split_of_text_gives_same_output_as_one_chunk() {
        let text = "ab<stop>cd";
        for i in 0..=text.len() {
            let (out, stop) = run(&["<stop>"], &[&text[..i], &text[i..]]);
            assert_eq!((out.as_str(), stop), ("ab", Some(StopMatch::Text("<stop>".into()))), "split at {i}");
        }
    }
}
