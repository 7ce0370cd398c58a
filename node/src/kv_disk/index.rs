//! Which block each slot of the disk tier holds, and which slot a new block overwrites (pure).
//!
//! Replacement is CLOCK, an LRU approximation: a hand sweeps the slots; a slot read since the
//! hand last passed (`referenced`) gets a second chance, an empty one is taken at once, and a
//! slot whose pin (`cache_control` TTL, carried down from RAM) is still live is skipped, so a
//! pinned prefix survives any flood of other traffic on disk too. When two whole sweeps find
//! nothing (every slot pinned), the write is dropped.
//!
//! `resident` marks blocks that are in RAM too (restored, or computed again): a restore reads
//! only blocks that are not, and a block evicted again is not written again.

use std::collections::HashMap;

#[derive(Clone, Copy, Debug, Default)]
struct Slot {
    /// 0: empty (or being written).
    hash: u64,
    pin_until_unix_ms: u64,
    referenced: bool,
    resident: bool,
}

#[derive(Debug)]
pub struct Index {
    slots: Vec<Slot>,
    by_hash: HashMap<u64, u32>,
    hand: usize,
}

impl Index {
    pub fn new(slots: usize) -> Self {
        Index { slots: vec![Slot::default(); slots], by_hash: HashMap::new(), hand: 0 }
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.by_hash.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }

    /// Every block held.
    pub fn hashes(&self) -> impl Iterator<Item = u64> + '_ {
        self.by_hash.keys().copied()
    }

    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// The slot holding `hash`, marked as read (a second chance at the next sweep).
    pub fn get(&mut self, hash: u64) -> Option<u32> {
        let s = *self.by_hash.get(&hash)?;
        self.slots[s as usize].referenced = true;
        Some(s)
    }

    /// Whether `hash` is held and not also in RAM (a restore reads it).
    pub fn restorable(&self, hash: u64) -> bool {
        self.by_hash.get(&hash).is_some_and(|&s| !self.slots[s as usize].resident)
    }

    pub fn contains(&self, hash: u64) -> bool {
        self.by_hash.contains_key(&hash)
    }

    /// Marks `hash` as in RAM too (or not), if held.
    pub fn set_resident(&mut self, hash: u64, resident: bool) {
        if let Some(&s) = self.by_hash.get(&hash) {
            self.slots[s as usize].resident = resident;
        }
    }

    /// Extends `hash`'s pin to `pin_until_unix_ms`, if held.
    pub fn pin(&mut self, hash: u64, pin_until_unix_ms: u64) {
        if let Some(&s) = self.by_hash.get(&hash) {
            let slot = &mut self.slots[s as usize];
            slot.pin_until_unix_ms = slot.pin_until_unix_ms.max(pin_until_unix_ms);
        }
    }

    /// A slot to write a new block into, emptied (its old block forgotten, returned with it),
    /// or `None` when every slot is pinned past `now_unix_ms`.
    pub fn claim(&mut self, now_unix_ms: u64) -> Option<(u32, Option<u64>)> {
        let n = self.slots.len();
        for _ in 0..2 * n {
            let s = self.hand;
            self.hand = (self.hand + 1) % n;
            let slot = &mut self.slots[s];
            if slot.hash != 0 && slot.pin_until_unix_ms > now_unix_ms {
                continue;
            }
            if slot.referenced {
                slot.referenced = false;
                continue;
            }
            let old = (slot.hash != 0).then_some(slot.hash);
            if let Some(h) = old {
                self.by_hash.remove(&h);
            }
            *slot = Slot::default();
            return Some((s as u32, old));
        }
        None
    }

    /// Records that slot `s` (claimed) now holds `hash`. A block already held elsewhere keeps
    /// its old slot, and `s` stays empty.
    pub fn fill(&mut self, s: u32, hash: u64, pin_until_unix_ms: u64, resident: bool) {
        if hash == 0 || self.by_hash.contains_key(&hash) {
            return;
        }
        self.by_hash.insert(hash, s);
        self.slots[s as usize] = Slot { hash, pin_until_unix_ms, referenced: false, resident };
    }

    /// Forgets slot `s`'s block (a record found torn or stale); returns it if there was one.
    pub fn forget(&mut self, s: u32) -> Option<u64> {
        let slot = &mut self.slots[s as usize];
        let mut gone = None;
        if slot.hash != 0 && self.by_hash.get(&slot.hash) == Some(&s) {
            self.by_hash.remove(&slot.hash);
            gone = Some(slot.hash);
        }
        *slot = Slot::default();
        gone
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clock_takes_empty_slots_then_the_least_recently_read() {
        let mut ix = Index::new(3);
        for h in 1..=3u64 {
            let (s, old) = ix.claim(0).unwrap();
            assert_eq!(old, None);
            ix.fill(s, h, 0, false);
        }
        assert_eq!(ix.len(), 3);
        // Block 1 was read: the hand passes it over and takes 2.
        assert_eq!(ix.get(1), Some(0));
        assert_eq!(ix.claim(0), Some((1, Some(2))));
        assert!(!ix.contains(2) && ix.contains(1));
        ix.fill(1, 4, 0, false);
        assert_eq!(ix.claim(0), Some((2, Some(3))));
    }

    #[test]
    fn live_pins_are_never_overwritten() {
        let mut ix = Index::new(2);
        let (a, _) = ix.claim(0).unwrap();
        ix.fill(a, 10, 1_000, false);
        let (b, _) = ix.claim(0).unwrap();
        ix.fill(b, 11, 0, false);
        for round in 0..4u64 {
            let (s, old) = ix.claim(500).unwrap();
            assert_eq!(s, b, "round {round}: only the unpinned slot turns over");
            assert_ne!(old, Some(10));
            ix.fill(s, 20 + round, 0, false);
        }
        assert!(ix.contains(10));
        ix.pin(23, 2_000);
        assert_eq!(ix.claim(500), None, "every slot pinned: the write is dropped");
        assert!(ix.claim(1_500).is_some(), "block 10's pin expired");
    }

    #[test]
    fn resident_blocks_are_not_restorable_and_fill_ignores_duplicates() {
        let mut ix = Index::new(2);
        let (s, _) = ix.claim(0).unwrap();
        ix.fill(s, 5, 0, false);
        assert!(ix.restorable(5));
        ix.set_resident(5, true);
        assert!(!ix.restorable(5) && ix.contains(5));
        let (t, _) = ix.claim(0).unwrap();
        ix.fill(t, 5, 0, false);
        assert_eq!(ix.len(), 1, "a block is held once");
        assert_eq!(ix.forget(s), Some(5));
        assert!(ix.is_empty());
    }
}
