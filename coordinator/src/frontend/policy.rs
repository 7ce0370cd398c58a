//! Policies (`[[policy.rules]]`): an input rule refuses a request whose client text matches;
//! an output rule stops an answer before any byte of the matching text leaves the server.
//!
//! Output is checked as it streams. Text is released only where no match can still begin: for
//! each rule a lazy DFA runs anchored from each held position, and a position whose run has not
//! died by the end of the text may be the start of a match that the next tokens complete, so it
//! and all after it are held back. At most [`MAX_HOLDBACK`] bytes are held; a match longer than
//! that may leak its beginning. A DFA that gives up (a Unicode `\b` before a non-ASCII byte)
//! holds conservatively.
//!
//! Pure: text in, decisions out. The audit trail and the refusal's shape are the callers'.

use std::sync::{Arc, Mutex};

use regex::Regex;
use regex_automata::hybrid::dfa::{Cache, DFA};
use regex_automata::util::start;
use regex_automata::Anchored;
use zerolayer_common::config::{PolicyRule, PolicySection};

/// The most output held back while a rule could still be matching.
pub const MAX_HOLDBACK: usize = 256;

struct Rule {
    name: String,
    re: Regex,
    dfa: DFA,
    /// One cache per rule, shared by every answer it watches (each check is short).
    cache: Mutex<Cache>,
    cfg: PolicyRule,
}

/// The compiled rules.
#[derive(Clone, Default)]
pub struct Policy {
    rules: Arc<Vec<Rule>>,
}

/// A rule matched: its name, and the matched text redacted for the audit record.
#[derive(Clone, Debug, PartialEq)]
pub struct Match {
    pub rule: String,
    pub redacted: String,
}

/// The matched text as an audit record keeps it: its first and last character and its length.
pub fn redact_span(s: &str) -> String {
    let n = s.chars().count();
    match (s.chars().next(), s.chars().last()) {
        (Some(a), Some(b)) if n > 4 => format!("{a}{}{b} ({n} characters)", "*".repeat(n.min(12) - 2)),
        _ => format!("{} ({n} characters)", "*".repeat(n)),
    }
}

impl Policy {
    pub fn new(cfg: &PolicySection) -> Result<Policy, String> {
        let mut rules = Vec::with_capacity(cfg.rules.len());
        for r in &cfg.rules {
            let re = zerolayer_common::config::compile_pattern(&r.pattern).map_err(|e| format!("policy rule {:?}: {e}", r.name))?;
            let dfa = DFA::builder()
                .configure(DFA::config().unicode_word_boundary(true))
                .build(&r.pattern)
                .map_err(|e| format!("policy rule {:?}: {e}", r.name))?;
            let cache = Mutex::new(dfa.create_cache());
            rules.push(Rule { name: r.name.clone(), re, dfa, cache, cfg: r.clone() });
        }
        Ok(Policy { rules: Arc::new(rules) })
    }

    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    /// The first input rule for `tenant` that matches one of `texts`.
    pub fn check_input<'a>(&self, tenant: &str, texts: impl IntoIterator<Item = &'a str> + Clone) -> Option<Match> {
        for r in self.rules.iter().filter(|r| r.cfg.applies_to.input() && r.cfg.covers(tenant)) {
            for t in texts.clone() {
                if let Some(m) = r.re.find(t) {
                    return Some(Match { rule: r.name.clone(), redacted: redact_span(m.as_str()) });
                }
            }
        }
        None
    }

    /// A guard over one answer for `tenant`, or `None` when no output rule covers it.
    pub fn output(&self, tenant: &str) -> Option<OutputGuard> {
        let rules: Vec<usize> = (0..self.rules.len()).filter(|&i| self.rules[i].cfg.applies_to.output() && self.rules[i].cfg.covers(tenant)).collect();
        (!rules.is_empty()).then(|| OutputGuard { policy: self.clone(), rules, held: String::new(), before: None })
    }
}

