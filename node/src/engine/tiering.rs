//! The engine's half of its worker's disk tier ([`crate::kv_disk`]): copying evicted blocks
//! out before they are overwritten, telling the tier which blocks are in RAM, and copying the
//! whole RAM cache down when the worker stops.

use std::sync::Arc;
use std::time::Instant;

use super::Engine;
use crate::kv_disk::{pin_to_unix, DiskTier, Spill};
use zerolayer_common::{DiskSignals, KvEvent};

impl Engine {
    /// Gives the engine a disk tier: from now on, blocks its pool evicts are written to it.
    pub fn set_disk(&mut self, disk: Arc<DiskTier>) {
        self.sched.record_evictions(true);
        self.disk = Some(disk);
    }

    /// The engine's disk tier, if it has one (the worker actor restores from it).
    pub fn disk(&self) -> Option<Arc<DiskTier>> {
        self.disk.clone()
    }

    fn pool_now_ms(&self) -> u64 {
        self.started_at.elapsed().as_millis() as u64
    }

    /// Offers every block evicted since the last call, and not on disk yet, to the disk tier.
    /// Must run after any allocation and before the next write into a block: until then the
    /// evicted blocks still hold their KV.
    pub(super) fn spill_evicted(&mut self) {
        let Some(disk) = &self.disk else { return };
        let now = self.pool_now_ms();
        for ev in self.sched.take_evicted() {
            let pin = pin_to_unix(ev.lapsed_pin, now);
            if !disk.evicted(ev.hash, pin) {
                continue;
            }
            let mut kv = Vec::with_capacity(self.backend.kv().block_bytes);
            if self.backend.read_block(ev.block, &mut kv).is_err() {
                continue;
            }
            disk.offer(Spill { hash: ev.hash, parent: ev.parent, tokens: ev.tokens, kv, pin_until_unix_ms: pin, resident: false });
        }
    }

    /// Blocks that entered RAM (computed or imported) need no restore while they stay.
    pub(super) fn note_stored(&self, events: &[KvEvent]) {
        let Some(disk) = &self.disk else { return };
        for ev in events {
            if let KvEvent::Stored { hashes } = ev {
                disk.mark_resident(hashes);
            }
        }
    }

    /// Copies every cached block not on disk yet to the disk tier, hottest first, and waits
    /// for the writes, until `deadline`: a worker that stops keeps its cache for its restart.
    /// Returns the blocks written.
    pub fn spill_all(&mut self, deadline: Instant) -> usize {
        let Some(disk) = self.disk.clone() else { return 0 };
        self.spill_evicted();
        let (mut n, now) = (0, self.pool_now_ms());
        for (b, hash, parent, pin) in self.sched.cached_blocks_hot_first() {
            if Instant::now() >= deadline {
                break;
            }
            if disk.holds(hash) {
                continue;
            }
            let mut kv = Vec::with_capacity(self.backend.kv().block_bytes);
            if self.backend.read_block(b, &mut kv).is_err() {
                continue;
            }
            let tokens = self.sched.block_tokens(b).to_vec();
            n += disk.offer_until(Spill { hash, parent, tokens, kv, pin_until_unix_ms: pin_to_unix(pin, now), resident: true }, deadline) as usize;
        }
        disk.flush(deadline);
        n
    }

    pub(super) fn disk_signals(&self) -> DiskSignals {
        let Some(disk) = &self.disk else { return DiskSignals::default() };
        let s = disk.stats();
        DiskSignals { blocks: s.blocks as u32, capacity_blocks: s.capacity as u32, written_total: s.written, dropped_total: s.dropped, restored_total: s.restored }
    }
}
