//! The KV block pool with automatic prefix caching. Sans-IO: a plain struct.
//!
//! - Fixed-size blocks (`block_size` tokens each), identified by `BlockId`.
//! - O(1) allocate and free: blocks that hold nothing sit in a free set; blocks that hold a
//!   cached, unreferenced prefix sit on an intrusive LRU list (oldest release first).
//! - Contiguity: the free set knows the KV cache's layout groups
//!   ([`zerolayer_kernels::attention::run_group`]), and [`BlockPool::allocate_after`] gives a
//!   growing sequence the next block of its group, so its K/V per head stay in long runs
//!   (`free`). Once the pool is full of cached blocks, it evicts a whole group (the first near
//!   the LRU's head that no sequence holds or pins) rather than one block at a time, so the
//!   runs survive a long-running server's first fill.
//! - Reference counts: a block shared by several sequences (a common prefix) is freed only
//!   when the last one releases it.
//! - Prefix caching: a *full* block is registered under the chained hash of its tokens
//!   ([`zerolayer_common::chain_hash`]). Released cached blocks keep their hash and stay
//!   reusable until allocation needs them, which evicts the least recently released first.
//! - Every store and eviction is recorded as a [`KvEvent`] for the cluster's prefix index.
//! - Pins (Anthropic's `cache_control` TTLs): a cached block may be pinned until a time. While
//!   its pin lives, the block, once unreferenced, waits in the pinned set instead of the LRU
//!   list, so no allocation evicts it; when the pin expires it joins the LRU tail. A pin on a
//!   pinned block extends it (a hit refreshes the TTL). At most `max_pinned` blocks hold a pin
//!   at once: a pin past that is refused, and LRU pressure from other traffic still has the rest
//!   of the pool. Time is the caller's (milliseconds on any clock that does not go back).
//!
//! Invariants (checked by [`BlockPool::check_invariants`] and `debug_assert!`s): a block is in
//! exactly one of {free stack, LRU list, pinned set, referenced}; refcounts never go below zero;
//! the hash map and the blocks' hashes agree; only cached blocks are pinned, and at most
//! `max_pinned` of them.

use std::collections::HashMap;
use zerolayer_common::KvEvent;

mod free;
mod spill;
use free::FreeBlocks;

pub type BlockId = u32;

const NIL: u32 = u32::MAX;

/// Where a block is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Place {
    Free,
    Lru,
    /// Cached, unreferenced, and pinned: not evictable until its pin expires.
    Pinned,
    Used,
}

/// What a full block holds, by name: the chained hash of its prefix, the hash before it (its
/// chain's root for a first block) and its own tokens. A lookup reuses a cached block only when
/// all three are equal, so a hash collision (forged or by chance) cannot hand a request KV
/// computed for other tokens: with each block's parent and tokens equal, the whole prefix is.
#[derive(Clone, Copy, Debug)]
pub struct BlockName<'a> {
    pub hash: u64,
    pub parent: u64,
    pub tokens: &'a [u32],
}

/// A block evicted from the prefix cache whose bytes are still in place.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Evicted {
    pub block: BlockId,
    pub hash: u64,
    pub parent: u64,
    pub tokens: Vec<u32>,
    /// The pin it held until pool pressure ended it early (pool time; 0: none).
    pub lapsed_pin: u64,
}

pub struct BlockPool {
    block_size: usize,
    refcount: Vec<u32>,
    hash: Vec<Option<u64>>,
    /// Per cached block: the parent hash and the tokens it was registered with.
    parent: Vec<u64>,
    tokens: Vec<u32>,
    place: Vec<Place>,
    free: FreeBlocks,
    // Intrusive doubly linked LRU list of cached, unreferenced blocks.
    prev: Vec<u32>,
    next: Vec<u32>,
    lru_head: u32,
    lru_tail: u32,
    lru_len: usize,
    cached: HashMap<u64, BlockId>,
    /// Per block: the time its pin expires (0: not pinned).
    pin_until: Vec<u64>,
    /// Blocks with a live pin (any place), and how many of them may have one.
    pinned: usize,
    max_pinned: usize,
    /// Unreferenced pinned blocks (the pinned set's size).
    pinned_idle: usize,
    /// The earliest live pin's expiry (u64::MAX: none).
    next_expiry: u64,
    events: Vec<KvEvent>,
    /// Events dropped because nobody drained them (the consumer must resync from a snapshot).
    events_overflowed: bool,
    max_pending_events: usize,
    /// Evicted blocks' names, for a disk tier that copies them out before they are reused
    /// (`None`: not recorded). See `spill`.
    evicted: Option<Vec<Evicted>>,
    /// Per block: the pin [`Self::unpin_idle`] ended early (0: none), which its copy on disk
    /// keeps.
    lapsed_pin: Vec<u64>,
}

