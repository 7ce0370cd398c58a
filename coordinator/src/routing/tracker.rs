//! Corrects the placement view for signal staleness with what this coordinator itself knows.
//!
//! Worker signals are up to ~100 ms old locally and a few hundred more after gossip. Without a
//! correction, a burst arriving within one interval would all see the same idle worker, and a
//! request sent right after another finished would still see that one's load. So placements
//! count as waiting work on their worker, and completions are taken off it, until the worker's
//! signals can reflect them.
//!
//! Sans-IO: every method takes `now`. Bounded: at most [`TRACKER_CAPACITY`] marks of each
//! kind; the oldest go first. Arithmetic on the view saturates (signals may come from peers).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::view::ClusterView;

/// Marks remembered per kind (a burst larger than this forgets the oldest).
pub const TRACKER_CAPACITY: usize = 4096;

#[derive(Default)]
pub struct Tracker {
    inner: Mutex<Marks>,
}

#[derive(Default)]
struct Marks {
    next_id: u64,
    pending: VecDeque<Mark>,
    done: VecDeque<Mark>,
}

struct Mark {
    id: u64,
    at: Instant,
    node: String,
    worker: String,
    uncached_tokens: u64,
    blocks: u32,
}

impl Tracker {
    /// Records a placement on `node/worker` of a prompt with `uncached_tokens` to compute.
    pub fn placed(&self, node: &str, worker: &str, uncached_tokens: u64, now: Instant) -> u64 {
        let mut t = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        t.next_id += 1;
        let id = t.next_id;
        if t.pending.len() >= TRACKER_CAPACITY {
            t.pending.pop_front();
        }
        t.pending.push_back(Mark { id, at: now, node: node.into(), worker: worker.into(), uncached_tokens, blocks: 0 });
        id
    }

    /// The placement `id` finished, freeing `blocks`.
    pub fn finished(&self, id: u64, blocks: u32, now: Instant) {
        let mut t = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let Some(pos) = t.pending.iter().position(|m| m.id == id) else {
            return;
        };
        let Some(mut m) = t.pending.remove(pos) else { return };
        m.at = now;
        m.blocks = blocks;
        if t.done.len() >= TRACKER_CAPACITY {
            t.done.pop_front();
        }
        t.done.push_back(m);
    }

    /// Marks held now (pending, done): for tests and leak checks.
    pub fn len(&self) -> (usize, usize) {
        let t = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        (t.pending.len(), t.done.len())
    }

    /// Applies marks younger than the staleness window of their worker (local or remote).
    pub fn adjust(&self, view: &mut ClusterView, local_window: Duration, remote_window: Duration, now: Instant) {
        let mut guard = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let t = &mut *guard;
        for q in [&mut t.pending, &mut t.done] {
            // Pending marks of long requests stay until they finish; others expire.
            while q.front().is_some_and(|m| now.saturating_duration_since(m.at) > remote_window * 20) {
                q.pop_front();
            }
        }
        let fresh = |m: &Mark, local: bool| now.saturating_duration_since(m.at) <= if local { local_window } else { remote_window };
        for m in t.pending.iter() {
            if let Some(w) = view.workers.iter_mut().find(|w| w.node == m.node && w.worker == m.worker) {
                if fresh(m, w.local) {
                    w.signals.waiting = w.signals.waiting.saturating_add(1);
                    w.signals.waiting_prefill_tokens = w.signals.waiting_prefill_tokens.saturating_add(m.uncached_tokens);
                }
            }
        }
        for m in t.done.iter() {
            if let Some(w) = view.workers.iter_mut().find(|w| w.node == m.node && w.worker == m.worker) {
                if fresh(m, w.local) {
                    let s = &mut w.signals;
                    s.running = s.running.saturating_sub(1);
                    s.waiting_prefill_tokens = s.waiting_prefill_tokens.saturating_sub(m.uncached_tokens);
                    s.active_decode_blocks = s.active_decode_blocks.saturating_sub(m.blocks);
                    s.kv_blocks_free = s.kv_blocks_free.saturating_add(m.blocks).min(s.kv_blocks_total);
                }
            }
        }
    }
}

/// Takes a finished request off the tracker when its response is dropped.
pub struct PlacementMark {
    tracker: Arc<Tracker>,
    id: u64,
    blocks: u32,
}

impl PlacementMark {
    pub fn new(tracker: Arc<Tracker>, id: u64, blocks: u32) -> Self {
        PlacementMark { tracker, id, blocks }
    }
}

impl Drop for PlacementMark {
    fn drop(&mut self) {
        self.tracker.finished(self.id, self.blocks, Instant::now());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::view::test_worker;
    use zerolayer_common::WorkerSignals;

    fn view() -> ClusterView {
        let signals = WorkerSignals { kv_blocks_total: 100, kv_blocks_free: 50, running: 1, active_decode_blocks: 10, ..Default::default() };
        ClusterView { workers: vec![test_worker("a", true, signals.clone()), test_worker("b", false, signals)] }
    }

    #[test]
    fn placements_count_until_signals_catch_up_then_completions_free() {
        let t = Tracker::default();
        let t0 = Instant::now();
        let (local, remote) = (Duration::from_millis(200), Duration::from_millis(600));
        let id = t.placed("b", "cpu0", 40, t0);
        let mut v = view();
        t.adjust(&mut v, local, remote, t0 + Duration::from_millis(300));
        assert_eq!((v.workers[1].signals.waiting, v.workers[1].signals.waiting_prefill_tokens), (1, 40), "remote mark still fresh");
        assert_eq!(v.workers[0].signals.waiting, 0);
        let mut v = view();
        t.adjust(&mut v, local, remote, t0 + Duration::from_millis(700));
        assert_eq!(v.workers[1].signals.waiting, 0, "expired once the gossip window passed");
        t.finished(id, 8, t0 + Duration::from_millis(800));
        let mut v = view();
        t.adjust(&mut v, local, remote, t0 + Duration::from_millis(900));
        let s = &v.workers[1].signals;
        assert_eq!((s.running, s.active_decode_blocks, s.kv_blocks_free), (0, 2, 58));
        // Everything expires: nothing is held forever.
        t.adjust(&mut view(), local, remote, t0 + remote * 21 + Duration::from_secs(1));
        assert_eq!(t.len(), (0, 0));
    }

    #[test]
    fn bounded_and_saturating() {
        let t = Tracker::default();
        let now = Instant::now();
        for _ in 0..TRACKER_CAPACITY + 10 {
            t.placed("a", "cpu0", u64::MAX, now);
        }
        assert_eq!(t.len().0, TRACKER_CAPACITY);
        let mut v = view();
        v.workers[0].signals.waiting = u32::MAX;
        t.adjust(&mut v, Duration::from_secs(1), Duration::from_secs(1), now);
        assert_eq!((v.workers[0].signals.waiting, v.workers[0].signals.waiting_prefill_tokens), (u32::MAX, u64::MAX));
    }
}
