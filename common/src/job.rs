//! [`Job`]: the one request type of the whole path. The front end builds it once (prompt
//! tokens, sampling, tenant, pins, model); routing carries it; a forward places it on the wire
//! as it is (inside [`crate::wire::Submit`]); and the engine takes it (`Engine::add(id, job)`).
//! A field added to a request is added here, and nowhere else.
//!
//! A continuation (a sequence resumed after its worker was lost or drained) is the same job
//! with [`Job::resume`] set to the tokens its client already has: the worker replays them and
//! continues with exactly the tokens the original would have produced.

use crate::types::{CachePin, SamplingParams, Share};

/// One generation request, wherever it runs.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
#[derive(Clone, Debug, PartialEq)]
pub struct Job {
    /// The id the client sees (`request-id`), for logs on every node it touches.
    pub request_id: String,
    /// The id of the model it runs on: only workers that serve it are placed on.
    pub model: String,
    /// The prompt's token ids (rendered and tokenized by the front end).
    pub prompt: Vec<u32>,
    /// Sampling and stopping (the seed fixed, so a continuation elsewhere samples exactly what
    /// the original would have).
    pub params: SamplingParams,
    /// The API key it runs for (the scheduler shares slots and KV between keys).
    pub share: Share,
    /// Prompt prefixes to keep pinned in the prefix cache (`cache_control` TTLs).
    pub pins: Vec<CachePin>,
    /// Tokens a worker that is gone already generated and the client already has: the sequence
    /// continues after them. Empty for a new sequence.
    pub resume: Vec<u32>,
    /// The root of its prefix cache names ([`crate::scope_root`] of its cache scope; 0 for
    /// the unscoped namespace): it sees only the cached prefixes of its own scope.
    pub cache_root: u64,
    /// Who it runs for, as the node that authenticated the caller names them. A node that runs
    /// a forwarded job derives `share`, the tenant's options and `cache_root` from this and its
    /// own config, not from the numbers the sender put in.
    pub claim: TenantClaim,
}

/// A tenant claim: the tenant's name and the request's `cache_salt`.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TenantClaim {
    pub tenant: String,
    pub cache_salt: Option<String>,
}

impl Job {
    /// A job for `prompt` with `params`, for the default tenant, with no pins, no model name
    /// and no request id (engine-level callers: tests and benchmarks).
    pub fn new(prompt: Vec<u32>, params: SamplingParams) -> Job {
        Job { request_id: String::new(), model: String::new(), prompt, params, share: Share::default(), pins: Vec::new(), resume: Vec::new(), cache_root: 0, claim: TenantClaim::default() }
    }

    /// This job continuing after `generated`, the tokens its client already has.
    pub fn resuming(mut self, generated: Vec<u32>) -> Job {
        self.resume = generated;
        self
    }

    /// This job for the tenant `share` names.
    pub fn shared(mut self, share: Share) -> Job {
        self.share = share;
        self
    }

    /// This job claimed for `claim`'s tenant.
    pub fn claimed(mut self, claim: TenantClaim) -> Job {
        self.claim = claim;
        self
    }

    /// This job in the cache scope whose names start at `root`.
    pub fn scoped(mut self, root: u64) -> Job {
        self.cache_root = root;
        self
    }

    /// This job keeping `pins` cached.
    pub fn pinned(mut self, pins: Vec<CachePin>) -> Job {
        self.pins = pins;
        self
    }

    /// The tokens a worker computes before it samples: the prompt, then what was resumed.
    pub fn tokens(&self) -> Vec<u32> {
        let mut t = Vec::with_capacity(self.prompt.len() + self.resume.len());
        t.extend_from_slice(&self.prompt);
        t.extend_from_slice(&self.resume);
        t
    }

    /// The tokens still to generate at most (`max_tokens` less what was resumed).
    pub fn remaining_tokens(&self) -> usize {
        (self.params.max_tokens as usize).saturating_sub(self.resume.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resumed_job_computes_its_prompt_then_its_output_and_owes_the_rest() {
        let j = Job::new(vec![1, 2, 3], SamplingParams::greedy(5)).resuming(vec![7, 8]);
        assert_eq!(j.tokens(), vec![1, 2, 3, 7, 8]);
        assert_eq!(j.remaining_tokens(), 3);
        assert_eq!(Job::new(vec![1], SamplingParams::greedy(1)).resuming(vec![4, 4, 4]).remaining_tokens(), 0);
    }
}
