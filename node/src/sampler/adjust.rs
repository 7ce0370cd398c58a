//! What a request changes in the logits before a draw, in this order:
//! 1. `logit_bias` (OpenAI): added to the named tokens' logits;
//! 2. the repetition penalty (CTRL's, as Hugging Face and vLLM apply it): each token of the
//!    prompt or the output has a positive logit divided by it and a negative one multiplied;
//! 3. the frequency and presence penalties (OpenAI): each token generated so far loses
//!    `frequency × its count + presence`.
//!
//! Then the sampler applies temperature, top-k, min-p and top-p as usual (greedy takes the
//! argmax of the adjusted logits). Pure: the history is what [`Adjust::record`] was told, so a
//! sequence that moves rebuilds it from its prompt and tokens and draws what it would have.

use std::collections::{HashMap, HashSet};

use zerolayer_common::SamplingParams;

/// One sequence's logit adjustments and the history they read.
#[derive(Debug)]
pub struct Adjust {
    bias: Vec<(u32, f32)>,
    repetition: f32,
    presence: f32,
    frequency: f32,
    /// The prompt's distinct tokens (kept only for the repetition penalty).
    prompt: HashSet<u32>,
    /// How many times each token was generated.
    counts: HashMap<u32, u32>,
}

impl Adjust {
    /// The adjustments `p` asks for; None when it asks for none.
    pub fn new(p: &SamplingParams) -> Option<Adjust> {
        let repetition = p.repetition_penalty.unwrap_or(1.0);
        let active = !p.logit_bias.is_empty() || repetition != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0;
        active.then(|| Adjust {
            bias: p.logit_bias.clone(),
            repetition,
            presence: p.presence_penalty,
            frequency: p.frequency_penalty,
            prompt: HashSet::new(),
            counts: HashMap::new(),
        })
    }

    /// Takes in the prompt (read by the repetition penalty).
    pub fn observe_prompt(&mut self, prompt: &[u32]) {
        if self.repetition != 1.0 {
            self.prompt.extend(prompt.iter().copied());
        }
    }

    /// Takes in a generated token.
    pub fn record(&mut self, tok: u32) {
        *self.counts.entry(tok).or_default() += 1;
    }

    /// Adjusts `logits` in place (module docs). Each token's change depends only on that token,
    /// so the order of the sets does not matter.
    pub fn apply(&self, logits: &mut [f32]) {
        for &(t, b) in &self.bias {
            if let Some(l) = logits.get_mut(t as usize) {
                *l += b;
            }
        }
        if self.repetition != 1.0 {
            let seen = self.prompt.iter().chain(self.counts.keys().filter(|t| !self.prompt.contains(t)));
            for &t in seen {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = if *l > 0.0 { *l / self.repetition } else { *l * self.repetition };
                }
            }
        }
        if self.presence != 0.0 || self.frequency != 0.0 {
            for (&t, &n) in &self.counts {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l -= self.frequency * n as f32 + self.presence;
                }
            }
        }
    }
}