/// What the guard lets out of one piece of an answer.
#[derive(Debug, PartialEq)]
pub enum Verdict {
    /// This text may go to the client now (possibly empty: all of it is held).
    Release(String),
    /// A rule matched: `release` (the text before the match) may still go; nothing after it.
    Stop { release: String, m: Match },
}

/// One answer's output check.
pub struct OutputGuard {
    policy: Policy,
    rules: Vec<usize>,
    /// Text not yet released.
    held: String,
    /// The last byte released (a `\b` or `^` at the start of a held match looks at it).
    before: Option<u8>,
}

impl OutputGuard {
    /// `text` generated next.
    pub fn push(&mut self, text: &str) -> Verdict {
        self.held.push_str(text);
        if let Some(v) = self.stop() {
            return v;
        }
        let cut = self.rules.iter().map(|&i| self.could_start(i)).min().unwrap_or(self.held.len());
        let mut cut = cut.max(self.held.len().saturating_sub(MAX_HOLDBACK));
        while !self.held.is_char_boundary(cut) {
            cut += 1;
        }
        Verdict::Release(self.release(cut))
    }

    /// The answer is over: whatever no rule matches goes.
    pub fn finish(&mut self) -> Verdict {
        self.stop().unwrap_or_else(|| Verdict::Release(self.release(self.held.len())))
    }

    fn release(&mut self, cut: usize) -> String {
        let rest = self.held.split_off(cut);
        let out = std::mem::replace(&mut self.held, rest);
        if let Some(&b) = out.as_bytes().last() {
            self.before = Some(b);
        }
        out
    }

    /// A whole match in the held text (the released byte before it counts for look-behind).
    fn stop(&mut self) -> Option<Verdict> {
        let mut ctx = String::new();
        let off = match self.before {
            // The byte before is ASCII or ends a character; keep it only when it is ASCII.
            Some(b) if b.is_ascii() => {
                ctx.push(b as char);
                1
            }
            _ => 0,
        };
        ctx.push_str(&self.held);
        let first = self.rules.iter().filter_map(|&i| self.policy.rules[i].re.find_at(&ctx, off).map(|m| (m.start(), i, m))).min_by_key(|(s, i, _)| (*s, *i));
        let (start, i, m) = first?;
        let m = Match { rule: self.policy.rules[i].name.clone(), redacted: redact_span(m.as_str()) };
        let release = self.held[..start - off].to_string();
        self.held.clear();
        Some(Verdict::Stop { release, m })
    }

    /// The first held position from which rule `i` could still be matching.
    fn could_start(&self, i: usize) -> usize {
        let rule = &self.policy.rules[i];
        let mut cache = rule.cache.lock().unwrap_or_else(|e| e.into_inner());
        let bytes = self.held.as_bytes();
        for s in 0..bytes.len() {
            if !self.held.is_char_boundary(s) {
                continue;
            }
            let before = if s == 0 { self.before } else { Some(bytes[s - 1]) };
            if alive(&rule.dfa, &mut cache, before, &bytes[s..]) {
                return s;
            }
        }
        bytes.len()
    }
}

