//! The engine's side of speculative decoding ([`crate::speculate`]): which of a step's decodes
//! carry a draft, and what the draws keep of each.

use zerolayer_common::config::Speculative;

use super::{Engine, StepOutput};
use crate::error::Result;
use crate::scheduler::Plan;
use crate::speculate::{ngram_draft, Drafts};

/// Speculation steps back as the batch grows: a step's drafts add at most this many rows less
/// its decodes (none from 16 decodes on), since a step that already computes many rows is
/// compute-bound, and a draft's extra rows would cost more than the steps they save.
pub(super) const DRAFT_ROWS: usize = 16;

impl Engine {
    /// Drafts for the plan's decodes (`want`: the items that sample), within what is left of
    /// the step's token budget and of each sequence's `max_tokens` and context, each
    /// sequence's drafter's length, and the KV blocks free for the taking.
    pub(super) fn draft(&mut self, plan: &Plan, want: &[bool], d: &mut Drafts) {
        d.clear();
        let decodes = plan.items.iter().filter(|it| it.len == 1 && it.completes).count();
        let on = self.speculative == Speculative::Ngram;
        let step_left = self.sched.config().max_batch_tokens.saturating_sub(plan.items.iter().map(|it| it.len).sum());
        let mut left = step_left.min(DRAFT_ROWS.saturating_sub(decodes));
        let max_seq = self.max_sequence_tokens();
        for (it, &w) in plan.items.iter().zip(want) {
            d.at.push(d.tokens.len());
            let mut k = 0;
            if on && w && it.len == 1 && it.completes && left > 0 {
                let s = self.sched.get(it.seq).expect("a planned sequence");
                let st = self.states.get_mut(&it.seq).expect("state for scheduled sequence");
                let room = (s.max_tokens - s.generated()).saturating_sub(1).min(max_seq.saturating_sub(s.tokens.len()));
                let budget = st.drafter.budget().min(room).min(left);
                ngram_draft(&s.tokens, budget, &mut d.scratch);
                if d.scratch.is_empty() {
                    self.recent.draft(s.cache_root, &s.tokens, budget, &mut d.scratch);
                }
                if !d.scratch.is_empty() {
                    k = self.sched.reserve_draft(it.seq, d.scratch.len());
                }
            }
            let s = self.sched.get(it.seq).expect("a planned sequence");
            d.tokens.push(*s.tokens.last().expect("a sequence has tokens"));
            d.tokens.extend_from_slice(&d.scratch[..k]);
            d.len.push(k);
            left -= k;
        }
        self.drafted_total += d.total() as u64;
    }

    /// Draws item `seq`'s rows in order (`draw(self, j, out)` draws row `j`, appending the
    /// token to the sequence and returning it and whether the sequence ended), keeping the
    /// draft's tokens while they equal the draws: the last row drawn is the first that differs
    /// (or the one after the whole draft). The kept tokens' K/V, computed by the step, counts
    /// as computed; the blocks of rejected positions go back.
    pub(super) fn verify(&mut self, seq: crate::scheduler::SeqId, draft: &[u32], out: &mut StepOutput, mut draw: impl FnMut(&mut Engine, usize, &mut StepOutput) -> Result<(u32, bool)>) -> Result<()> {
        let mut kept = 0;
        for j in 0..=draft.len() {
            let (tok, ended) = draw(self, j, out)?;
            let hit = j < draft.len() && tok == draft[j];
            if ended {
                // The sequence is gone, its blocks with it.
                self.accepted_total += (kept + usize::from(hit)) as u64;
                return Ok(());
            }
            if !hit {
                break;
            }
            kept += 1;
        }
        if !draft.is_empty() {
            self.accepted_total += kept as u64;
            self.sched.settle_draft(seq, kept);
            if let Some(st) = self.states.get_mut(&seq) {
                st.drafter.learn(draft.len(), kept);
            }
        }
        Ok(())
    }
}