impl BlockPool {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        assert!(num_blocks > 0 && num_blocks < NIL as usize, "num_blocks {num_blocks}");
        assert!(block_size > 0);
        BlockPool {
            block_size,
            refcount: vec![0; num_blocks],
            hash: vec![None; num_blocks],
            parent: vec![0; num_blocks],
            tokens: vec![0; num_blocks * block_size],
            place: vec![Place::Free; num_blocks],
            free: FreeBlocks::new(num_blocks, zerolayer_kernels::attention::run_group(block_size)),
            prev: vec![NIL; num_blocks],
            next: vec![NIL; num_blocks],
            lru_head: NIL,
            lru_tail: NIL,
            lru_len: 0,
            cached: HashMap::new(),
            pin_until: vec![0; num_blocks],
            pinned: 0,
            max_pinned: 0,
            pinned_idle: 0,
            next_expiry: u64::MAX,
            events: Vec::new(),
            events_overflowed: false,
            max_pending_events: 4096,
            evicted: None,
            lapsed_pin: vec![0; num_blocks],
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }
    pub fn num_blocks(&self) -> usize {
        self.refcount.len()
    }
    /// Blocks not referenced by any sequence (free or cached-evictable).
    pub fn num_free(&self) -> usize {
        self.free.len() + self.lru_len
    }
    /// Unreferenced blocks that still hold a cached prefix.
    pub fn num_cached_evictable(&self) -> usize {
        self.lru_len
    }
    /// Blocks registered in the prefix index (referenced or not).
    pub fn num_cached(&self) -> usize {
        self.cached.len()
    }
    pub fn refcount(&self, b: BlockId) -> u32 {
        self.refcount[b as usize]
    }
    /// Whether block `b` is cached, unreferenced and evictable (on the LRU list): counted in
    /// [`Self::num_free`], so taking a reference to it leaves one block fewer free (an idle
    /// pinned block is not free to begin with).
    pub fn is_evictable(&self, b: BlockId) -> bool {
        self.place[b as usize] == Place::Lru
    }

    /// Blocks holding a live pin.
    pub fn num_pinned(&self) -> usize {
        self.pinned
    }

    /// Sets how many blocks may hold a pin at once (pins already held stay until they expire).
    pub fn set_max_pinned(&mut self, n: usize) {
        self.max_pinned = n.min(self.num_blocks());
    }

    /// Pins cached block `b` until `until` (or later, if it already is). False, and nothing
    /// changes, when `b` holds no cached prefix or the pinned share is full.
    pub fn pin(&mut self, b: BlockId, until: u64) -> bool {
        let i = b as usize;
        if self.hash[i].is_none() || self.place[i] == Place::Free {
            return false;
        }
        if self.pin_until[i] == 0 {
            if self.pinned >= self.max_pinned {
                return false;
            }
            self.pinned += 1;
        }
        self.pin_until[i] = self.pin_until[i].max(until);
        self.next_expiry = self.next_expiry.min(self.pin_until[i]);
        if self.place[i] == Place::Lru {
            self.lru_unlink(b);
            self.place[i] = Place::Pinned;
            self.pinned_idle += 1;
        }
        true
    }

    /// Ends the pins of every unreferenced pinned block (they join the LRU tail, evictable):
    /// for when running work needs the room. Returns how many.
    pub fn unpin_idle(&mut self) -> usize {
        let mut n = 0;
        for i in 0..self.num_blocks() {
            if self.place[i] == Place::Pinned {
                self.lapsed_pin[i] = self.pin_until[i];
                self.pin_until[i] = 0;
                self.pinned -= 1;
                self.pinned_idle -= 1;
                self.lru_push_tail(i as BlockId);
                self.place[i] = Place::Lru;
                n += 1;
            }
        }
        n
    }

