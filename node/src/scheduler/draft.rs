//! Room for speculative drafts (see [`crate::speculate`]): blocks a decoding sequence borrows
//! for its draft's positions in one step, and what the step settles of them afterwards.

use super::{Scheduler, SeqId};

impl Scheduler {
    /// Blocks for up to `k` draft positions past decoding sequence `id`'s next token, taken only
    /// from blocks that are free and hold no cached prefix: a draft never preempts, unpins or
    /// evicts anything. Returns the draft length they cover (at most `k`).
    pub fn reserve_draft(&mut self, id: SeqId, k: usize) -> usize {
        let bs = self.cfg.block_size;
        let spare = self.pool.num_free() - self.pool.num_cached_evictable();
        let Some(s) = self.seqs.get_mut(&id) else { return 0 };
        let next = s.tokens.len();
        debug_assert_eq!(s.num_computed + 1, next, "a draft follows a decode");
        let want = (next + k).div_ceil(bs).saturating_sub(s.blocks.len()).min(spare);
        for _ in 0..want {
            let b = self.pool.allocate_after(s.blocks.last().copied()).expect("a free block was counted");
            s.blocks.push(b);
        }
        (s.blocks.len() * bs).min(next + k).saturating_sub(next)
    }

    /// After a drafted step: `accepted` draft tokens (now among the sequence's tokens) had
    /// their K/V computed by the step, so they count as computed (their full blocks join the
    /// prefix cache); the blocks past the sequence's tokens, which hold only rejected
    /// positions, go back to the pool.
    pub fn settle_draft(&mut self, id: SeqId, accepted: usize) {
        let bs = self.cfg.block_size;
        let Some(s) = self.seqs.get_mut(&id) else { return };
        debug_assert!(s.num_computed + accepted < s.tokens.len(), "the step's last draw is never computed");
        s.num_computed += accepted;
        super::register_computed(&mut self.pool, s, bs);
        let keep = s.tokens.len().div_ceil(bs);
        while s.blocks.len() > keep {
            let b = s.blocks.pop().expect("a block past the tokens");
            self.pool.release(b);
        }
    }
}
