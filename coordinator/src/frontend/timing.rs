//! Where a request's time went, as a proxy tier would report it: the split of one generation
//! request into phases that add up to its whole time, for the W3C `server-timing` header, the
//! final event of a stream, and the `zerolayer_request_phase_seconds` histograms.
//!
//! The phases partition the request, end to end on this coordinator:
//! - `prepare`: from admission (after authentication) until the sequence was submitted to a
//!   worker: parsing, the chat template, tokenizing, the grammar, placement;
//! - `queue`: submitted until the worker admitted the prompt into its running batch;
//! - `prefill`: admitted until the first output token arrived;
//! - `decode`: the first output token until the end.
//!
//! `migrate` is not a phase of its own but a part of the others: the time a sequence spent
//! between leaving a worker (drained or lost) and its continuation's next token elsewhere.
//!
//! Pure: it is told the instants, and never reads a clock.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// A request's instants, as its response follows it.
#[derive(Clone, Debug)]
pub struct Timing {
    arrived: Instant,
    submitted: Instant,
    admitted: Option<Instant>,
    first_token: Option<Instant>,
    finished: Option<Instant>,
}

impl Timing {
    pub fn new(arrived: Instant, submitted: Instant) -> Self {
        Timing { arrived, submitted: submitted.max(arrived), admitted: None, first_token: None, finished: None }
    }

    /// The worker admitted the prompt (the first `Started`; a continuation's is not counted).
    pub fn on_admitted(&mut self, at: Instant) {
        self.admitted.get_or_insert(at);
    }

    /// Output tokens arrived.
    pub fn on_tokens(&mut self, at: Instant) {
        self.on_admitted(at);
        self.first_token.get_or_insert(at);
    }

    /// The sequence is over.
    pub fn on_finished(&mut self, at: Instant) {
        self.on_admitted(at);
        self.finished.get_or_insert(at);
    }

    pub fn arrived(&self) -> Instant {
        self.arrived
    }

    /// The split up to `now` (or to the end, once finished). Phases not reached yet are zero;
    /// each phase ends where the next begins, so they add up to `total`.
    pub fn split(&self, now: Instant, migrate: Duration) -> Split {
        let end = self.finished.unwrap_or(now).max(self.submitted);
        let admitted = self.admitted.unwrap_or(end).clamp(self.submitted, end);
        let first = self.first_token.unwrap_or(end).clamp(admitted, end);
        Split {
            prepare: self.submitted - self.arrived,
            queue: admitted - self.submitted,
            prefill: first - admitted,
            decode: end - first,
            total: end - self.arrived,
            migrate,
        }
    }
}

/// A request's time, by phase.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Split {
    pub prepare: Duration,
    pub queue: Duration,
    pub prefill: Duration,
    pub decode: Duration,
    pub total: Duration,
    /// Time spent continuing elsewhere after a move or a loss (inside the phases above).
    pub migrate: Duration,
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

impl Split {
    /// The phases that partition the request, by name.
    pub fn phases(&self) -> [(&'static str, Duration); 4] {
        [("prepare", self.prepare), ("queue", self.queue), ("prefill", self.prefill), ("decode", self.decode)]
    }

    /// The W3C `server-timing` value: each phase, `total`, and `migrate` when the sequence
    /// moved. Durations in milliseconds, to the microsecond.
    pub fn header(&self) -> String {
        let mut parts: Vec<String> = self.phases().iter().map(|(n, d)| format!("{n};dur={}", ms(*d))).collect();
        parts.push(format!("total;dur={}", ms(self.total)));
        if !self.migrate.is_zero() {
            parts.push(format!("migrate;dur={}", ms(self.migrate)));
        }
        parts.join(", ")
    }

    /// The same split for a stream's final event (`usage.server_timing`, milliseconds).
    pub fn json(&self) -> Value {
        let mut v = json!({});
        for (n, d) in self.phases() {
            v[format!("{n}_ms")] = json!(ms(d));
        }
        v["total_ms"] = json!(ms(self.total));
        if !self.migrate.is_zero() {
            v["migrate_ms"] = json!(ms(self.migrate));
        }
        v
    }

    /// The header a stream's response starts with: only `prepare` is over when it leaves.
    pub fn stream_header(&self) -> String {
        format!("prepare;dur={}", ms(self.prepare))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(t0: Instant, ms: u64) -> Instant {
        t0 + Duration::from_millis(ms)
    }

    #[test]
    fn phases_partition_the_request() {
        let t0 = Instant::now();
        let mut t = Timing::new(t0, at(t0, 3));
        t.on_admitted(at(t0, 10));
        t.on_admitted(at(t0, 99)); // a continuation's Started is not a second admission
        t.on_tokens(at(t0, 30));
        t.on_tokens(at(t0, 50));
        t.on_finished(at(t0, 80));
        let s = t.split(at(t0, 500), Duration::from_millis(7));
        let ms = |n| Duration::from_millis(n);
        assert_eq!((s.prepare, s.queue, s.prefill, s.decode, s.total), (ms(3), ms(7), ms(20), ms(50), ms(80)));
        assert_eq!(s.phases().iter().map(|p| p.1).sum::<Duration>(), s.total);
        assert_eq!(s.header(), "prepare;dur=3, queue;dur=7, prefill;dur=20, decode;dur=50, total;dur=80, migrate;dur=7");
        assert_eq!(s.json()["prefill_ms"], 20.0);
    }

    #[test]
    fn a_request_with_no_output_has_no_decode() {
        let t0 = Instant::now();
        let mut t = Timing::new(t0, at(t0, 2));
        t.on_finished(at(t0, 9));
        let s = t.split(at(t0, 100), Duration::ZERO);
        assert_eq!((s.queue, s.prefill, s.decode, s.total), (Duration::from_millis(7), Duration::ZERO, Duration::ZERO, Duration::from_millis(9)));
        assert!(!s.header().contains("migrate"));
        // Unfinished: the split runs to now.
        let u = Timing::new(t0, at(t0, 2)).split(at(t0, 40), Duration::ZERO);
        assert_eq!((u.queue, u.total), (Duration::from_millis(38), Duration::from_millis(40)));
    }
}