    /// Ends every pin that expired by `now`: those blocks become evictable (LRU tail).
    pub fn expire_pins(&mut self, now: u64) {
        if now < self.next_expiry {
            return;
        }
        self.next_expiry = u64::MAX;
        for i in 0..self.num_blocks() {
            let until = self.pin_until[i];
            if until == 0 {
                continue;
            }
            if until > now {
                self.next_expiry = self.next_expiry.min(until);
                continue;
            }
            self.pin_until[i] = 0;
            self.pinned -= 1;
            if self.place[i] == Place::Pinned {
                self.pinned_idle -= 1;
                self.lru_push_tail(i as BlockId);
                self.place[i] = Place::Lru;
            }
        }
    }

    /// Allocates an empty block (refcount 1), evicting the least recently used cached block
    /// when no plain free block is left. `None` when every block is referenced.
    pub fn allocate(&mut self) -> Option<BlockId> {
        let b = self.free.pop();
        self.take(b)
    }

    /// As [`Self::allocate`], for a sequence whose last block is `prev` (`None`: its first):
    /// the block after `prev` in its layout group when that is free, else the first of a
    /// wholly free group, so the sequence's K/V stay in long runs (see `free`).
    ///
    /// Once the pool has filled with cached blocks (every full block is cached, so a serving
    /// pool gets there after its first few thousand blocks of traffic), no group is wholly
    /// free and evicting one cached block at a time would hand sequences growing in turns
    /// alternate blocks (runs of one block). Then a whole group is made free instead: the
    /// least recently used cached block's group, with every other cached block in it, when no
    /// block of that group is referenced or pinned ([`Self::evict_group`]). Those blocks are
    /// the LRU's oldest, or were released with it (a sequence holds whole groups), and a chain
    /// of cached blocks is only reusable up to its first evicted block anyway.
    pub fn allocate_after(&mut self, prev: Option<BlockId>) -> Option<BlockId> {
        if let Some(b) = self.free.take_grouped(prev) {
            return self.take(Some(b));
        }
        if self.evict_group() {
            let b = self.free.take_grouped(prev);
            debug_assert!(b.is_some(), "an evicted group is wholly free");
            return self.take(b);
        }
        let b = self.free.pop();
        self.take(b)
    }

    /// How far down the LRU list [`Self::evict_group`] looks for a group it may free whole, in
    /// groups' worth of blocks: a bound on the work per allocation.
    const EVICT_SCAN_GROUPS: usize = 4;

    /// Frees a whole layout group by evicting its cached blocks: the group of the first LRU
    /// block (oldest first, within [`Self::EVICT_SCAN_GROUPS`] groups' worth of the list) whose
    /// group holds only free and LRU blocks. False, and nothing evicted, when there is none
    /// (or groups are single blocks).
    fn evict_group(&mut self) -> bool {
        let group = self.free.group();
        if group == 1 {
            return false;
        }
        let n = self.num_blocks();
        let mut cur = self.lru_head;
        for _ in 0..Self::EVICT_SCAN_GROUPS * group {
            if cur == NIL {
                return false;
            }
            let g = cur as usize / group;
            let blocks = g * group..((g + 1) * group).min(n);
            if blocks.clone().all(|i| matches!(self.place[i], Place::Free | Place::Lru)) {
                let mut hashes = vec![];
                for i in blocks {
                    if self.place[i] == Place::Lru {
                        hashes.push(self.uncache(i as BlockId));
                        self.place[i] = Place::Free;
                        self.free.push(i as BlockId);
                    }
                }
                self.push_event(KvEvent::Evicted { hashes });
                return true;
            }
            cur = self.next[cur as usize];
        }
        false
    }

    /// Hands out `free` (a block just taken from the free set), else evicts the least recently
    /// used cached block.
    fn take(&mut self, free: Option<BlockId>) -> Option<BlockId> {
        let b = if let Some(b) = free {
            b
        } else if self.lru_head != NIL {
            let b = self.lru_head;
            let h = self.uncache(b);
            self.push_event(KvEvent::Evicted { hashes: vec![h] });
            b
        } else {
            return None;
        };
        debug_assert_eq!(self.refcount[b as usize], 0);
        self.refcount[b as usize] = 1;
        self.place[b as usize] = Place::Used;
        Some(b)
    }

    /// Takes LRU block `b` off the LRU list and out of the prefix index; returns its hash (for
    /// the caller's `Evicted` event). The caller gives the block its next place.
    fn uncache(&mut self, b: BlockId) -> u64 {
        self.lru_unlink(b);
        let h = self.hash[b as usize].take().expect("LRU block has a hash");
        self.cached.remove(&h);
        self.record_eviction(b, h);
        h
    }

