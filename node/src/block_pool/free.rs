//! The pool's plain free blocks, grouped as the CPU cache lays them out.
//!
//! The KV cache keeps each KV head's slots of `group` consecutive blocks in one contiguous run
//! (`zerolayer_kernels::attention::KvLayout`). A sequence whose blocks fill whole groups in
//! order therefore gives attention runs of `group × block_size` positions per head, instead of
//! one block's. This set hands blocks out so that they do: a sequence's next block is the one
//! after its last within the same group when that is free, and a sequence that starts a group
//! gets a group that is wholly free. Any free block is still handed out when no better one
//! is, so grouping never costs capacity; it only decides which free block comes first.
//!
//! O(1) per operation (amortized for [`FreeBlocks::take_after`]). Bounded: the stack holds
//! each block at most once and the list of whole groups each group at most once.

const NONE: u32 = u32::MAX;

pub(super) struct FreeBlocks {
    /// Blocks per group (1: no grouping).
    group: usize,
    /// The free blocks as a stack ([`Self::pop`] hands out the top), and each block's index in
    /// it (`NONE` when the block is not free).
    stack: Vec<u32>,
    at: Vec<u32>,
    /// Free blocks per group.
    group_free: Vec<u32>,
    /// Groups that were wholly free when listed (checked again when taken), each listed at most
    /// once (`listed`).
    whole: Vec<u32>,
    listed: Vec<bool>,
}

impl FreeBlocks {
    /// Every one of `n` blocks free; blocks and groups are handed out low ids first.
    pub(super) fn new(n: usize, group: usize) -> Self {
        let group = group.max(1);
        let groups = n.div_ceil(group);
        FreeBlocks {
            group,
            stack: (0..n as u32).rev().collect(),
            at: (0..n as u32).map(|b| n as u32 - 1 - b).collect(),
            group_free: (0..groups).map(|g| Self::size(n, group, g) as u32).collect(),
            whole: (0..groups as u32).rev().collect(),
            listed: vec![true; groups],
        }
    }

    /// Blocks in group `g` of `n` blocks (the last group may be short).
    fn size(n: usize, group: usize, g: usize) -> usize {
        group.min(n - g * group)
    }

    pub(super) fn len(&self) -> usize {
        self.stack.len()
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.stack.iter().copied()
    }

    fn is_free(&self, b: usize) -> bool {
        b < self.at.len() && self.at[b] != NONE
    }

    /// Returns block `b` to the set.
    pub(super) fn push(&mut self, b: u32) {
        let i = b as usize;
        debug_assert!(!self.is_free(i), "block {b} freed twice");
        self.at[i] = self.stack.len() as u32;
        self.stack.push(b);
        let g = i / self.group;
        self.group_free[g] += 1;
        if self.group_free[g] as usize == Self::size(self.at.len(), self.group, g) && !self.listed[g] {
            self.listed[g] = true;
            self.whole.push(g as u32);
        }
    }

    /// Takes block `b` (which must be free) out of the set.
    fn remove(&mut self, b: usize) {
        let idx = self.at[b] as usize;
        let last = self.stack.pop().expect("a free block is on the stack");
        if last as usize != b {
            self.stack[idx] = last;
            self.at[last as usize] = idx as u32;
        }
        self.at[b] = NONE;
        self.group_free[b / self.group] -= 1;
    }

    /// Any free block (the most recently freed).
    pub(super) fn pop(&mut self) -> Option<u32> {
        let b = *self.stack.last()?;
        self.remove(b as usize);
        Some(b)
    }

    /// A free block for a sequence whose last block is `prev` (`None`: it has none yet): the
    /// block after `prev` in the same group, else the first block of a wholly free group, else
    /// any free block.
    #[cfg(test)]
    pub(super) fn take_after(&mut self, prev: Option<u32>) -> Option<u32> {
        self.take_grouped(prev).or_else(|| self.pop())
    }

    /// Blocks per group.
    pub(super) fn group(&self) -> usize {
        self.group
    }

