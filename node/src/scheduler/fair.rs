//! Fair sharing between API keys (tenants): who is admitted next, and who gives way when a
//! running sequence needs a block and none is free.
//!
//! A tenant's *share* of the worker is its dominant one: the larger of its fraction of running
//! slots and its fraction of KV blocks, divided by its weight (dominant resource fairness).
//! - **Admission** takes the waiting sequence of the tenant with the smallest share (oldest first
//!   within a tenant, and on ties), so a key with many long requests cannot keep another key's
//!   requests waiting behind its own.
//! - **Preemption** takes from the tenant with the largest share: its sequence preempted the
//!   fewest times, youngest first. The oldest running sequence is never taken for another, so
//!   anything that fits alone still completes; with one tenant this is the youngest sequence, as
//!   before.

use std::collections::HashMap;

use zerolayer_common::Share;

/// What fairness needs of a sequence.
#[derive(Clone, Copy, Debug)]
pub(super) struct Seat {
    pub id: u64,
    pub share: Share,
    pub blocks: usize,
    pub preemptions: u32,
    pub arrival: u64,
}

/// Each tenant's running slots, KV blocks and weight.
#[derive(Default)]
pub(super) struct Usage {
    by_tenant: HashMap<u64, (usize, usize, f32)>,
}

impl Usage {
    pub(super) fn of(running: &[Seat]) -> Usage {
        let mut u = Usage::default();
        for s in running {
            u.add(s.share, s.blocks);
        }
        u
    }

    fn add(&mut self, share: Share, blocks: usize) {
        let e = self.by_tenant.entry(share.tenant).or_insert((0, 0, share.weight));
        e.0 += 1;
        e.1 += blocks;
    }

    /// The tenant's dominant share over its weight.
    fn share(&self, tenant: u64, max_running: usize, num_blocks: usize) -> f64 {
        match self.by_tenant.get(&tenant) {
            None => 0.0,
            Some(&(n, b, w)) => (n as f64 / max_running.max(1) as f64).max(b as f64 / num_blocks.max(1) as f64) / w.max(1e-3) as f64,
        }
    }
}

/// The position in `waiting` (arrival order) of the sequence to admit next: the first of the
/// tenant with the smallest share.
pub(super) fn next_waiting(waiting: &[Seat], usage: &Usage, max_running: usize, num_blocks: usize) -> Option<usize> {
    let mut best: Option<(usize, f64)> = None;
    for (i, s) in waiting.iter().enumerate() {
        let share = usage.share(s.share.tenant, max_running, num_blocks);
        if best.is_none_or(|(_, b)| share < b) {
            best = Some((i, share));
        }
    }
    best.map(|(i, _)| i)
}

/// The running sequence to preempt so that `needy` can grow (`running` oldest first), or `None`
/// if `needy` should rather wait a step. The victim comes from the tenant with the largest share:
/// its sequence preempted the fewest times, the youngest of those (`needy` itself, possibly).
/// The oldest running sequence is never taken, so anything that fits alone completes. And a
/// sequence never takes from a tenant whose share is smaller than its own: it waits until that
/// tenant's sequences move on (they are never all waiting: the oldest of them, or someone,
/// always runs).
pub(super) fn victim(running: &[Seat], needy: &Seat, usage: &Usage, max_running: usize, num_blocks: usize) -> Option<u64> {
    let oldest = running[0].id;
    let share = |s: &Seat| usage.share(s.share.tenant, max_running, num_blocks);
    let mut best: Option<(&Seat, f64)> = None;
    for s in running.iter().filter(|s| s.id != oldest) {
        let sh = share(s);
        let better = match best {
            None => true,
            Some((b, bs)) => sh > bs || (sh == bs && (s.preemptions < b.preemptions || (s.preemptions == b.preemptions && s.arrival > b.arrival))),
        };
        if better {
            best = Some((s, sh));
        }
    }
    let (v, vs) = best?;
    (vs >= share(needy)).then_some(v.id)
}

/// Whether a running sequence's reservation holds against a candidate for admission: only
/// against one of a tenant whose share is at least as large (a smaller tenant may take blocks
/// that a larger one reserved; the larger one then waits for them rather than preempting).
pub(super) fn reservation_holds(holder: &Seat, candidate: &Seat, usage: &Usage, max_running: usize, num_blocks: usize) -> bool {
    usage.share(holder.share.tenant, max_running, num_blocks) <= usage.share(candidate.share.tenant, max_running, num_blocks)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seat(id: u64, share: Share, blocks: usize, arrival: u64) -> Seat {
        Seat { id, share, blocks, preemptions: 0, arrival }
    }

    #[test]
    fn weights_scale_a_tenants_share() {
        let (a, b) = (Share::of("a", 2.0), Share::of("b", 1.0));
        // A (weight 2) runs two sequences, B (weight 1) one: equal shares, so the first waiting
        // (in arrival order) goes next; with a third A sequence running, B's goes next.
        let mut running = vec![seat(1, a, 4, 0), seat(2, a, 4, 1), seat(3, b, 4, 2)];
        let waiting = [seat(4, a, 0, 3), seat(5, b, 0, 4)];
        assert_eq!(next_waiting(&waiting, &Usage::of(&running), 8, 100), Some(0));
        running.push(seat(6, a, 4, 5));
        assert_eq!(next_waiting(&waiting, &Usage::of(&running), 8, 100), Some(1));
        // A needs a block: it takes from itself (the largest share), its youngest, never the
        // oldest; B needing one takes from A too.
        let u = Usage::of(&running);
        assert_eq!(victim(&running, &running[1], &u, 8, 100), Some(6));
        assert_eq!(victim(&running, &running[2], &u, 8, 100), Some(6));
        // The oldest running sequence, of the largest tenant, waits rather than take from B.
        let running = vec![seat(1, a, 90, 0), seat(3, b, 4, 2)];
        assert_eq!(victim(&running, &running[0], &Usage::of(&running), 8, 100), None);
        // A reservation holds only against tenants at least as large.
        let u = Usage::of(&running);
        assert!(!reservation_holds(&running[0], &seat(9, b, 0, 9), &u, 8, 100));
        assert!(reservation_holds(&running[1], &seat(9, a, 0, 9), &u, 8, 100));
    }
}
