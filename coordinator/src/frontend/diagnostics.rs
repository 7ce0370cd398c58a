//! Why did my prompt miss the cache? (`diagnostics.previous_message_id`.)
//!
//! Every Messages response leaves a [`Fingerprint`] of its prompt, by message id, in a bounded
//! [`Recent`] map: the model, a hash per section (tools, system, each message) and the chained
//! hashes of the prompt's 16-token blocks. A request naming an earlier message gets the first
//! section that changed, in prompt order (model, tools, system, then an earlier message that
//! differs instead of messages only being appended), and how many of the earlier prompt's tokens
//! can no longer come from the cache: those after the first block the two prompts do not share.
//! That catches, exactly, the classic incident: a timestamp in the system prompt.
//!
//! Pure apart from the map; the API layer turns a [`Diagnosis`] into JSON.

use std::collections::hash_map::DefaultHasher;
use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use crate::frontend::request::GenerationRequest;

/// Tokens per hashed block.
pub const BLOCK: usize = 16;
/// Fingerprints kept (the oldest go first).
pub const MAX_ENTRIES: usize = 4096;
/// Blocks kept per fingerprint (2^17 tokens).
const MAX_BLOCKS: usize = 8192;

fn hash_of(v: impl Hash) -> u64 {
    let mut h = DefaultHasher::new();
    v.hash(&mut h);
    h.finish()
}

/// What a prompt was made of.
#[derive(Clone, Debug, PartialEq)]
pub struct Fingerprint {
    model: String,
    tools: u64,
    system: u64,
    messages: Vec<u64>,
    /// Chained hashes of the prompt's full blocks.
    blocks: Vec<u64>,
    tokens: usize,
    /// The cache scope it ran in: a diagnosis compares only prompts of one scope.
    scope: String,
}

impl Fingerprint {
    /// This fingerprint, of a prompt that ran in cache scope `scope`.
    pub fn in_scope(mut self, scope: &str) -> Self {
        self.scope = scope.to_string();
        self
    }

    pub fn scope(&self) -> &str {
        &self.scope
    }

    pub fn of(req: &GenerationRequest, model: &str, prompt: &[u32]) -> Self {
        let tools = hash_of(req.offered_tools().iter().map(|t| (&t.name, &t.description, t.parameters.to_string(), t.deferred)).collect::<Vec<_>>());
        let system = hash_of(&req.system);
        let messages = req
            .turns
            .iter()
            .map(|t| hash_of((t.role.as_str(), &t.text, &t.tool_call_id, t.tool_calls.iter().map(|c| (&c.id, &c.name, c.arguments.to_string())).collect::<Vec<_>>())))
            .collect();
        let mut chain = 0u64;
        let blocks = prompt
            .chunks_exact(BLOCK)
            .take(MAX_BLOCKS)
            .map(|b| {
                chain = hash_of((chain, b));
                chain
            })
            .collect();
        Fingerprint { model: model.to_string(), tools, system, messages, blocks, tokens: prompt.len(), scope: String::new() }
    }
}

/// The section that changed first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MissReason {
    ModelChanged,
    ToolsChanged,
    SystemChanged,
    MessagesChanged,
}

