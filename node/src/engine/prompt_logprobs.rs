//! Prompt logprobs (`echo` with `logprobs` on OpenAI's Completions: the log-likelihood of a
//! text, as lm-evaluation-harness asks it). A sequence that wants them computes its prompt anew
//! in short chunks ([`crate::scheduler::PROMPT_LOGITS_CHUNK`]) with a logits row per position:
//! the row of position `p` is the distribution of prompt token `p + 1`.

use zerolayer_common::SeqEvent;

use super::{Engine, StepOutput};
use crate::sampler::logprob::token_logprob;
use crate::scheduler::{ScheduledItem, SeqId};

impl Engine {
    /// How many of `it`'s positions, from its first, need a logits row for prompt logprobs:
    /// every one of a chunk that holds prompt tokens still to report, except the last of a
    /// chunk that ends the prompt and draws the first output token (`draws`), whose row is the
    /// draw's.
    pub(super) fn prompt_rows(&self, it: &ScheduledItem, draws: bool) -> usize {
        let (Some(st), Some(s)) = (self.states.get(&it.seq), self.sched.get(it.seq)) else { return 0 };
        if st.prompt_next >= s.prompt_len || it.start + it.len <= st.prompt_next.saturating_sub(1) {
            return 0;
        }
        it.len - usize::from(it.completes && draws)
    }

    /// The prompt logprobs that `rows` (positions `start`, `start + 1`, … of sequence `id`)
    /// give: the distribution at position `p` scores prompt token `p + 1`. Positions already
    /// reported (a sequence computed again after a preemption) and the row past the prompt
    /// are skipped.
    pub(super) fn report_prompt(&mut self, id: SeqId, start: usize, rows: &[f32], out: &mut StepOutput) {
        let vocab = self.backend.config().vocab_size;
        let (Some(st), Some(s)) = (self.states.get_mut(&id), self.sched.get(id)) else { return };
        let (Some(top), from) = (st.params.logprobs, st.prompt_next) else { return };
        let mut logprobs = Vec::new();
        for (j, row) in rows.chunks_exact(vocab).enumerate() {
            let q = start + j + 1;
            if q == st.prompt_next && q < s.prompt_len {
                logprobs.push(token_logprob(row, s.tokens[q], top as usize));
                st.prompt_next += 1;
            }
        }
        if !logprobs.is_empty() {
            out.events.push((id, SeqEvent::PromptLogprobs { from: from as u32, logprobs }));
        }
    }
}
