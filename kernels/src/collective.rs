//! Collectives for tensor parallelism: the one operation a Megatron-style shard needs, an
//! all-reduce (sum) of partial activations across the ranks of a group.
//!
//! **Fixed order.** Every implementation sums element `i` as `((p₀ + p₁) + p₂) + …` in rank
//! order, whatever the buffer's length or the element's place in it. So the result is
//! bit-identical on every rank, run to run, and does not depend on the batch: tensor
//! parallelism keeps batch invariance. (A ring all-reduce would not: which rank starts an
//! element's sum depends on how the buffer is cut into ring segments, which depends on its
//! length. NCCL groups therefore all-gather the partials and sum them locally in this order.)
//!
//! [`Solo`] is the group of one (a no-op); [`thread_group`] makes the ranks of a group of threads
//! in one process, the CPU implementation that CI runs the sharding logic on.

use std::sync::{Arc, Barrier, RwLock};

/// A rank's handle on its group.
pub trait Collective: Send {
    /// This rank, `0..size()`.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn size(&self) -> usize;
    /// Replaces `buf` on every rank with the elementwise sum over ranks, in rank order. Every
    /// rank calls it with a buffer of the same length, in the same sequence of calls. A group
    /// whose ranks talk over a network can lose one: that is an error, and the group is then
    /// unusable (every later call fails too).
    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<(), CollectiveError>;
}

/// A group that can no longer sum: a rank is gone, or sent what no rank of this group sends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CollectiveError(pub String);

impl std::fmt::Display for CollectiveError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "tensor-parallel group: {}", self.0)
    }
}

impl std::error::Error for CollectiveError {}

/// The group of one: nothing to reduce.
pub struct Solo;

impl Collective for Solo {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn all_reduce_sum(&mut self, _buf: &mut [f32]) -> Result<(), CollectiveError> {
        Ok(())
    }
}

/// Sums `parts` (one slice per rank, equal lengths) into `out` in rank order: the reduction
/// every implementation uses.
pub fn sum_in_rank_order<'a>(parts: impl Iterator<Item = &'a [f32]> + Clone, out: &mut [f32]) {
    let mut it = parts;
    let first = it.next().expect("at least one rank");
    assert_eq!(first.len(), out.len(), "all-reduce buffer length");
    out.copy_from_slice(first);
    for p in it {
        assert_eq!(p.len(), out.len(), "all-reduce buffer length");
        for (o, x) in out.iter_mut().zip(p) {
            *o += x;
        }
    }
}

struct Shared {
    /// Each rank's partial, published for the others to read.
    slots: Vec<RwLock<Vec<f32>>>,
    barrier: Barrier,
}

/// One rank of a group of threads in this process (see [`thread_group`]).
pub struct ThreadCollective {
    rank: usize,
    shared: Arc<Shared>,
    /// The reduced values, built here before they overwrite the caller's buffer.
    sum: Vec<f32>,
}

/// The `n` ranks of a new group, to be moved one to each thread. Each collective call blocks
/// until every rank has made it, so each rank must run on its own thread.
pub fn thread_group(n: usize) -> Vec<ThreadCollective> {
    assert!(n >= 1, "a group has at least one rank");
    let shared = Arc::new(Shared { slots: (0..n).map(|_| RwLock::new(Vec::new())).collect(), barrier: Barrier::new(n) });
    (0..n).map(|rank| ThreadCollective { rank, shared: shared.clone(), sum: Vec::new() }).collect()
}

impl Collective for ThreadCollective {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.shared.slots.len()
    }
    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<(), CollectiveError> {
        let s = &*self.shared;
        if s.slots.len() == 1 {
            return Ok(());
        }
        {
            let mut mine = s.slots[self.rank].write().expect("slot lock");
            mine.clear();
            mine.extend_from_slice(buf);
        }
        // Every partial is published...
        s.barrier.wait();
        {
            let parts: Vec<_> = s.slots.iter().map(|l| l.read().expect("slot lock")).collect();
            self.sum.resize(buf.len(), 0.0);
            sum_in_rank_order(parts.iter().map(|p| p.as_slice()), &mut self.sum);
        }
        buf.copy_from_slice(&self.sum);
        // ...and read by every rank before any slot is written again.
        s.barrier.wait();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every rank gets the rank-order sum, bit for bit, call after call, with buffers of any
    /// length; the group of one changes nothing.
    #[test]
    fn thread_group_sums_in_rank_order() {
        for n in 1..=4usize {
            let results: Vec<Vec<Vec<f32>>> = std::thread::scope(|sc| {
                let hs: Vec<_> = thread_group(n)
                    .into_iter()
                    .map(|mut c| {
                        sc.spawn(move || {
                            let mut outs = Vec::new();
                            for len in [1usize, 7, 1000, 3] {
                                let r = c.rank() as f32;
                                let mut buf: Vec<f32> = (0..len).map(|i| 0.1 * (i as f32 + 1.0) + r * 1e-3 + 1e7 * (r % 2.0)).collect();
                                c.all_reduce_sum(&mut buf).unwrap();
                                outs.push(buf);
                            }
                            outs
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            for (ci, len) in [1usize, 7, 1000, 3].into_iter().enumerate() {
                let want: Vec<f32> = (0..len)
                    .map(|i| {
                        let mut acc = 0.1 * (i as f32 + 1.0);
                        for r in 1..n {
                            let r = r as f32;
                            acc += 0.1 * (i as f32 + 1.0) + r * 1e-3 + 1e7 * (r % 2.0);
                        }
                        acc
                    })
                    .collect();
                for rank in 0..n {
                    assert_eq!(results[rank][ci], want, "n {n} rank {rank} call {ci}");
                }
            }
        }
        let mut solo = Solo;
        let mut b = vec![1.5f32, -2.0];
        solo.all_reduce_sum(&mut b).unwrap();
        assert_eq!(b, [1.5, -2.0]);
    }
}
