//! `[policy]`: what clients may send and what answers may say. Each rule is a pattern over
//! text, for the client's input, the model's output, or both, optionally for some keys only.
//! A match refuses the request (input) or stops the answer before the matching text leaves the
//! server (output), and leaves an audit record.

use serde::{Deserialize, Serialize};

use super::logging::compile;

/// Most rules, and the longest pattern: input rules run over every prompt, output rules over
/// every answer as it streams.
pub const MAX_RULES: usize = 64;
pub const MAX_PATTERN_LEN: usize = 1024;

/// Which text a rule reads.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum AppliesTo {
    /// What the client sent: system prompt, messages, tool results, a raw prompt.
    #[default]
    Input,
    /// What the model generates.
    Output,
    Both,
}

impl AppliesTo {
    pub fn input(self) -> bool {
        matches!(self, AppliesTo::Input | AppliesTo::Both)
    }
    pub fn output(self) -> bool {
        matches!(self, AppliesTo::Output | AppliesTo::Both)
    }
}

/// One rule (`[[policy.rules]]`).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct PolicyRule {
    /// What refusals, audit records and metrics call it: 1 to 64 ASCII letters, digits, `-`,
    /// `_` or `.`.
    pub name: String,
    /// The text it refuses, in Rust `regex` syntax (at most 1024 characters).
    pub pattern: String,
    /// `input`, `output` or `both`.
    pub applies_to: AppliesTo,
    /// The `[[auth.keys]]` names it applies to (empty: every key).
    pub keys: Vec<String>,
}

impl PolicyRule {
    /// Whether it applies to the tenant named `tenant`.
    pub fn covers(&self, tenant: &str) -> bool {
        self.keys.is_empty() || self.keys.iter().any(|k| k == tenant)
    }
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct PolicySection {
    /// The rules, checked in order (`[[policy.rules]]`).
    pub rules: Vec<PolicyRule>,
}

impl PolicySection {
    /// Names unique and well formed, patterns compile within their bounds, keys known.
    pub fn validate(&self, key_names: &[&str]) -> Result<(), String> {
        if self.rules.len() > MAX_RULES {
            return Err(format!("policy.rules: at most {MAX_RULES} rules (got {})", self.rules.len()));
        }
        let mut names = std::collections::HashSet::new();
        for r in &self.rules {
            let ok = !r.name.is_empty() && r.name.len() <= 64 && r.name.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
            if !ok {
                return Err(format!("policy.rules: name {:?} must be 1 to 64 ASCII letters, digits, '-', '_' or '.'", r.name));
            }
            if !names.insert(&r.name) {
                return Err(format!("policy.rules: duplicate name {:?}", r.name));
            }
            if r.pattern.is_empty() || r.pattern.len() > MAX_PATTERN_LEN {
                return Err(format!("policy.rules {:?}: the pattern is 1 to {MAX_PATTERN_LEN} characters", r.name));
            }
            let re = compile(&r.pattern).map_err(|e| format!("policy.rules {:?}: not a valid pattern: {e}", r.name))?;
            if re.is_match("") {
                return Err(format!("policy.rules {:?}: the pattern matches empty text, so it would refuse everything", r.name));
            }
            if let Some(k) = r.keys.iter().find(|k| !key_names.contains(&k.as_str())) {
                return Err(format!("policy.rules {:?}: key {k:?} is not an [[auth.keys]] name", r.name));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(name: &str, pattern: &str) -> PolicyRule {
        PolicyRule { name: name.into(), pattern: pattern.into(), ..Default::default() }
    }

    #[test]
    fn rules_are_checked_at_load() {
        let ok = PolicySection { rules: vec![rule("iban", r"\bDE\d{20}\b"), PolicyRule { keys: vec!["alice".into()], ..rule("ssn", r"\b\d{3}-\d{2}-\d{4}\b") }] };
        assert!(ok.validate(&["alice"]).is_ok());
        assert!(ok.validate(&[]).unwrap_err().contains("not an [[auth.keys]] name"));
        let bad = |rules: Vec<PolicyRule>| PolicySection { rules }.validate(&[]).unwrap_err();
        assert!(bad(vec![rule("a", "x"), rule("a", "y")]).contains("duplicate"));
        assert!(bad(vec![rule("a b", "x")]).contains("name"));
        assert!(bad(vec![rule("a", "(")]).contains("not a valid pattern"));
        assert!(bad(vec![rule("a", "x*")]).contains("matches empty text"));
        assert!(bad((0..65).map(|i| rule(&format!("r{i}"), "x")).collect()).contains("at most 64"));
        assert!(AppliesTo::Both.input() && AppliesTo::Both.output() && !AppliesTo::Input.output());
    }
}