    /// The cached block holding the prefix `name` names, if any: its hash, parent and tokens
    /// all equal.
    pub fn lookup(&self, name: BlockName<'_>) -> Option<BlockId> {
        let b = *self.cached.get(&name.hash)?;
        let i = b as usize;
        let bs = self.block_size;
        (self.parent[i] == name.parent && self.tokens[i * bs..(i + 1) * bs] == *name.tokens).then_some(b)
    }

    /// Takes a reference to a block (a cached prefix block being reused).
    pub fn acquire(&mut self, b: BlockId) {
        let i = b as usize;
        match self.place[i] {
            Place::Lru => {
                self.lru_unlink(b);
                self.place[i] = Place::Used;
            }
            Place::Pinned => {
                self.pinned_idle -= 1;
                self.place[i] = Place::Used;
            }
            Place::Used => {}
            Place::Free => panic!("acquire of free block {b}"),
        }
        self.refcount[i] += 1;
    }

    /// Drops a reference. At zero a cached block joins the LRU tail; others become free.
    pub fn release(&mut self, b: BlockId) {
        let i = b as usize;
        assert!(self.place[i] == Place::Used && self.refcount[i] > 0, "release of unreferenced block {b}");
        self.refcount[i] -= 1;
        if self.refcount[i] == 0 {
            if self.pin_until[i] != 0 {
                self.pinned_idle += 1;
                self.place[i] = Place::Pinned;
            } else if self.hash[i].is_some() {
                self.lru_push_tail(b);
                self.place[i] = Place::Lru;
            } else {
                self.free.push(b);
                self.place[i] = Place::Free;
            }
        }
    }

    /// Registers a full, computed block under `hash`. If another block already holds that
    /// prefix, nothing changes (this one stays private and is freed normally). Returns whether
    /// the block is now the cached holder of `hash`.
    pub fn register(&mut self, b: BlockId, name: BlockName<'_>) -> bool {
        let i = b as usize;
        let hash = name.hash;
        debug_assert_eq!(self.place[i], Place::Used);
        assert_eq!(name.tokens.len(), self.block_size, "a block name holds one block of tokens");
        if let Some(h) = self.hash[i] {
            return h == hash;
        }
        if self.cached.contains_key(&hash) {
            return false;
        }
        self.cached.insert(hash, b);
        self.hash[i] = Some(hash);
        self.parent[i] = name.parent;
        let bs = self.block_size;
        self.tokens[i * bs..(i + 1) * bs].copy_from_slice(name.tokens);
        self.push_event(KvEvent::Stored { hashes: vec![hash] });
        true
    }

    /// Takes the KV events recorded since the last call, and whether some were dropped.
    pub fn drain_events(&mut self) -> (Vec<KvEvent>, bool) {
        let overflowed = std::mem::replace(&mut self.events_overflowed, false);
        (std::mem::take(&mut self.events), overflowed)
    }

    /// The cached chains, hottest first, at most `max`: each runs from a leaf of the prefix
    /// tree (a cached block that no cached block follows) back to the first block whose parent
    /// is not cached, and comes as (that parent: the chain's root, or an evicted block's hash;
    /// the blocks in chain order). Chains ending in a pinned or referenced block come first,
    /// then by how recently their leaf was released. A drain copies these ahead of its stop.
    pub fn hot_chains(&self, max: usize) -> Vec<(u64, Vec<BlockId>)> {
        let parents: std::collections::HashSet<u64> = self.cached.values().map(|&b| self.parent[b as usize]).collect();
        let is_leaf = |b: BlockId| self.hash[b as usize].is_some_and(|h| !parents.contains(&h));
        let mut leaves: Vec<BlockId> = self.cached.values().copied().filter(|&b| self.place[b as usize] != Place::Lru && is_leaf(b)).collect();
        leaves.sort_unstable();
        let mut b = self.lru_tail;
        while b != NIL && leaves.len() < max {
            if is_leaf(b) {
                leaves.push(b);
            }
            b = self.prev[b as usize];
        }
        leaves.truncate(max);
        leaves
            .into_iter()
            .map(|leaf| {
                let mut chain = vec![leaf];
                let mut p = self.parent[leaf as usize];
                // A chain is at most every block (the bound also guards against a cycle).
                while let Some(&b) = self.cached.get(&p).filter(|_| chain.len() < self.refcount.len()) {
                    chain.push(b);
                    p = self.parent[b as usize];
                }
                chain.reverse();
                (p, chain)
            })
            .collect()
    }

