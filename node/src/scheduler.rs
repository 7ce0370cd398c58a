//! The continuous-batching scheduler. Sans-IO: a plain struct, driven by the engine and by tests.
//!
//! Each [`Scheduler::schedule_into`] call plans one engine step under a token budget and a
//! prefill budget (which the engine sizes so that a step carrying decodes stays short:
//! `step_time`):
//! 1. Running sequences: every decode first (one token each), then the next chunk of each
//!    prompt being prefilled (chunked prefill), each group oldest first. A prompt never holds a
//!    decode back, and the prefill budget bounds how long the decodes' step takes.
//! 2. Then waiting sequences are admitted, fairly between API keys (below), while the budgets,
//!    the running-batch limit and free blocks allow. Admission reuses every cached full block of the prompt's
//!    prefix (automatic prefix caching), so only the uncached tail is computed.
//!
//! When a running sequence needs a block and none is free, a running sequence is preempted by
//! recompute: the youngest of the API key (tenant) holding the largest share of the worker
//! ([`fair`]; with one key, simply the youngest). Its blocks are released (its full blocks stay
//! cached, so re-admission is usually cheap) and it returns to the waiting queue in arrival
//! order. Admission picks the next waiting sequence of the key with the smallest share, and
//! only when its prompt plus a bounded share of its output (`reserve_output_tokens`; all of it
//! after a preemption) fits beside the running sequences' reservations. A request is refused
//! at [`Scheduler::add`] only if it could not fit even alone; anything that fits alone
//! completes, because the oldest sequence is never preempted for another.
//!
//! A resumed sequence (one that moved here mid-generation, or is replayed after a loss) counts
//! as arriving before every new one: its client is already reading its stream, so it is not
//! queued behind new prompts.
//!
//! Bounds: at most `max_waiting` queued sequences, `max_running` running, and
//! `max_batch_tokens` tokens per step, of which prefill takes at most its budget (at least one
//! token, so prompts always move).

use std::collections::{HashMap, VecDeque};

use zerolayer_common::{chain_hash, Share};

use crate::block_pool::{BlockId, BlockName, BlockPool};
use crate::error::{WorkerError, Result};
use crate::step_time::Outlook;

pub type SeqId = u64;

/// Where new sequences' arrival stamps start (resumed ones take the stamps below it).
const NEW_ARRIVALS: u64 = 1 << 62;

/// Scheduler limits.
#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    pub block_size: usize,
    pub num_blocks: usize,
    pub max_batch_tokens: usize,
    pub max_running: usize,
    pub max_waiting: usize,
    /// Longest sequence (prompt + output) the model accepts.
    pub max_model_len: usize,
    /// Output tokens of KV a sequence must find room for, beyond its prompt, to be admitted
    /// (a bounded share of its `max_tokens`). A sequence preempted before needs room for all of
    /// its `max_tokens`, so it is not let back in only to be preempted again.
    pub reserve_output_tokens: usize,
}

/// A sequence to queue: its tokens (the prompt's `prompt_len`, then any output it already
/// generated elsewhere), the most tokens it may generate in all (that output included), and
/// the tenant it runs for (fair sharing: [`fair`]), and the root of its cache names (its
/// cache scope: it reuses only blocks cached under the same root).
#[derive(Clone, Debug)]
pub struct Entry {
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    pub max_tokens: usize,
    pub share: Share,
    pub cache_root: u64,
    /// The logits of every prompt position are wanted (prompt logprobs): the prompt is computed
    /// anew, reusing no cached block, in chunks of at most [`PROMPT_LOGITS_CHUNK`] tokens.
    pub prompt_logits: bool,
}

/// The longest prompt chunk of a sequence that wants every position's logits: each position
/// costs a vocabulary-wide row of logits on the host (152k f32s, 0.6 MB, for Qwen2.5).
pub const PROMPT_LOGITS_CHUNK: usize = 64;

impl Entry {
    /// A new sequence of `prompt` for the default tenant.
    pub fn new(prompt: Vec<u32>, max_tokens: usize) -> Entry {
        Entry { prompt_len: prompt.len(), tokens: prompt, max_tokens, share: Share::default(), cache_root: 0, prompt_logits: false }
    }