    /// The block after `prev` in the same group, else the first block of a wholly free group
    /// (with groups of one: any free block); `None` when neither is free.
    pub(super) fn take_grouped(&mut self, prev: Option<u32>) -> Option<u32> {
        if self.group == 1 {
            return self.pop();
        }
        if let Some(p) = prev {
            let next = p as usize + 1;
            if !next.is_multiple_of(self.group) && self.is_free(next) {
                self.remove(next);
                return Some(next as u32);
            }
        }
        while let Some(g) = self.whole.pop() {
            let g = g as usize;
            self.listed[g] = false;
            if self.group_free[g] as usize == Self::size(self.at.len(), self.group, g) {
                let b = g * self.group;
                self.remove(b);
                return Some(b as u32);
            }
        }
        None
    }

    /// Checks the set's own bookkeeping against `is_free` (the pool's view); panics on the
    /// first disagreement. O(n).
    pub(super) fn check(&self, is_free: impl Fn(usize) -> bool) {
        let n = self.at.len();
        let mut counts = vec![0u32; self.group_free.len()];
        for b in 0..n {
            assert_eq!(self.is_free(b), is_free(b), "block {b}: free set and pool disagree");
            if self.is_free(b) {
                assert_eq!(self.stack[self.at[b] as usize] as usize, b, "block {b}'s stack index");
                counts[b / self.group] += 1;
            }
        }
        assert_eq!(counts, self.group_free, "free blocks per group");
        assert_eq!(self.whole.len(), self.listed.iter().filter(|&&l| l).count(), "listed groups");
        for (g, _) in self.listed.iter().enumerate().filter(|(_, &l)| !l) {
            assert!((counts[g] as usize) < Self::size(n, self.group, g) || self.group == 1, "whole group {g} not listed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequences_fill_whole_groups_in_order() {
        // 4 sequences growing in turns, block by block, over 8 groups of 4.
        let mut f = FreeBlocks::new(32, 4);
        let mut seqs: Vec<Vec<u32>> = vec![vec![]; 4];
        for _ in 0..8 {
            for s in seqs.iter_mut() {
                let b = f.take_after(s.last().copied()).unwrap();
                s.push(b);
            }
        }
        for s in &seqs {
            for pair in s.chunks(4) {
                assert_eq!(pair[0] % 4, 0, "{s:?}: a group starts at its first block");
                assert!(pair.windows(2).all(|w| w[1] == w[0] + 1), "{s:?}: consecutive within a group");
            }
        }
        assert_eq!(f.len(), 0);
        assert_eq!(f.take_after(Some(3)), None);
        f.check(|_| false);
    }

    #[test]
    fn a_full_set_still_hands_out_every_block() {
        let mut f = FreeBlocks::new(10, 4);
        // Hold one block of each group: no group is whole any more.
        let held: Vec<u32> = [0u32, 4, 8].iter().map(|&b| {
            f.remove(b as usize);
            b
        }).collect();
        let mut got = vec![];
        while let Some(b) = f.take_after(got.last().copied()) {
            got.push(b);
        }
        got.extend(&held);
        got.sort();
        assert_eq!(got, (0..10).collect::<Vec<_>>());
        f.check(|_| false);
    }

    #[test]
    fn freed_groups_become_whole_again_and_are_listed_once() {
        let mut f = FreeBlocks::new(8, 4);
        let a: Vec<u32> = (0..4).map(|_| f.take_after(None).unwrap()).collect();
        assert_eq!(a[..2], [0, 4], "each new sequence starts a whole group");
        assert!(a[2..].iter().all(|&b| b < 4), "then any free block: {a:?}");
        for &b in a.iter().filter(|&&b| b != 4) {
            f.push(b);
        }
        f.check(|b| b != 4);
        // Group 0 is whole again; group 1 is not (4 held).
        assert_eq!(f.take_after(None), Some(0));
        assert_eq!(f.take_after(Some(0)), Some(1));
        f.push(4);
        f.push(1);
        f.push(0);
        f.check(|_| true);
        assert!(f.whole.len() <= 2);
    }
}