    /// The tokens cached block `b` was registered with.
    pub fn block_tokens(&self, b: BlockId) -> &[u32] {
        let bs = self.block_size;
        &self.tokens[b as usize * bs..(b as usize + 1) * bs]
    }

    /// Every hash currently in the prefix index (a snapshot for resync).
    pub fn cached_hashes(&self) -> Vec<u64> {
        self.cached.keys().copied().collect()
    }

    fn push_event(&mut self, e: KvEvent) {
        if self.events.len() >= self.max_pending_events {
            self.events.clear();
            self.events_overflowed = true;
        }
        // Coalesce consecutive events of the same kind.
        match (self.events.last_mut(), e) {
            (Some(KvEvent::Stored { hashes }), KvEvent::Stored { hashes: h }) => hashes.extend(h),
            (Some(KvEvent::Evicted { hashes }), KvEvent::Evicted { hashes: h }) => hashes.extend(h),
            (_, e) => self.events.push(e),
        }
    }

    fn lru_unlink(&mut self, b: BlockId) {
        let i = b as usize;
        let (p, n) = (self.prev[i], self.next[i]);
        if p != NIL {
            self.next[p as usize] = n;
        } else {
            self.lru_head = n;
        }
        if n != NIL {
            self.prev[n as usize] = p;
        } else {
            self.lru_tail = p;
        }
        self.prev[i] = NIL;
        self.next[i] = NIL;
        self.lru_len -= 1;
    }

    fn lru_push_tail(&mut self, b: BlockId) {
        let i = b as usize;
        self.prev[i] = self.lru_tail;
        self.next[i] = NIL;
        if self.lru_tail != NIL {
            self.next[self.lru_tail as usize] = b;
        } else {
            self.lru_head = b;
        }
        self.lru_tail = b;
        self.lru_len += 1;
    }

    /// Checks every invariant; panics with a description on the first violation. O(n).
    pub fn check_invariants(&self) {
        let n = self.num_blocks();
        let mut seen = vec![0u8; n];
        self.free.check(|i| self.place[i] == Place::Free);
        for b in self.free.iter() {
            let i = b as usize;
            assert_eq!(self.place[i], Place::Free, "block {b} on free stack but {:?}", self.place[i]);
            assert_eq!(self.refcount[i], 0, "free block {b} is referenced");
            assert!(self.hash[i].is_none(), "free block {b} has a hash");
            seen[i] += 1;
        }
        let mut cur = self.lru_head;
        let mut count = 0;
        let mut prev = NIL;
        while cur != NIL {
            let i = cur as usize;
            assert_eq!(self.place[i], Place::Lru);
            assert_eq!(self.refcount[i], 0, "LRU block {cur} is referenced");
            assert!(self.hash[i].is_some(), "LRU block {cur} has no hash");
            assert_eq!(self.prev[i], prev, "LRU links broken at {cur}");
            seen[i] += 1;
            count += 1;
            prev = cur;
            cur = self.next[i];
        }
        assert_eq!(prev, self.lru_tail);
        assert_eq!(count, self.lru_len);
        let (mut pinned, mut idle) = (0, 0);
        for i in 0..n {
            if self.place[i] == Place::Used {
                assert!(self.refcount[i] > 0, "used block {i} has refcount 0");
                seen[i] += 1;
            }
            if self.place[i] == Place::Pinned {
                assert_eq!(self.refcount[i], 0, "pinned-set block {i} is referenced");
                assert!(self.pin_until[i] != 0, "pinned-set block {i} has no pin");
                idle += 1;
                seen[i] += 1;
            }
            if self.pin_until[i] != 0 {
                assert!(self.hash[i].is_some(), "pinned block {i} holds no cached prefix");
                assert!(self.pin_until[i] >= self.next_expiry, "block {i}'s pin expires before next_expiry");
                pinned += 1;
            }
            assert_eq!(seen[i], 1, "block {i} is in {} places", seen[i]);
            if let Some(h) = self.hash[i] {
                assert_eq!(self.cached.get(&h), Some(&(i as u32)), "block {i} hash not indexed");
            }
        }
        for (&h, &b) in &self.cached {
            assert_eq!(self.hash[b as usize], Some(h), "index entry {h:x} -> {b} disagrees");
        }
        assert_eq!(pinned, self.pinned, "pinned count");
        assert_eq!(idle, self.pinned_idle, "pinned set size");
        assert!(self.pinned <= self.max_pinned.max(pinned), "pinned past the share");
    }
}

#[cfg(test)]
mod tests;