    /// This entry, whose last tokens after the first `prompt_len` were generated elsewhere.
    pub fn resumed(mut self, prompt_len: usize) -> Entry {
        self.prompt_len = prompt_len;
        self
    }

    /// This entry for the tenant `share` names.
    pub fn shared(mut self, share: Share) -> Entry {
        self.share = share;
        self
    }

    /// This entry in the cache scope whose names start at `root`.
    pub fn scoped(mut self, root: u64) -> Entry {
        self.cache_root = root;
        self
    }

    /// This entry, wanting (or not) every prompt position's logits.
    pub fn with_prompt_logits(mut self, on: bool) -> Entry {
        self.prompt_logits = on;
        self
    }
}

/// A sequence's scheduling state.
#[derive(Debug)]
pub struct Sequence {
    pub id: SeqId,
    /// Prompt followed by generated tokens.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    pub max_tokens: usize,
    /// Tokens whose K/V are in the cache.
    pub num_computed: usize,
    pub blocks: Vec<BlockId>,
    /// Chained hashes of the full blocks of `tokens` computed so far, from `cache_root`.
    hashes: Vec<u64>,
    /// The root of its chain: its cache scope's.
    pub cache_root: u64,
    /// Leading blocks already registered in (or taken from) the prefix cache.
    num_registered: usize,
    /// Prompt tokens served from the prefix cache at first admission.
    pub cached_prompt_tokens: usize,
    /// Whether the sequence has been admitted at least once.
    pub started: bool,
    pub preemptions: u32,
    arrival: u64,
    /// The API key it runs for.
    pub share: Share,
    /// Tokens of KV its admission reserved room for (prompt plus reserved output).
    reserved_until: usize,
    /// Wants every prompt position's logits (see [`Entry::prompt_logits`]).
    pub prompt_logits: bool,
}

impl Sequence {
    /// The longest chunk it may compute in one step when `need` tokens are left.
    fn chunk_cap(&self, need: usize) -> usize {
        if self.prompt_logits && need > 1 { PROMPT_LOGITS_CHUNK } else { usize::MAX }
    }
}

impl Sequence {
    /// The name of its full block `j` (hashed already): hash, parent, tokens.
    fn name(&self, j: usize, bs: usize) -> BlockName<'_> {
        BlockName { hash: self.hashes[j], parent: if j == 0 { self.cache_root } else { self.hashes[j - 1] }, tokens: &self.tokens[j * bs..(j + 1) * bs] }
    }

    pub fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }
    pub fn is_prefilling(&self) -> bool {
        self.num_computed + 1 < self.tokens.len()
    }
    fn seat(&self) -> fair::Seat {
        fair::Seat { id: self.id, share: self.share, blocks: self.blocks.len(), preemptions: self.preemptions, arrival: self.arrival }
    }
}

/// One sequence's work in a step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScheduledItem {
    pub seq: SeqId,
    /// First position computed.
    pub start: usize,
    /// Tokens computed.
    pub len: usize,
    /// The chunk reaches the end of the sequence's tokens, so its logits pick the next token.
    pub completes: bool,
}

/// The plan for one step.
#[derive(Debug, Default)]
pub struct Plan {
    pub items: Vec<ScheduledItem>,
    /// Sequences admitted for the first time in this step.
    pub started: Vec<SeqId>,
    pub preempted: Vec<SeqId>,
}

/// Counters exposed as signals.
#[derive(Clone, Debug, Default)]
pub struct SchedulerStats {
    pub preemptions_total: u64,
    /// Preemptions of a sequence that had been preempted before (a preemption loop).
    pub repreemptions_total: u64,
    pub prefix_cache_queries_total: u64,
    pub prefix_cache_hits_total: u64,
}

/// The block pool as the engine sees it: counts only, never the pool itself.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvBlocks {
    pub total: usize,
    /// Not referenced by any sequence (includes cached, evictable blocks).
    pub free: usize,
    /// Free blocks that still hold a cached prefix.
    pub cached_evictable: usize,
    pub block_size: usize,
}