impl MissReason {
    pub fn as_str(self) -> &'static str {
        match self {
            MissReason::ModelChanged => "model_changed",
            MissReason::ToolsChanged => "tools_changed",
            MissReason::SystemChanged => "system_changed",
            MissReason::MessagesChanged => "messages_changed",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Diagnosis {
    /// Only messages were appended: the earlier prompt is a prefix of this one.
    NoMiss,
    Miss {
        reason: MissReason,
        /// The earlier prompt's tokens past the last block both prompts share.
        missed_tokens: usize,
        /// Where the prompts part (the start of the first block that differs).
        first_difference: usize,
    },
    PreviousNotFound,
}

/// Compares this prompt with the earlier one.
pub fn diagnose(prev: &Fingerprint, cur: &Fingerprint) -> Diagnosis {
    let reason = if prev.model != cur.model {
        MissReason::ModelChanged
    } else if prev.tools != cur.tools {
        MissReason::ToolsChanged
    } else if prev.system != cur.system {
        MissReason::SystemChanged
    } else if prev.messages.len() > cur.messages.len() || prev.messages.iter().zip(&cur.messages).any(|(a, b)| a != b) {
        MissReason::MessagesChanged
    } else {
        return Diagnosis::NoMiss;
    };
    let shared = if reason == MissReason::ModelChanged { 0 } else { prev.blocks.iter().zip(&cur.blocks).take_while(|(a, b)| a == b).count() };
    let first_difference = shared * BLOCK;
    Diagnosis::Miss { reason, missed_tokens: prev.tokens.saturating_sub(first_difference), first_difference }
}

/// Recent fingerprints by message id, at most [`MAX_ENTRIES`].
#[derive(Default)]
pub struct Recent {
    by_id: HashMap<String, Arc<Fingerprint>>,
    order: VecDeque<String>,
}

impl Recent {
    pub fn insert(&mut self, id: String, fp: Arc<Fingerprint>) {
        if self.by_id.insert(id.clone(), fp).is_none() {
            self.order.push_back(id);
        }
        while self.order.len() > MAX_ENTRIES {
            if let Some(old) = self.order.pop_front() {
                self.by_id.remove(&old);
            }
        }
    }

    pub fn get(&self, id: &str) -> Option<Arc<Fingerprint>> {
        self.by_id.get(id).cloned()
    }

    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::frontend::request::{Role, Turn};
    use crate::frontend::tools::Tool;

    fn req(system: &str, turns: &[&str]) -> GenerationRequest {
        let turns = turns.iter().enumerate().map(|(i, t)| Turn::new(if i % 2 == 0 { Role::User } else { Role::Assistant }, *t)).collect();
        GenerationRequest::chat("m", Some(system), turns)
    }

    /// A stand-in prompt: the system text's bytes, then each turn's (one token a byte).
    fn prompt(r: &GenerationRequest) -> Vec<u32> {
        r.system.iter().chain(r.turns.iter().map(|t| &t.text)).flat_map(|s| s.bytes().map(u32::from)).collect()
    }

    fn fp(r: &GenerationRequest) -> Fingerprint {
        Fingerprint::of(r, "m", &prompt(r))
    }

    #[test]
    fn the_first_changed_section_and_the_tokens_it_costs() {
        let sys = "You are a coding agent. Today is 2026-11-30 10:00:00.";
        let base = req(&format!("{sys} {}", "Rules. ".repeat(40)), &["Fix the bug in main.rs please."]);
        let prev = fp(&base);
        // Appending the answer and a new question: no miss.
        let appended = req(base.system.as_deref().unwrap(), &["Fix the bug in main.rs please.", "Done.", "Now run the tests."]);
        assert_eq!(diagnose(&prev, &fp(&appended)), Diagnosis::NoMiss);
        // A timestamp changed in the system prompt: everything after its block is lost.
        let ts = req(&base.system.as_deref().unwrap().replace("10:00:00", "10:00:07"), &["Fix the bug in main.rs please."]);
        let at = sys.find("10:00:00").unwrap() + 6; // the first byte that differs
        match diagnose(&prev, &fp(&ts)) {
            Diagnosis::Miss { reason, missed_tokens, first_difference } => {
                assert_eq!(reason, MissReason::SystemChanged);
                assert_eq!(first_difference, at / BLOCK * BLOCK);
                assert_eq!(missed_tokens, prompt(&base).len() - at / BLOCK * BLOCK);
            }
            d => panic!("{d:?}"),
        }
        // An earlier message edited.
        let edited = req(base.system.as_deref().unwrap(), &["Fix the bug in lib.rs please.", "Done.", "Now run the tests."]);
        assert!(matches!(diagnose(&prev, &fp(&edited)), Diagnosis::Miss { reason: MissReason::MessagesChanged, .. }));
        // Tools come before the system prompt; the model before everything.
        let mut tooled = appended.clone();
        tooled.tools = vec![Tool { name: "t".into(), description: None, parameters: json!({"type": "object"}), deferred: false }];
        assert!(matches!(diagnose(&prev, &fp(&tooled)), Diagnosis::Miss { reason: MissReason::ToolsChanged, .. }));
        let other = Fingerprint::of(&appended, "other", &prompt(&appended));
        assert_eq!(diagnose(&prev, &other), Diagnosis::Miss { reason: MissReason::ModelChanged, missed_tokens: prompt(&base).len(), first_difference: 0 });
    }

    #[test]
    fn recent_is_bounded() {
        let mut r = Recent::default();
        let f = Arc::new(fp(&req("s", &["u"])));
        for i in 0..MAX_ENTRIES + 10 {
            r.insert(format!("msg_{i}"), f.clone());
        }
        assert_eq!(r.len(), MAX_ENTRIES);
        assert!(r.get("msg_0").is_none() && r.get(&format!("msg_{}", MAX_ENTRIES + 9)).is_some());
    }
}
