//! The engine: model + KV cache + scheduler + sampling + stopping, one `step()` at a time.
//! Sans-IO apart from the compute: the worker actor's thread calls `step()` in a loop and routes
//! the returned events; tests drive it directly.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use zerolayer_common::{KvEvent, SamplingParams, SeqEvent, StopReason, Usage, WorkerSignals};

use crate::error::{Result, WorkerError};
use crate::model::{recycle, ForwardItem, KvCache, Model};
use crate::sampler::Sampler;
use crate::scheduler::{Plan, Scheduler, SchedulerConfig, SeqId};
use crate::stop::StopChecker;
use crate::tokenizer::{IncrementalDecoder, Tokenizer};

/// Engine limits (from the worker's config).
#[derive(Clone, Debug)]
pub struct EngineConfig {
    pub block_size: usize,
    pub kv_cache_bytes: usize,
    pub max_batch_tokens: usize,
    pub max_running: usize,
    pub max_waiting: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig { block_size: 16, kv_cache_bytes: 512 << 20, max_batch_tokens: 512, max_running: 32, max_waiting: 256 }
    }
}

struct SeqState {
    params: SamplingParams,
    sampler: Sampler,
    decoder: IncrementalDecoder,
    stop: StopChecker,
}

/// Output of one step: events per sequence, in order.
#[derive(Debug, Default)]
pub struct StepOutput {
    pub events: Vec<(SeqId, SeqEvent)>,
    /// Tokens computed in this step (prefill + decode).
    pub tokens_computed: usize,
}

pub struct Engine {
    pub model: Model,
    pub tokenizer: Arc<Tokenizer>,
    cache: KvCache,
    sched: Scheduler,
    states: HashMap<SeqId, SeqState>,
    kv_events: Vec<KvEvent>,
    started_at: Instant,
    generated_total: u64,
    /// (time, generated_total) samples for the tokens/s signal.
    rate_window: std::collections::VecDeque<(Instant, u64)>,
    /// Recent admissions' (hit, queried) prompt tokens for the windowed hit ratio.
    hit_window: std::collections::VecDeque<(u64, u64)>,
    /// Logits rows of the last step, reused (no per-step allocation).
    logits: Vec<f32>,
    /// The step's plan and per-item buffers, reused (empty between steps).
    bufs: StepBufs,
    hook: Option<StepHook>,
}

/// Runs at the start of every step that computes something, on the engine thread, with the
/// ids of the step's sequences. For tests and fault injection: it may block (holding the step,
/// so a test can depend on an event instead of a speed) or return an error (failing exactly
/// that step's sequences).
pub type StepHook = Box<dyn FnMut(&[SeqId]) -> Result<()> + Send>;

#[derive(Default)]
struct StepBufs {
    plan: Plan,
    want: Vec<bool>,
    items: Vec<ForwardItem<'static>>,
}

impl Engine {
    pub fn new(model: Model, tokenizer: Arc<Tokenizer>, cfg: &EngineConfig) -> Result<Self> {
        let cache = KvCache::with_budget(&model.cfg, cfg.block_size, cfg.kv_cache_bytes)?;
        let sched = Scheduler::new(SchedulerConfig {
            block_size: cfg.block_size,
            num_blocks: cache.num_blocks,
            max_batch_tokens: cfg.max_batch_tokens,
            max_running: cfg.max_running,
            max_waiting: cfg.max_waiting,
            max_model_len: model.cfg.context_length,
        });
        Ok(Engine {
            model,
            tokenizer,
            cache,
            sched,
            states: HashMap::new(),
            kv_events: Vec::new(),
            started_at: Instant::now(),
            generated_total: 0,
            rate_window: Default::default(),
            hit_window: Default::default(),
            logits: Vec::new(),
            bufs: StepBufs::default(),
            hook: None,
        })
    }

    /// Installs (or removes) the step hook.
    pub fn set_step_hook(&mut self, hook: Option<StepHook>) {
        self.hook = hook;
    }

    pub fn scheduler(&self) -> &Scheduler {
        &self.sched
    }

    pub fn num_blocks(&self) -> usize {
        self.cache.num_blocks
    }

