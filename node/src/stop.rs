//! Stop sequences, checked on incrementally decoded text at the worker.
//!
//! Text that could still be the start of a stop sequence is held back, so the stop text is
//! never emitted: when a sequence matches, generation halts at once and everything before the
//! match (and nothing after) has been sent.

/// Tracks generated text against a set of stop strings.
#[derive(Clone, Debug, Default)]
pub struct StopChecker {
    stops: Vec<String>,
    max_len: usize,
    text: String,
    emitted: usize,
}

/// What a new piece of text produced.
#[derive(Debug, PartialEq, Eq)]
pub struct StopStep {
    /// Text that is now safe to emit.
    pub emit: String,
    /// The stop sequence that matched, if any.
    pub matched: Option<String>,
}

impl StopChecker {
    pub fn new(stops: &[String]) -> Self {
        let stops: Vec<String> = stops.iter().filter(|s| !s.is_empty()).cloned().collect();
        let max_len = stops.iter().map(|s| s.len()).max().unwrap_or(0);
        StopChecker { stops, max_len, text: String::new(), emitted: 0 }
    }

    pub fn push(&mut self, delta: &str) -> StopStep {
        if self.stops.is_empty() {
            return StopStep { emit: delta.to_string(), matched: None };
        }
        self.text.push_str(delta);
        // A match must start at or after `emitted` (held-back text covers any earlier start).
        let from = self.emitted;
        let hay = &self.text[from..];
        let mut best: Option<(usize, &String)> = None;
        for s in &self.stops {
            if let Some(p) = hay.find(s.as_str()) {
                if best.is_none_or(|(bp, bs)| p < bp || (p == bp && s.len() > bs.len())) {
                    best = Some((p, s));
                }
            }
        }
        if let Some((p, s)) = best {
            let emit = hay[..p].to_string();
            let matched = s.clone();
            self.emitted = from + p;
            return StopStep { emit, matched: Some(matched) };
        }
        // Hold back the longest suffix that is a proper prefix of some stop sequence.
        let mut hold = 0;
        for s in &self.stops {
            let max_k = (s.len() - 1).min(hay.len());
            for k in (1..=max_k).rev() {
                if k <= hold {
                    break;
                }
                if s.is_char_boundary(k) && hay.ends_with(&s[..k]) {
                    hold = k;
                    break;
                }
            }
        }
        let upto = hay.len() - hold;
        let emit = hay[..upto].to_string();
        self.emitted = from + upto;
        // Keep the buffer short: nothing before `emitted - max_len` can matter any more.
        if self.emitted > 4 * self.max_len.max(64) {
            let mut cut = self.emitted - self.max_len;
            while !self.text.is_char_boundary(cut) {
                cut -= 1;
            }
            self.text.drain(..cut);
            self.emitted -= cut;
        }
        StopStep { emit, matched: None }
    }

    /// Text held back at the end of generation (no stop matched).
    pub fn flush(&mut self) -> String {
        let rest = self.text[self.emitted..].to_string();
        self.emitted = self.text.len();
        rest
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], deltas: &[&str]) -> (String, Option<String>) {
        let mut c = StopChecker::new(&stops.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        let mut out = String::new();
        for d in deltas {
            let st = c.push(d);
            out.push_str(&st.emit);
            if st.matched.is_some() {
                return (out, st.matched);
            }
        }
        out.push_str(&c.flush());
        (out, None)
    }

    #[test]
    fn stops_across_deltas_without_emitting_the_stop() {
        assert_eq!(run(&["END"], &["hello E", "N", "D more"]), ("hello ".into(), Some("END".into())));
        assert_eq!(run(&["\n\n"], &["a\n", "\nb"]), ("a".into(), Some("\n\n".into())));
        assert_eq!(run(&["xyz"], &["abc", "xy"]), ("abcxy".into(), None));
        assert_eq!(run(&[], &["abc"]), ("abc".into(), None));
        // The earliest match wins.
        assert_eq!(run(&["cd", "b"], &["abcd"]), ("a".into(), Some("b".into())));
        // Multi-byte text is never split.
        assert_eq!(run(&["é!"], &["café", "!"]), ("caf".into(), Some("é!".into())));
    }
}