pub struct Scheduler {
    cfg: SchedulerConfig,
    pool: BlockPool,
    seqs: HashMap<SeqId, Sequence>,
    waiting: VecDeque<SeqId>,
    /// In arrival order (oldest first).
    running: Vec<SeqId>,
    /// The order of step 1 of a schedule (kept to reuse its allocation).
    order: Vec<SeqId>,
    /// Arrival stamps: new sequences count up from [`NEW_ARRIVALS`]; resumed ones (moved here
    /// mid-generation, or replayed) count down below it, so they are ahead of every new one.
    next_arrival: u64,
    next_resumed: u64,
    pub stats: SchedulerStats,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig) -> Self {
        assert!(cfg.block_size > 0 && cfg.max_batch_tokens > 0 && cfg.max_running > 0);
        let pool = BlockPool::new(cfg.num_blocks, cfg.block_size);
        Scheduler { cfg, pool, seqs: HashMap::new(), waiting: VecDeque::new(), running: Vec::new(), order: Vec::new(), next_arrival: NEW_ARRIVALS, next_resumed: NEW_ARRIVALS - 1, stats: Default::default() }
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// The pool's block counts.
    pub fn kv_blocks(&self) -> KvBlocks {
        KvBlocks {
            total: self.pool.num_blocks(),
            free: self.pool.num_free(),
            cached_evictable: self.pool.num_cached_evictable(),
            block_size: self.pool.block_size(),
        }
    }

    /// Prefix-cache events (blocks stored / evicted) since the last call; `true` if some were
    /// dropped because nobody took them in time (the reader must then resync).
    pub fn drain_kv_events(&mut self) -> (Vec<zerolayer_common::KvEvent>, bool) {
        self.pool.drain_events()
    }

    /// The pool's hottest cached chains (see [`BlockPool::hot_chains`]), each as its root and
    /// the tokens its blocks hold.
    pub fn hot_chains(&self, max: usize) -> Vec<(u64, Vec<u32>)> {
        self.pool.hot_chains(max).into_iter().map(|(root, blocks)| (root, blocks.iter().flat_map(|&b| self.pool.block_tokens(b).iter().copied()).collect())).collect()
    }

    /// Every prefix hash the pool caches now.
    pub fn cached_hashes(&self) -> Vec<u64> {
        self.pool.cached_hashes()
    }

    /// Every sequence the scheduler holds: running (oldest first), then waiting.
    pub fn sequence_ids(&self) -> Vec<SeqId> {
        self.running.iter().chain(self.waiting.iter()).copied().collect()
    }

    /// The cached block holding the prefix named `name`, if any (nothing changes).
    pub fn lookup(&self, name: BlockName<'_>) -> Option<BlockId> {
        self.pool.lookup(name)
    }

    /// The cached block holding the prefix named `hash`, pinned (not evictable) until
    /// [`Self::unpin`]; for a KV import that skips blocks the pool already has.
    pub fn pin_cached(&mut self, name: BlockName<'_>) -> Option<BlockId> {
        let b = self.pool.lookup(name)?;
        self.pool.acquire(b);
        Some(b)
    }

    pub fn unpin(&mut self, b: BlockId) {
        self.pool.release(b);
    }

    /// A block for imported KV (free, or the LRU cached one), held until [`Self::commit_import`];
    /// placed after `prev`, the chain's previous block, as a growing sequence's (`allocate_after`).
    pub fn alloc_import(&mut self, prev: Option<BlockId>) -> Option<BlockId> {
        self.pool.allocate_after(prev)
    }

    /// The imported block `b` now holds the prefix `hash`: it joins the prefix cache (evictable,
    /// most recently used) and a `Stored` KV event announces it.
    pub fn commit_import(&mut self, b: BlockId, name: BlockName<'_>) {
        self.pool.register(b, name);
        self.pool.release(b);
    }

    /// Starts recording evicted blocks for [`Self::take_evicted`] (a disk tier copies them).
    pub fn record_evictions(&mut self, on: bool) {
        self.pool.record_evictions(on);
    }

    /// Blocks evicted since the last call, whose bytes are still in place until the next
    /// forward or import writes over them.
    pub fn take_evicted(&mut self) -> Vec<crate::block_pool::Evicted> {
        self.pool.take_evicted()
    }

    /// Every cached block, hottest first, as (block, hash, parent, pin expiry or 0).
    pub fn cached_blocks_hot_first(&self) -> Vec<(BlockId, u64, u64, u64)> {
        self.pool.cached_blocks_hot_first()
    }

    /// The tokens cached block `b` holds.
    pub fn block_tokens(&self, b: BlockId) -> &[u32] {
        self.pool.block_tokens(b)
    }

    /// Checks the pool's invariants (tests).
    pub fn check_invariants(&self) {
        self.pool.check_invariants();
    }

    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.cfg.block_size)
    }

    /// Queues a sequence. Refuses one that could never fit alone, or a full queue.
    pub fn add(&mut self, id: SeqId, entry: Entry) -> Result<()> {
        let Entry { tokens: prompt, prompt_len, max_tokens, share, cache_root, prompt_logits } = entry;
        if prompt_len == 0 || prompt.len() < prompt_len {
            return Err(WorkerError::Invalid("empty prompt".into()));
        }
        if prompt.len() - prompt_len > max_tokens {
            return Err(WorkerError::Invalid(format!("{} tokens already generated, more than max_tokens {max_tokens}", prompt.len() - prompt_len)));
        }
        if self.seqs.contains_key(&id) {
            return Err(WorkerError::Invalid(format!("duplicate sequence id {id}")));
        }
        let total = prompt_len + max_tokens;
        if total > self.cfg.max_model_len {
            return Err(WorkerError::TooLong { needed: total, limit: self.cfg.max_model_len });
        }
        let cap = self.cfg.num_blocks * self.cfg.block_size;
        if self.blocks_for(total) > self.cfg.num_blocks {
            return Err(WorkerError::TooLong { needed: total, limit: cap });
        }
        if self.waiting.len() >= self.cfg.max_waiting {
            return Err(WorkerError::QueueFull(self.waiting.len()));
        }
        let resumed = prompt.len() > prompt_len;
        self.seqs.insert(
            id,
            Sequence {
                id,
                tokens: prompt,
                prompt_len,
                max_tokens,
                num_computed: 0,
                blocks: vec![],
                hashes: vec![],
                cache_root,
                num_registered: 0,
                cached_prompt_tokens: 0,
                started: false,
                preemptions: 0,
                arrival: if resumed { self.next_resumed } else { self.next_arrival },
                share,
                reserved_until: 0,
                prompt_logits,
            },
        );
        if resumed {
            // Ahead of every new sequence: a client is already reading this one's stream.
            self.next_resumed -= 1;
            let pos = self.waiting.partition_point(|w| self.seqs[w].arrival < self.seqs[&id].arrival);
            self.waiting.insert(pos, id);
        } else {
            self.next_arrival += 1;
            self.waiting.push_back(id);
        }
        Ok(())
    }

    pub fn get(&self, id: SeqId) -> Option<&Sequence> {
        self.seqs.get(&id)
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }
    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }
    pub fn running_ids(&self) -> &[SeqId] {
        &self.running
    }

    /// Plans the next step, with the whole token budget open to prefill.
    pub fn schedule(&mut self) -> Plan {
        let mut plan = Plan::default();
        self.schedule_into(&mut plan, self.cfg.max_batch_tokens);
        plan
    }

    /// What the next step holds before prefill: its decodes, and where the oldest prompt being
    /// prefilled (or the next to be admitted) stands. The engine sizes the prefill budget from it.
    pub fn outlook(&self) -> Outlook {
        let mut o = Outlook::default();
        let mut prefill_start = None;
        for s in self.running.iter().map(|r| &self.seqs[r]) {
            if s.tokens.len() - s.num_computed == 1 {
                o.decodes.add(s.num_computed, 1);
            } else if prefill_start.is_none() {
                prefill_start = Some(s.num_computed);
            }
        }
        o.prefill_start = prefill_start.unwrap_or(0);
        o
    }

    fn preempt(&mut self, id: SeqId, plan: &mut Plan) {
        self.running.retain(|&r| r != id);
        plan.items.retain(|it| it.seq != id);
        let s = self.seqs.get_mut(&id).unwrap();
        // Release tail blocks first so they are evicted before the (more reusable) prefix.
        for &b in s.blocks.iter().rev() {
            self.pool.release(b);
        }
        s.blocks.clear();
        s.num_computed = 0;
        s.num_registered = 0;
        if s.preemptions > 0 {
            self.stats.repreemptions_total += 1;
        }
        s.preemptions += 1;
        self.stats.preemptions_total += 1;
        let arrival = s.arrival;
        let pos = self.waiting.partition_point(|w| self.seqs[w].arrival < arrival);
        self.waiting.insert(pos, id);
        plan.preempted.push(id);
    }

    /// Records that a step computed `plan`'s items: advances computed counts and registers
    /// every newly completed full block in the prefix cache.
    pub fn on_computed(&mut self, plan: &Plan) {
        let bs = self.cfg.block_size;
        for it in &plan.items {
            let Some(s) = self.seqs.get_mut(&it.seq) else { continue };
            debug_assert_eq!(s.num_computed, it.start);
            s.num_computed = it.start + it.len;
            register_computed(&mut self.pool, s, bs);
        }
    }

    /// Appends a sampled token to a sequence.
    pub fn append_token(&mut self, id: SeqId, tok: u32) {
        if let Some(s) = self.seqs.get_mut(&id) {
            s.tokens.push(tok);
        }
    }

    /// Removes a sequence (finished or cancelled) and releases its blocks.
    pub fn remove(&mut self, id: SeqId) -> Option<Sequence> {
        let s = self.seqs.remove(&id)?;
        self.running.retain(|&r| r != id);
        self.waiting.retain(|&w| w != id);
        for &b in s.blocks.iter().rev() {
            self.pool.release(b);
        }
        Some(s)
    }

    /// Prompt tokens of waiting and prefilling sequences not yet computed.
    pub fn waiting_prefill_tokens(&self) -> u64 {
        self.seqs.values().map(|s| s.tokens.len().saturating_sub(s.num_computed + 1) as u64).sum()
    }

    /// Blocks held by decoding sequences.
    pub fn active_decode_blocks(&self) -> usize {
        self.running.iter().map(|r| &self.seqs[r]).filter(|s| !s.is_prefilling()).map(|s| s.blocks.len()).sum()
    }

    /// 1 − live token slots ÷ slots in allocated blocks.
    pub fn fragmentation(&self) -> f32 {
        let bs = self.cfg.block_size;
        let allocated = self.pool.num_blocks() - self.pool.num_free();
        if allocated == 0 {
            return 0.0;
        }
        let empty: usize = self.running.iter().map(|r| &self.seqs[r]).map(|s| s.blocks.len() * bs - s.num_computed.min(s.blocks.len() * bs)).sum();
        (empty as f32 / (allocated * bs) as f32).clamp(0.0, 1.0)
    }
}

/// Registers every full block of `s` computed so far in the prefix cache.
fn register_computed(pool: &mut BlockPool, s: &mut Sequence, bs: usize) {
    extend_hashes(s, bs);
    while s.num_registered < s.num_computed / bs {
        let j = s.num_registered;
        pool.register(s.blocks[j], s.name(j, bs));
        s.num_registered += 1;
    }
}

fn extend_hashes(s: &mut Sequence, bs: usize) {
    let full = s.tokens.len() / bs;
    while s.hashes.len() < full {
        let j = s.hashes.len();
        let parent = if j == 0 { s.cache_root } else { s.hashes[j - 1] };
        s.hashes.push(chain_hash(parent, &s.tokens[j * bs..(j + 1) * bs]));
    }
}

mod draft;
mod fair;
mod pins;
mod step;

#[cfg(test)]
mod tests;