/// Whether an anchored run over `text` is still alive at its end (a match may yet complete).
/// A DFA that gives up counts as alive.
fn alive(dfa: &DFA, cache: &mut Cache, before: Option<u8>, text: &[u8]) -> bool {
    let cfg = start::Config::new().anchored(Anchored::Yes).look_behind(before);
    let Ok(mut sid) = dfa.start_state(cache, &cfg) else { return true };
    for &b in text {
        match dfa.next_state(cache, sid, b) {
            Ok(next) if next.is_dead() => return false,
            Ok(next) if next.is_quit() => return true,
            Ok(next) => sid = next,
            Err(_) => return true,
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use zerolayer_common::config::AppliesTo;

    fn policy(rules: &[(&str, &str, AppliesTo, &[&str])]) -> Policy {
        let rules = rules
            .iter()
            .map(|(n, p, a, k)| PolicyRule { name: n.to_string(), pattern: p.to_string(), applies_to: *a, keys: k.iter().map(|s| s.to_string()).collect() })
            .collect();
        Policy::new(&PolicySection { rules }).unwrap()
    }

    /// Streams `pieces` through a guard: what left, and the match that stopped it.
    fn stream(g: &mut OutputGuard, pieces: &[&str]) -> (String, Option<Match>) {
        let mut out = String::new();
        for p in pieces {
            match g.push(p) {
                Verdict::Release(t) => out.push_str(&t),
                Verdict::Stop { release, m } => {
                    out.push_str(&release);
                    return (out, Some(m));
                }
            }
        }
        match g.finish() {
            Verdict::Release(t) => {
                out.push_str(&t);
                (out, None)
            }
            Verdict::Stop { release, m } => {
                out.push_str(&release);
                (out, Some(m))
            }
        }
    }

    #[test]
    fn input_rules_match_by_key_and_direction() {
        let p = policy(&[("acct", r"ACCT-\d{6}", AppliesTo::Input, &[]), ("out", "secret", AppliesTo::Output, &[]), ("bob", "hello", AppliesTo::Both, &["bob"])]);
        let m = p.check_input("alice", ["fine", "pay ACCT-123456 now"]).unwrap();
        assert_eq!(m, Match { rule: "acct".into(), redacted: "A*********6 (11 characters)".into() });
        assert!(p.check_input("alice", ["a secret", "hello"]).is_none(), "output-only, and bob's rule");
        assert_eq!(p.check_input("bob", ["hello"]).unwrap().rule, "bob");
        assert!(p.output("alice").is_some() && policy(&[("acct", "x", AppliesTo::Input, &[])]).output("alice").is_none());
    }

    #[test]
    fn no_byte_of_a_match_leaves_however_the_text_is_cut() {
        let p = policy(&[("card", r"\b\d{4}-\d{4}-\d{4}-\d{4}\b", AppliesTo::Output, &[])]);
        let text = "Your card is 4111-1111-1111-1111, keep it safe.";
        // Every split into two pieces, and one character at a time.
        for k in 0..text.len() {
            let (out, m) = stream(&mut p.output("t").unwrap(), &[&text[..k], &text[k..]]);
            assert_eq!(out, "Your card is ", "split at {k}");
            assert_eq!(m.unwrap().rule, "card");
        }
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let (out, m) = stream(&mut p.output("t").unwrap(), &chars.iter().map(String::as_str).collect::<Vec<_>>());
        assert_eq!((out.as_str(), m.is_some()), ("Your card is ", true));
        // Text that only starts like a match is held, then released when it cannot be one.
        let mut g = p.output("t").unwrap();
        assert_eq!(g.push("call 4111-11"), Verdict::Release("call ".into()));
        assert_eq!(g.push("x then"), Verdict::Release("4111-11x then".into()));
        let (out, m) = stream(&mut p.output("t").unwrap(), &["digits 1234-5678 only"]);
        assert_eq!((out.as_str(), m), ("digits 1234-5678 only", None));
    }

    #[test]
    fn holding_back_is_bounded() {
        let p = policy(&[("ab", "a[^b]*b", AppliesTo::Output, &[])]);
        let mut g = p.output("t").unwrap();
        assert_eq!(g.push("xa"), Verdict::Release("x".into()));
        let long = "y".repeat(400);
        match g.push(&long) {
            Verdict::Release(t) => assert_eq!(t.len(), 402 - MAX_HOLDBACK - 1),
            v => panic!("{v:?}"),
        }
        // Past the bound the match's start has left: what remains is no match by itself.
        assert!(matches!(g.push("b"), Verdict::Release(_)));
        assert_eq!(redact_span("ab"), "** (2 characters)");
    }
}
