//! The engine's half of a move: a sequence leaving (`export`, `pre_copy`: its tokens, seed and
//! the bytes of its computed full blocks) and KV blocks arriving (`import`, into the prefix
//! cache). [`crate::migrate`] holds what travels.

use super::Engine;
use crate::block_pool::BlockName;
use crate::error::{Result, WorkerError};
use crate::migrate::{CachedChain, Export, ImportReport, KvImport};
use crate::scheduler::SeqId;

impl Engine {
    /// Takes sequence `id` out of this engine for a move: its tokens, seed, and the KV bytes of
    /// its computed full blocks, which stay in this worker's prefix cache after it leaves. The
    /// other sequences are not paused.
    pub fn export(&mut self, id: SeqId) -> Option<Export> {
        let export = self.pre_copy(id)?;
        self.states.remove(&id);
        self.sched.remove(id);
        Some(export)
    }

    /// What [`Engine::export`] would hand over for sequence `id` now, leaving it running: a drain
    /// copies these blocks to the target ahead of the move (they are immutable once full), so the
    /// move itself sends only the blocks computed since.
    pub fn pre_copy(&self, id: SeqId) -> Option<Export> {
        let st = self.states.get(&id)?;
        let s = self.sched.get(id)?;
        let bs = self.sched.config().block_size;
        let full = s.num_computed / bs;
        let mut block_hashes = zerolayer_common::block_hashes_from(s.cache_root, &s.tokens[..full * bs], bs);
        let block_bytes = self.backend.kv().block_bytes;
        let mut kv = Vec::with_capacity(full * block_bytes);
        for (i, &b) in s.blocks[..full].iter().enumerate() {
            // A block that cannot be read ends the chain there: the target computes the rest.
            if let Err(e) = self.backend.read_block(b, &mut kv) {
                tracing::warn!(seq = id, block = i, error = %e, "a KV block could not be read for a move; the chain sent stops before it");
                block_hashes.truncate(i);
                break;
            }
        }
        let (prompt, generated) = (s.tokens[..s.prompt_len].to_vec(), s.tokens[s.prompt_len..].to_vec());
        Some(Export { prompt, generated, seed: st.sampler.seed(), cache_root: s.cache_root, block_hashes, kv, block_bytes, block_size: bs })
    }

    /// The hottest cached chains, at most `max`, each as its root and its tokens (see
    /// `BlockPool::hot_chains`): what a drain copies to other workers before its node stops.
    pub fn hot_chains(&self, max: usize) -> Vec<(u64, Vec<u32>)> {
        self.sched.hot_chains(max)
    }

    /// The KV of the cached blocks of the chain that `tokens` (a whole number of blocks) spell
    /// from `cache_root`, from block `from` to the first block not cached: what another worker
    /// fetches instead of recomputing them. The blocks before `from` are looked up too (the
    /// chain must be cached from its start to be usable) but not read. Nothing is pinned: the
    /// engine thread runs nothing else while it reads.
    pub fn read_cached(&mut self, cache_root: u64, tokens: &[u32], from: usize) -> CachedChain {
        let bs = self.sched.config().block_size;
        let block_bytes = self.backend.kv().block_bytes;
        let hashes = zerolayer_common::block_hashes_from(cache_root, &tokens[..tokens.len() / bs * bs], bs);
        let mut found = Vec::new();
        let mut kv = Vec::new();
        for (i, &hash) in hashes.iter().enumerate() {
            let parent = if i == 0 { cache_root } else { hashes[i - 1] };
            let Some(b) = self.sched.lookup(BlockName { hash, parent, tokens: &tokens[i * bs..(i + 1) * bs] }) else { break };
            if i >= from {
                if let Err(e) = self.backend.read_block(b, &mut kv) {
                    tracing::warn!(block = i, error = %e, "a cached KV block could not be read for a fetch; the chain sent stops before it");
                    break;
                }
            }
            found.push(hash);
        }
        let from = from.min(found.len());
        self.served_total += (found.len() - from) as u64;
        CachedChain { cache_root, tokens: tokens[..found.len() * bs].to_vec(), block_hashes: found, from, kv, block_bytes, block_size: bs }
    }

    /// Writes the blocks of `imp` this worker does not cache into its prefix cache, in chain
    /// order, and stops at the first it cannot place. Blocks it already caches are pinned while
    /// the rest is written, so the import cannot evict its own chain.
    pub fn import(&mut self, imp: &KvImport) -> Result<ImportReport> {
        let bs = self.sched.config().block_size;
        let block_bytes = self.backend.kv().block_bytes;
        if imp.block_size != bs || imp.block_bytes != block_bytes {
            return Err(WorkerError::Invalid(format!(
                "KV import of {}-token blocks of {} bytes into a worker with {bs}-token blocks of {} bytes",
                imp.block_size,
                imp.block_bytes,
                block_bytes
            )));
        }
        if imp.tokens.len() < imp.blocks.len() * bs {
            return Err(WorkerError::Invalid(format!("KV import of {} blocks with {} tokens", imp.blocks.len(), imp.tokens.len())));
        }
        let mut report = ImportReport::default();
        let mut pinned = Vec::new();
        // The chain's block before the current one, whichever way it got here.
        let mut prev = None;
        for (i, (hash, bytes)) in imp.blocks.iter().enumerate() {
            let parent = if i == 0 { imp.cache_root } else { imp.blocks[i - 1].0 };
            let name = BlockName { hash: *hash, parent, tokens: &imp.tokens[i * bs..(i + 1) * bs] };
            if let Some(b) = self.sched.pin_cached(name) {
                pinned.push(b);
                report.already_cached += 1;
                prev = Some(b);
                continue;
            }
            let Some(bytes) = bytes else {
                report.skipped = imp.blocks.len() - i;
                break;
            };
            if bytes.len() != imp.block_bytes {
                return Err(WorkerError::Invalid(format!("KV block {i}: {} bytes, not {}", bytes.len(), imp.block_bytes)));
            }
            let Some(b) = self.sched.alloc_import(prev) else {
                report.skipped = imp.blocks.len() - i;
                break;
            };
            // The block it took may have been evicted: its KV goes to disk before it is overwritten.
            self.spill_evicted();
            if let Err(e) = self.backend.write_block(b, bytes) {
                // The block joins nothing: it goes back to the pool, and the chain stops here.
                self.sched.unpin(b);
                tracing::warn!(block = i, error = %e, "a KV block could not be written; the import stops before it");
                report.skipped = imp.blocks.len() - i;
                break;
            }
            self.sched.commit_import(b, name);
            report.imported += 1;
            self.imported_total += 1;
            prev = Some(b);
        }
        for b in pinned {
            self.sched.unpin(b);
        }
        let (ev, overflowed) = self.sched.drain_kv_events();
        if overflowed {
            self.kv_events.clear();
        }
        self.kv_events.extend(ev);
        Ok(report)
    }
}
