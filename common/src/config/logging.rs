//! `[logging]`: what the node's log lines may hold. Client text reaches logs through errors
//! (a refused request names what it refused) and debug lines; redaction masks what matches,
//! on every line, at every level, before it is written.

use serde::{Deserialize, Serialize};

/// Most custom patterns, and the longest one: they run over every log line.
pub const MAX_PATTERNS: usize = 32;
pub const MAX_PATTERN_LEN: usize = 1024;
/// The compiled size each pattern may take (the `regex` crate's size limit).
pub const PATTERN_SIZE_LIMIT: usize = 1 << 20;

/// A kind of personal data the log redactor knows.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq, Hash)]
#[serde(rename_all = "snake_case")]
pub enum Redaction {
    /// `name@domain.tld`
    Email,
    /// Phone numbers written in groups: `+1 555 123 4567`, `(555) 123-4567`, `020 7946 0958`.
    Phone,
    /// 13 to 19 digits, optionally grouped by spaces or dashes.
    CreditCard,
}

impl Redaction {
    /// The pattern, in the `regex` crate's syntax.
    pub fn pattern(self) -> &'static str {
        match self {
            Redaction::Email => r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}",
            Redaction::Phone => r"(?:\+\d{1,3}[ -]?)?(?:\(\d{2,4}\)|\b\d{2,4})[ -]\d{3,4}[ -]?\d{3,4}\b",
            Redaction::CreditCard => r"\b(?:\d[ -]?){12,18}\d\b",
        }
    }

    /// What a match is replaced with.
    pub fn mask(self) -> &'static str {
        match self {
            Redaction::Email => "[email]",
            Redaction::Phone => "[phone]",
            Redaction::CreditCard => "[credit_card]",
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct LoggingSection {
    /// Kinds of personal data masked in every log line: `email`, `phone`, `credit_card`.
    pub redact: Vec<Redaction>,
    /// More patterns masked in every log line (Rust `regex` syntax), each replaced by
    /// `[redacted]`; at most 32, each at most 1024 characters.
    pub patterns: Vec<String>,
}

impl Default for LoggingSection {
    fn default() -> Self {
        LoggingSection { redact: vec![Redaction::Email, Redaction::Phone], patterns: Vec::new() }
    }
}

impl LoggingSection {
    /// Every pattern with its mask: the kinds first, then the custom ones.
    pub fn rules(&self) -> Vec<(String, &'static str)> {
        let kinds = self.redact.iter().map(|k| (k.pattern().to_string(), k.mask()));
        kinds.chain(self.patterns.iter().map(|p| (p.clone(), "[redacted]"))).collect()
    }

    /// Each pattern compiles within its bounds.
    pub fn validate(&self) -> Result<(), String> {
        if self.patterns.len() > MAX_PATTERNS {
            return Err(format!("logging.patterns: at most {MAX_PATTERNS} patterns (got {})", self.patterns.len()));
        }
        for p in &self.patterns {
            if p.is_empty() || p.len() > MAX_PATTERN_LEN {
                return Err(format!("logging.patterns: each pattern is 1 to {MAX_PATTERN_LEN} characters"));
            }
            compile(p).map_err(|e| format!("logging.patterns: {p:?} is not a valid pattern: {e}"))?;
        }
        Ok(())
    }
}

/// A pattern compiled within the size bound.
pub fn compile(p: &str) -> Result<regex::Regex, regex::Error> {
    regex::RegexBuilder::new(p).size_limit(PATTERN_SIZE_LIMIT).build()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn masked(kind: Redaction, s: &str) -> String {
        compile(kind.pattern()).unwrap().replace_all(s, kind.mask()).into_owned()
    }

    #[test]
    fn the_kinds_mask_what_they_name_and_leave_log_fields_alone() {
        assert_eq!(masked(Redaction::Email, "write to jane.doe+x@mail.example.co.uk now"), "write to [email] now");
        for phone in ["+1 555 123 4567", "(555) 123-4567", "020 7946 0958", "555-123-4567"] {
            assert_eq!(masked(Redaction::Phone, &format!("call {phone}.")), "call [phone].", "{phone}");
        }
        assert_eq!(masked(Redaction::CreditCard, "card 4111 1111 1111 1111 ok"), "card [credit_card] ok");
        // What a log line is made of stays: timestamps, addresses, ids, durations.
        let line = "2026-12-07T04:11:57.123456Z INFO request{request_id=req_0a1b2c3d4e5f60718293 node=n1}: served status=200 ms=1234 peer=192.168.100.200:7000";
        for k in [Redaction::Email, Redaction::Phone] {
            assert_eq!(masked(k, line), line, "{k:?}");
        }
    }

    #[test]
    fn custom_patterns_are_bounded() {
        let ok = LoggingSection { patterns: vec![r"ACCT-\d{8}".into()], ..Default::default() };
        assert!(ok.validate().is_ok());
        assert_eq!(ok.rules().len(), 3);
        assert!(LoggingSection { patterns: vec!["(".into()], ..Default::default() }.validate().is_err());
        assert!(LoggingSection { patterns: vec![r"\w{1000}\w{1000}\w{1000}".into()], ..Default::default() }.validate().is_err());
        assert!(LoggingSection { patterns: vec!["a".into(); 33], ..Default::default() }.validate().is_err());
    }
}
