//! The scheduler's side of `cache_control` pins: a sequence's computed prompt prefix pinned in
//! the block pool for its TTL, expiry, and the pinned share (the pool keeps the pins).

use super::{Scheduler, SeqId};

impl Scheduler {
    /// Pins the cached full blocks of sequence `id`'s first `tokens` tokens until `until` (the
    /// pool's clock), once they are computed: None while they are not yet (or the sequence is
    /// gone), else how many blocks took the pin (fewer when the pinned share is full).
    pub fn pin_prefix(&mut self, id: SeqId, tokens: usize, until: u64) -> Option<usize> {
        let s = self.seqs.get(&id)?;
        if s.num_computed < tokens {
            return None;
        }
        let n = (tokens / self.cfg.block_size).min(s.hashes.len());
        let mut pinned = 0;
        for j in 0..n {
            if let Some(b) = self.pool.lookup(s.name(j, self.cfg.block_size)) {
                pinned += usize::from(self.pool.pin(b, until));
            }
        }
        Some(pinned)
    }

    /// Ends the pins that expired by `now` (the pool's clock).
    pub fn expire_pins(&mut self, now: u64) {
        self.pool.expire_pins(now);
    }

    /// Sets how many blocks may hold a pin at once.
    pub fn set_max_pinned(&mut self, n: usize) {
        self.pool.set_max_pinned(n);
    }

    /// Blocks holding a live pin.
    pub fn num_pinned(&self) -> usize {
        self.pool.num_pinned()
    }
}
