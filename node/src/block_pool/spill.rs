//! The names of evicted blocks, for a disk tier.
//!
//! An evicted block's KV is still in the cache until a step or an import writes over it, so a
//! caller that wants it copied out (the engine, for its worker's disk tier) turns recording on,
//! and takes the list after every allocation and before anything writes a block: each entry
//! names the block (hash, parent, tokens) and says which block id still holds its bytes.
//! Bounded: at most one entry per block of the pool (a caller that never takes them loses the
//! oldest, and their blocks are recomputed on a miss, as without a disk tier).

use super::{BlockId, BlockPool, Evicted};

impl BlockPool {
    /// Starts (or stops) recording evictions for [`Self::take_evicted`].
    pub fn record_evictions(&mut self, on: bool) {
        self.evicted = on.then(Vec::new);
    }

    /// The blocks evicted since the last call, oldest first.
    pub fn take_evicted(&mut self) -> Vec<Evicted> {
        self.evicted.as_mut().map(std::mem::take).unwrap_or_default()
    }

    pub(super) fn record_eviction(&mut self, b: BlockId, hash: u64) {
        let i = b as usize;
        let lapsed_pin = std::mem::take(&mut self.lapsed_pin[i]);
        let Some(list) = self.evicted.as_mut() else { return };
        if list.len() >= self.refcount.len() {
            list.remove(0);
        }
        let tokens = self.tokens[i * self.block_size..(i + 1) * self.block_size].to_vec();
        list.push(Evicted { block: b, hash, parent: self.parent[i], tokens, lapsed_pin });
    }

    /// Every cached block, the most recently used first (referenced and pinned ones, then the
    /// LRU list from its tail), as (block, hash, parent, pin expiry or 0): what a worker that
    /// stops copies to disk.
    pub fn cached_blocks_hot_first(&self) -> Vec<(BlockId, u64, u64, u64)> {
        let mut out: Vec<BlockId> = self.cached.values().copied().filter(|&b| self.place[b as usize] != super::Place::Lru).collect();
        out.sort_unstable();
        let mut b = self.lru_tail;
        while b != super::NIL {
            out.push(b);
            b = self.prev[b as usize];
        }
        out.into_iter().map(|b| (b, self.hash[b as usize].unwrap_or(0), self.parent[b as usize], self.pin_until[b as usize])).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block_pool::BlockName;

    #[test]
    fn evictions_are_recorded_with_names_and_lapsed_pins() {
        let mut p = BlockPool::new(2, 2);
        p.set_max_pinned(2);
        p.record_evictions(true);
        let a = p.allocate().unwrap();
        p.register(a, BlockName { hash: 11, parent: 0, tokens: &[1, 2] });
        p.pin(a, 100);
        p.release(a);
        let b = p.allocate().unwrap();
        p.register(b, BlockName { hash: 12, parent: 11, tokens: &[3, 4] });
        p.release(b);
        assert_eq!(p.cached_blocks_hot_first().iter().map(|e| e.1).collect::<Vec<_>>(), vec![11, 12], "the pinned block, then the LRU's tail");
        assert!(p.take_evicted().is_empty());
        // Pressure: block b goes first (LRU), then a once its pin is ended.
        let c = p.allocate().unwrap();
        assert_eq!(c, b);
        assert_eq!(p.unpin_idle(), 1);
        let d = p.allocate().unwrap();
        assert_eq!(d, a);
        let ev = p.take_evicted();
        assert_eq!(ev, vec![
            Evicted { block: b, hash: 12, parent: 11, tokens: vec![3, 4], lapsed_pin: 0 },
            Evicted { block: a, hash: 11, parent: 0, tokens: vec![1, 2], lapsed_pin: 100 },
        ]);
        assert!(p.take_evicted().is_empty());
        p.check_invariants();
    }
}