    /// Queues a request. Errors: too long for the model or the cache, or the queue is full.
    pub fn add(&mut self, id: SeqId, prompt: Vec<u32>, params: SamplingParams) -> Result<()> {
        if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= self.model.cfg.vocab_size) {
            return Err(WorkerError::Invalid(format!("token id {bad} is outside the vocabulary")));
        }
        self.sched.add(id, prompt, params.max_tokens as usize)?;
        self.states.insert(
            id,
            SeqState { sampler: Sampler::new(&params), decoder: IncrementalDecoder::default(), stop: StopChecker::new(&params.stop_sequences), params },
        );
        Ok(())
    }

    /// Cancels a sequence, freeing its blocks. Returns its final event if it existed.
    pub fn cancel(&mut self, id: SeqId) -> Option<SeqEvent> {
        self.states.remove(&id)?;
        let s = self.sched.remove(id)?;
        Some(SeqEvent::Finished { reason: StopReason::Cancelled, usage: usage_of(&s) })
    }

    pub fn has_work(&self) -> bool {
        !self.sched.is_idle()
    }

    /// Runs one step: schedule, forward, sample, detokenize, check stops. A failure (of the
    /// forward, or of one sequence's detokenization) ends only the sequences it touched, with
    /// an error event; the engine goes on.
    pub fn step(&mut self) -> Result<StepOutput> {
        let mut bufs = std::mem::take(&mut self.bufs);
        let r = self.step_with(&mut bufs);
        self.bufs = bufs;
        r
    }

    fn step_with(&mut self, bufs: &mut StepBufs) -> Result<StepOutput> {
        self.sched.schedule_into(&mut bufs.plan);
        let plan = &bufs.plan;
        let mut out = StepOutput::default();
        for &id in &plan.started {
            let s = self.sched.get(id).unwrap();
            out.events.push((id, SeqEvent::Started { prompt_tokens: s.prompt_len as u32, cached_tokens: s.cached_prompt_tokens as u32 }));
            self.hit_window.push_back((s.cached_prompt_tokens as u64, s.prompt_len as u64));
            if self.hit_window.len() > 64 {
                self.hit_window.pop_front();
            }
        }
        if plan.items.is_empty() {
            return Ok(out);
        }
        if let Some(hook) = &mut self.hook {
            let ids: Vec<SeqId> = plan.items.iter().map(|it| it.seq).collect();
            if let Err(e) = hook(&ids) {
                self.fail(&ids, &e, &mut out);
                return Ok(out);
            }
        }
        // Sequences with max_tokens == 0 only prefill; they need no logits.
        let want = &mut bufs.want;
        want.clear();
        want.extend(plan.items.iter().map(|it| {
            let s = self.sched.get(it.seq).unwrap();
            it.completes && s.generated() < s.max_tokens
        }));
        let want = &*want;
        let rows = {
            let mut items: Vec<ForwardItem<'_>> = recycle(std::mem::take(&mut bufs.items));
            items.extend(plan.items.iter().zip(want).map(|(it, &w)| {
                let s = self.sched.get(it.seq).unwrap();
                ForwardItem { tokens: &s.tokens[it.start..it.start + it.len], start_pos: it.start, block_table: &s.blocks, want_logits: w }
            }));
            let rows = self.model.forward_into(&mut self.cache, &items, &mut self.logits);
            bufs.items = recycle(items);
            match rows {
                Ok(rows) => rows,
                Err(e) => {
                    let ids: Vec<SeqId> = plan.items.iter().map(|it| it.seq).collect();
                    self.fail(&ids, &e, &mut out);
                    return Ok(out);
                }
            }
        };
        // Taken out for the sampling loop (which needs `&mut self`) and put back below.
        let logits_buf = std::mem::take(&mut self.logits);
        let vocab = self.model.cfg.vocab_size;
        out.tokens_computed = plan.items.iter().map(|it| it.len).sum();
        self.sched.on_computed(plan);
        let (ev, overflowed) = self.sched.drain_kv_events();
        if overflowed {
            self.kv_events.clear();
        }
        self.kv_events.extend(ev);

        let mut logits = logits_buf[..rows * vocab].chunks_exact(vocab);
        for (it, &w) in plan.items.iter().zip(want) {
            if !it.completes {
                continue;
            }
            if !w {
                // max_tokens == 0: the prompt is now cached; nothing to generate.
                self.finish(it.seq, StopReason::MaxTokens, &mut out);
                continue;
            }
            let row = logits.next().expect("one logits row per wanted item");
            if let Err(e) = self.on_token(it.seq, row, &mut out) {
                self.fail(&[it.seq], &e, &mut out);
            }
        }
        self.logits = logits_buf;
        Ok(out)
    }

    /// Ends `ids` with an error (their step failed); every other sequence goes on.
    fn fail(&mut self, ids: &[SeqId], e: &WorkerError, out: &mut StepOutput) {
        tracing::error!(error = %e, sequences = ids.len(), "engine step failed; failing its sequences");
        for &id in ids {
            self.finish(id, StopReason::Error(e.to_string()), out);
        }
    }

    /// The per-token path, written once: sample, detokenize, check stop sequences, the end
    /// token and `max_tokens`, emit the token's text, and finish the sequence if it is over.
    fn on_token(&mut self, id: SeqId, logits: &[f32], out: &mut StepOutput) -> Result<()> {
        let st = self.states.get_mut(&id).expect("state for scheduled sequence");
        let tok = st.sampler.sample(logits);
        self.sched.append_token(id, tok);
        self.generated_total += 1;
        let s = self.sched.get(id).expect("scheduled sequence");
        let end = self.tokenizer.is_end_token(tok) && !st.params.ignore_eos;
        let at_limit = !end && s.generated() >= st.params.max_tokens as usize;
        // An end token adds no text of its own: only what the decoder still holds back.
        let gen = &s.tokens[s.prompt_len..s.tokens.len() - usize::from(end)];
        let mut text = if end { String::new() } else { st.decoder.step(&self.tokenizer, gen)? };
        if end || at_limit {
            text.push_str(&st.decoder.flush(&self.tokenizer, gen)?);
        }
        let step = st.stop.push(&text);
        let mut emit = step.emit;
        let reason = match step.matched {
            Some(m) => Some(StopReason::StopSequence(m)),
            None if end => Some(StopReason::EndTurn),
            None if at_limit => Some(StopReason::MaxTokens),
            None => None,
        };
        if matches!(reason, Some(StopReason::EndTurn | StopReason::MaxTokens)) {
            // Text held back as a possible stop-sequence start is final now.
            emit.push_str(&st.stop.flush());
        }
        out.events.push((id, SeqEvent::Delta { tokens: vec![tok], text: emit }));
        if let Some(r) = reason {
            self.finish(id, r, out);
        }
        Ok(())
    }

    fn finish(&mut self, id: SeqId, reason: StopReason, out: &mut StepOutput) {
        self.states.remove(&id);
        if let Some(s) = self.sched.remove(id) {
            out.events.push((id, SeqEvent::Finished { reason, usage: usage_of(&s) }));
        }
    }

    /// Takes the KV events (block stored / evicted) since the last call.
    pub fn drain_kv_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.kv_events)
    }

    /// A snapshot of this engine's signals.
    pub fn signals(&mut self) -> WorkerSignals {
        let now = Instant::now();
        self.rate_window.push_back((now, self.generated_total));
        while self.rate_window.len() > 2 && now.duration_since(self.rate_window[0].0).as_secs_f32() > 2.0 {
            self.rate_window.pop_front();
        }
        let (t0, g0) = self.rate_window[0];
        let dt = now.duration_since(t0).as_secs_f32();
        let tps = if dt > 0.05 { (self.generated_total - g0) as f32 / dt } else { 0.0 };
        let (hits, queries) = self.hit_window.iter().fold((0u64, 0u64), |a, b| (a.0 + b.0, a.1 + b.1));
        let kv = self.sched.kv_blocks();
        let st = &self.sched.stats;
        WorkerSignals {
            kv_blocks_total: kv.total as u32,
            kv_blocks_free: kv.free as u32,
            kv_blocks_cached: kv.cached_evictable as u32,
            kv_fragmentation_ratio: self.sched.fragmentation(),
            block_size: kv.block_size as u32,
            // The device picture: weights plus the KV blocks sequences hold, against weights
            // plus the whole (preallocated) KV pool.
            memory_used_bytes: (self.model.weight_bytes() + self.cache.bytes() / kv.total.max(1) * (kv.total - kv.free)) as u64,
            memory_limit_bytes: (self.model.weight_bytes() + self.cache.bytes()) as u64,
            running: self.sched.num_running() as u32,
            waiting: self.sched.num_waiting() as u32,
            waiting_prefill_tokens: self.sched.waiting_prefill_tokens(),
            active_decode_blocks: self.sched.active_decode_blocks() as u32,
            prefix_hit_ratio: if queries > 0 { hits as f32 / queries as f32 } else { 0.0 },
            prefix_cache_hits_total: st.prefix_cache_hits_total,
            prefix_cache_queries_total: st.prefix_cache_queries_total,
            preemptions_total: st.preemptions_total,
            generated_tokens_total: self.generated_total,
            tokens_per_second: tps,
            at_ms: now.duration_since(self.started_at).as_millis() as u64,
        }
    }

    /// Every prefix hash currently cached (for a full resync of a cluster index).
    pub fn cached_hashes(&self) -> Vec<u64> {
        self.sched.cached_hashes()
    }
}

fn usage_of(s: &crate::scheduler::Sequence) -> Usage {
    Usage {
        prompt_tokens_uncached: (s.prompt_len - s.cached_prompt_tokens) as u32,
        prompt_tokens_cached: s.cached_prompt_tokens as u32,
        output_tokens: s.generated() as u32,
    }
}
