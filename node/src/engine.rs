//! The engine: model + KV cache + scheduler + sampling + stopping, one `step()` at a time.
//! Sans-IO apart from the compute: the worker actor's thread calls `step()` in a loop and routes
//! the returned events; tests drive it directly.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use zerolayer_common::config::Speculative;
use zerolayer_common::{CachePin, Job, WorkerConfig, KvEvent, SeqEvent, StopReason, Usage, WorkerSignals};

use crate::error::{Result, WorkerError};
use crate::backend::{self, Backend};
use crate::model::{recycle, ForwardItem, Model, ModelConfig};
use crate::grammar::Constraint;
use crate::sampler::logprob::token_logprob;
use crate::sampler::{Pick, Picked};
use crate::scheduler::{Entry, Plan, Scheduler, SchedulerConfig, SeqId};
use crate::speculate::{Drafts, RecentOutputs};
use crate::step_time::{StallFree, StepShape, StepTimeModel};
use crate::tokenizer::Tokenizer;
use seq_state::SeqState;

mod prompt_logprobs;
mod seq_state;
mod speculation;
mod tiering;
mod transfer;

/// Output of one step: events per sequence, in order.
#[derive(Debug, Default)]
pub struct StepOutput {
    pub events: Vec<(SeqId, SeqEvent)>,
    /// Tokens computed in this step (prefill + decode).
    pub tokens_computed: usize,
}

pub struct Engine {
    /// The model, its KV cache and the device they run on.
    backend: Box<dyn Backend>,
    pub tokenizer: Arc<Tokenizer>,
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
    /// The learnt step time and the policy that sizes each step's prefill from it.
    step_time: StepTimeModel,
    stall_free: StallFree,
    /// Events decided outside a step (a resumed sequence that had already ended), sent with
    /// the next step's.
    pending: Vec<(SeqId, SeqEvent)>,
    /// Set once the backend is gone (a lost rank): no sequence is admitted any more.
    unavailable: Option<String>,
    /// Speculative decoding: the worker's choice and its longest draft.
    speculative: Speculative,
    max_draft: usize,
    /// Draft tokens verified, and kept, since the start.
    drafted_total: u64,
    accepted_total: u64,
    /// KV blocks imported into the prefix cache, and read out for other workers.
    pub(crate) imported_total: u64,
    pub(crate) served_total: u64,
    /// The worker's disk tier, if it has one (see `tiering`).
    disk: Option<Arc<crate::kv_disk::DiskTier>>,
    /// Finished sequences' outputs, by cache scope, for drafts.
    recent: RecentOutputs,
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
    /// Per logits row: what a device may do of its draw (a sequence with a grammar: nothing),
    /// and what it did.
    picks: Vec<Pick>,
    picked: Picked,
    items: Vec<ForwardItem<'static>>,
    drafts: Drafts,
    /// Per item: its rows of prompt logprobs.
    prompt_rows: Vec<usize>,
}

impl Engine {
    /// An engine running `model` on the CPU, with a KV cache of `cfg.kv_cache_mb` in
    /// `cfg.kv_dtype`. The engine reads its limits from the worker's own config: the
    /// scheduler's, the stall-free budget's and the pinned share.
    pub fn new(model: Model, tokenizer: Arc<Tokenizer>, cfg: &WorkerConfig) -> Result<Self> {
        Self::with_backend(Box::new(backend::Cpu::new(model, cfg.block_size, cfg.kv_dtype, cfg.kv_cache_mb << 20)?), tokenizer, cfg)
    }

    /// An engine over `backend`, whose KV cache has `cfg.block_size`-token blocks.
    pub fn with_backend(backend: Box<dyn Backend>, tokenizer: Arc<Tokenizer>, cfg: &WorkerConfig) -> Result<Self> {
        let kv = backend.kv();
        if kv.block_size != cfg.block_size {
            return Err(WorkerError::Invalid(format!("the backend's KV blocks hold {} tokens, the engine's {}", kv.block_size, cfg.block_size)));
        }
        if kv.dtype != cfg.kv_dtype {
            return Err(WorkerError::Invalid(format!("the backend's KV cache holds {}, the engine's config says {}", kv.dtype, cfg.kv_dtype)));
        }
        let mut sched = Scheduler::new(SchedulerConfig {
            block_size: cfg.block_size,
            num_blocks: kv.num_blocks,
            max_batch_tokens: cfg.max_batch_tokens,
            max_running: cfg.max_running,
            max_waiting: cfg.max_waiting,
            max_model_len: backend.config().context_length,
            reserve_output_tokens: cfg.reserve_output_tokens,
        });
        sched.set_max_pinned((kv.num_blocks as f64 * cfg.pinned_kv_share.clamp(0.0, 1.0)) as usize);
        Ok(Engine {
            backend,
            tokenizer,
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
            step_time: StepTimeModel::default(),
            stall_free: StallFree {
                stretch: cfg.step_stretch,
                min_step: cfg.min_step_ms / 1e3,
                min_chunk: cfg.min_prefill_chunk,
                max_batch_tokens: cfg.max_batch_tokens,
            },
            pending: Vec::new(),
            unavailable: None,
            speculative: cfg.speculative,
            max_draft: cfg.max_draft,
            drafted_total: 0,
            accepted_total: 0,
            imported_total: 0,
            served_total: 0,
            disk: None,
            recent: RecentOutputs::default(),
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
        self.backend.kv().num_blocks
    }

    /// The model's architecture.
    pub fn config(&self) -> &ModelConfig {
        self.backend.config()
    }

    /// What runs this engine's forward steps.
    pub fn backend(&self) -> &dyn Backend {
        &*self.backend
    }

    /// The longest sequence (prompt and output) this engine can hold: the model's context, or
    /// its whole KV cache if that is smaller.
    pub fn max_sequence_tokens(&self) -> usize {
        let kv = self.backend.kv();
        self.config().context_length.min(kv.num_blocks * kv.block_size)
    }

    /// Queues a job. Errors: too long for the model or the cache, a token outside the
    /// vocabulary, pins outside their limits, or the queue is full.
    ///
    /// A job with `resume` tokens continues a sequence that a worker that is gone had started:
    /// those are the tokens its client already has. They are replayed silently through the
    /// detokenizer, the stop matcher and the grammar, the sampler starts at step
    /// `resume.len()` (same seed), and the sequence is computed from `prompt + resume` (its
    /// cached prefix reused, so after a KV migration only the last partial block is
    /// recomputed): it continues with exactly the tokens the original would have produced. If
    /// `resume` already ends the sequence, it finishes at once. The job's `pins` keep its prompt
    /// prefixes cached for their TTLs (each pin, or a later request's, refreshes them) inside
    /// the pinned share of the KV; its `share` names the tenant for the scheduler's fair sharing.
    pub fn add(&mut self, id: SeqId, job: Job) -> Result<()> {
        let Job { prompt, params, share, pins, resume: generated, cache_root, .. } = job;
        if let Some(why) = &self.unavailable {
            return Err(WorkerError::Unavailable(why.clone()));
        }
        params.check().map_err(WorkerError::Invalid)?;
        if !CachePin::all_valid(&pins, prompt.len()) {
            return Err(WorkerError::Invalid(format!("cache pins {pins:?} are outside the limits")));
        }
        let vocab = self.backend.config().vocab_size;
        let biased = params.logit_bias.iter().map(|&(t, _)| t);
        if let Some(bad) = prompt.iter().chain(&generated).copied().chain(biased).find(|&t| t as usize >= vocab) {
            return Err(WorkerError::Invalid(format!("token id {bad} is outside the vocabulary")));
        }
        let mut st = SeqState::new(params, generated.len() as u64, self.max_draft);
        st.sampler.observe(&prompt, &generated);
        st.pins = pins;
        // A resumed sequence's prompt logprobs went out before its first token did.
        let wants_prompt = st.params.prompt_logprobs && st.params.logprobs.is_some() && generated.is_empty();
        st.prompt_next = if wants_prompt { 1 } else { prompt.len() };
        let mut ended = None;
        for k in 1..=generated.len() {
            if let (_, Some(reason)) = st.advance(&self.tokenizer, &generated[..k])? {
                ended = Some(reason);
                break;
            }
        }
        if ended.is_none() {
            if let Some(lark) = &st.params.grammar {
                st.constraint = Some(Constraint::new(self.tokenizer.grammars()?, lark, &generated)?);
            }
        }
        let prompt_len = prompt.len();
        let output = generated.len();
        let mut tokens = prompt;
        tokens.extend(generated);
        if let Some(reason) = ended {
            let usage = Usage { prompt_tokens_uncached: prompt_len as u32, prompt_tokens_cached: 0, output_tokens: output as u32 };
            self.pending.push((id, SeqEvent::Started { prompt_tokens: prompt_len as u32, cached_tokens: 0, since_admitted_us: 0 }));
            self.pending.push((id, SeqEvent::Finished { reason, usage }));
            return Ok(());
        }
        let prompt_logits = st.prompt_next < prompt_len;
        self.sched.add(id, Entry { tokens, prompt_len, max_tokens: st.params.max_tokens as usize, share, cache_root, prompt_logits })?;
        self.states.insert(id, st);
        Ok(())
    }

    /// Every sequence the engine holds, running then waiting.
    pub fn sequences(&self) -> Vec<SeqId> {
        self.sched.sequence_ids()
    }

    /// Cancels a sequence, freeing its blocks. Returns its final event if it existed.
    pub fn cancel(&mut self, id: SeqId) -> Option<SeqEvent> {
        self.states.remove(&id)?;
        let s = self.sched.remove(id)?;
        Some(SeqEvent::Finished { reason: StopReason::Cancelled, usage: usage_of(&s) })
    }

    pub fn has_work(&self) -> bool {
        !self.sched.is_idle() || !self.pending.is_empty()
    }

    /// Runs one step: schedule, forward, sample, detokenize, check stops. A failure (of the
    /// forward, or of one sequence's detokenization) ends only the sequences it touched, with
    /// an error event; the engine goes on.
    pub fn step(&mut self) -> Result<StepOutput> {
        let began = Instant::now();
        let mut bufs = std::mem::take(&mut self.bufs);
        let r = self.step_with(&mut bufs);
        self.bufs = bufs;
        let mut out = r?;
        // The prompts this step admitted leave with the step's time: computing, not waiting.
        let took = began.elapsed().as_micros().min(u32::MAX as u128) as u32;
        for (_, ev) in &mut out.events {
            if let SeqEvent::Started { since_admitted_us, .. } = ev {
                *since_admitted_us = took;
            }
        }
        Ok(out)
    }

    fn step_with(&mut self, bufs: &mut StepBufs) -> Result<StepOutput> {
        let prefill = self.stall_free.prefill_budget(&self.step_time, &self.sched.outlook());
        self.sched.schedule_into(&mut bufs.plan, prefill);
        // Blocks the schedule evicted still hold their KV until the forward below.
        self.spill_evicted();
        let plan = &bufs.plan;
        let mut out = StepOutput { events: std::mem::take(&mut self.pending), ..Default::default() };
        for &id in &plan.started {
            let s = self.sched.get(id).unwrap();
            out.events.push((id, SeqEvent::Started { prompt_tokens: s.prompt_len as u32, cached_tokens: s.cached_prompt_tokens as u32, since_admitted_us: 0 }));
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
        let t0 = Instant::now();
        // Sequences with max_tokens == 0 only prefill; they need no logits.
        let want = &mut bufs.want;
        want.clear();
        want.extend(plan.items.iter().map(|it| {
            let s = self.sched.get(it.seq).unwrap();
            it.completes && s.generated() < s.max_tokens
        }));
        let want = &*want;
        let drafts = &mut bufs.drafts;
        self.draft(plan, want, drafts);
        let drafts = &*drafts;
        let mut shape = StepShape::default();
        for (i, it) in plan.items.iter().enumerate() {
            shape.add(it.start, it.len + drafts.len[i]);
        }
        self.plan_rows(plan, want, drafts, &mut bufs.prompt_rows, &mut bufs.picks);
        let prompt_rows = &*bufs.prompt_rows;
        let vocab = self.backend.config().vocab_size;
        let rows = {
            let mut items: Vec<ForwardItem<'_>> = recycle(std::mem::take(&mut bufs.items));
            items.extend(plan.items.iter().enumerate().map(|(i, it)| {
                let s = self.sched.get(it.seq).unwrap();
                let tokens = if drafts.len[i] > 0 { drafts.chunk(i) } else { &s.tokens[it.start..it.start + it.len] };
                ForwardItem { tokens, start_pos: it.start, block_table: &s.blocks, logits: prompt_rows[i] + if want[i] { 1 + drafts.len[i] } else { 0 } }
            }));
            let rows = self.backend.forward_pick(&items, &bufs.picks, &mut self.logits, &mut bufs.picked);
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
        out.tokens_computed = plan.items.iter().map(|it| it.len).sum::<usize>() + drafts.total();
        self.sched.on_computed(plan);
        self.pin_computed(plan);
        let (ev, overflowed) = self.sched.drain_kv_events();
        if overflowed {
            self.kv_events.clear();
        }
        self.kv_events.extend(ev);

        let mut row = 0;
        for (i, (it, &w)) in plan.items.iter().zip(want).enumerate() {
            if prompt_rows[i] > 0 {
                let rows = &logits_buf[row * vocab..(row + prompt_rows[i]) * vocab];
                self.report_prompt(it.seq, it.start, rows, &mut out);
                row += prompt_rows[i];
            }
            if !it.completes {
                continue;
            }
            if !w {
                // max_tokens == 0: the prompt is now cached; nothing to generate.
                self.finish(it.seq, StopReason::MaxTokens, &mut out);
                continue;
            }
            let n = 1 + drafts.len[i];
            assert!(row + n <= rows, "a logits row per wanted position");
            // A token the device picked (greedy), or candidates it selected (top-k), else the
            // host samples the row's logits; a draft's rows one after another, while they agree.
            let (picks, picked) = (&bufs.picks, &bufs.picked);
            let r = self.verify(it.seq, drafts.of(i), &mut out, |e, j, out| {
                let r = row + j;
                // The row is on the host only where no device drew from it (a device that draws
                // every row leaves `logits_buf` empty).
                let (tok, row) = match (picks[r], picked.token(r), picked.candidates(r)) {
                    (Pick::Greedy, Some(tok), _) => (e.on_picked(it.seq, tok), None),
                    (Pick::TopK { .. }, _, Some(candidates)) => (e.on_candidates(it.seq, candidates), None),
                    _ => {
                        let row = &logits_buf[r * vocab..(r + 1) * vocab];
                        (e.on_token(it.seq, row)?, Some(row))
                    }
                };
                Ok((tok, e.accept(it.seq, tok, row, out)?))
            });
            if let Err(e) = r {
                self.fail(&[it.seq], &e, &mut out);
            }
            row += n;
        }
        self.logits = logits_buf;
        let took = t0.elapsed().as_secs_f64();
        tracing::debug!(target: "zerolayer_worker::step_time", tokens = shape.tokens, attended = shape.attended, prefill_budget = prefill,
            decodes = plan.items.iter().filter(|it| it.len == 1).count(), predicted_ms = self.step_time.predict(&shape) * 1e3,
            took_ms = took * 1e3, warm = self.step_time.is_warm(), coefficients = ?self.step_time.coefficients(), "step");
        self.step_time.observe(shape, took);
        Ok(out)
    }

    /// The step's logits rows, item by item: its prompt-logprob rows first (into
    /// `prompt_rows`), then a row per position to draw at (a drafted decode has one per
    /// position of its chunk); `picks` says what a device may do of each row's draw.
    fn plan_rows(&self, plan: &Plan, want: &[bool], drafts: &Drafts, prompt_rows: &mut Vec<usize>, picks: &mut Vec<Pick>) {
        prompt_rows.clear();
        prompt_rows.extend(plan.items.iter().zip(want).map(|(it, &w)| self.prompt_rows(it, w)));
        picks.clear();
        let vocab = self.backend.config().vocab_size;
        for (i, it) in plan.items.iter().enumerate() {
            picks.extend(std::iter::repeat_n(Pick::Host, prompt_rows[i]));
            if !want[i] {
                continue;
            }
            let st = self.states.get(&it.seq);
            // A grammar, or logprobs to report, needs the whole row on the host.
            let pick = st.filter(|st| st.constraint.is_none() && st.params.logprobs.is_none()).map_or(Pick::Host, |st| st.sampler.pick(vocab));
            picks.extend(std::iter::repeat_n(pick, 1 + drafts.len[i]));
        }
    }

    /// Pins the prefixes the step's sequences asked for, once computed, and ends expired pins.
    fn pin_computed(&mut self, plan: &Plan) {
        let now = self.started_at.elapsed().as_millis() as u64;
        self.sched.expire_pins(now);
        for it in &plan.items {
            let Some(st) = self.states.get_mut(&it.seq) else { continue };
            let sched = &mut self.sched;
            st.pins.retain(|p| sched.pin_prefix(it.seq, p.tokens as usize, now + u64::from(p.ttl_secs) * 1000).is_none());
        }
    }

    /// The learnt step time (for signals, logs and benchmarks).
    pub fn step_time(&self) -> &StepTimeModel {
        &self.step_time
    }

    /// Ends `ids` with an error (their step failed); every other sequence goes on.
    fn fail(&mut self, ids: &[SeqId], e: &WorkerError, out: &mut StepOutput) {
        if let WorkerError::Unavailable(why) = e {
            // Nothing more runs here: every sequence, in this step or not, is handed back.
            tracing::error!(error = %e, sequences = self.states.len(), "the backend is gone; every sequence ends Lost, to be continued elsewhere");
            self.unavailable = Some(why.clone());
            let all: Vec<SeqId> = self.states.keys().copied().collect();
            for id in all {
                self.finish(id, StopReason::Lost(format!("worker unavailable: {why}")), out);
            }
            return;
        }
        tracing::error!(error = %e, sequences = ids.len(), "engine step failed; failing its sequences");
        for &id in ids {
            self.finish(id, StopReason::Error(e.to_string()), out);
        }
    }

    /// Why this engine can run no more steps, once its backend is gone (see
    /// [`WorkerError::Unavailable`]).
    pub fn unavailable(&self) -> Option<&str> {
        self.unavailable.as_deref()
    }

    /// The host's draw from a logits row (through the grammar, if the sequence has one, which
    /// then takes the token); [`Engine::accept`] then appends it.
    fn on_token(&mut self, id: SeqId, logits: &[f32]) -> Result<u32> {
        let st = self.states.get_mut(&id).expect("state for scheduled sequence");
        let tok = match &mut st.constraint {
            None => st.sampler.sample(logits, None),
            Some(c) => {
                let tok = st.sampler.sample(logits, Some(c.allowed()?));
                c.commit(tok)?;
                tok
            }
        };
        Ok(tok)
    }

    /// The token a device picked for a greedy sequence with no grammar (the argmax the sampler
    /// would have taken).
    fn on_picked(&mut self, id: SeqId, tok: u32) -> u32 {
        let st = self.states.get_mut(&id).expect("state for scheduled sequence");
        st.sampler.take_greedy(tok)
    }

    /// The top-k candidates a device selected for a sequence with no grammar: the host draws
    /// among them, as it would have from the whole row.
    fn on_candidates(&mut self, id: SeqId, candidates: &[(u32, f32)]) -> u32 {
        let st = self.states.get_mut(&id).expect("state for scheduled sequence");
        st.sampler.sample_top_k(candidates)
    }

    /// Appends `tok` to sequence `id`: its text, stop conditions and events (with its logprobs,
    /// from the logits `row` it was drawn from, when the request asked for them: a sequence
    /// that did always has its row on the host). Returns whether the sequence ended with it.
    fn accept(&mut self, id: SeqId, tok: u32, row: Option<&[f32]>, out: &mut StepOutput) -> Result<bool> {
        let st = self.states.get_mut(&id).expect("state for scheduled sequence");
        self.sched.append_token(id, tok);
        self.generated_total += 1;
        let s = self.sched.get(id).expect("scheduled sequence");
        let (emit, reason) = st.advance(&self.tokenizer, &s.tokens[s.prompt_len..])?;
        let logprobs = match (st.params.logprobs, row) {
            (Some(top), Some(row)) => vec![token_logprob(row, tok, top as usize)],
            _ => Vec::new(),
        };
        out.events.push((id, SeqEvent::Delta { tokens: vec![tok], text: emit, logprobs }));
        let ended = reason.is_some();
        if let Some(r) = reason {
            self.finish(id, r, out);
        }
        Ok(ended)
    }

    fn finish(&mut self, id: SeqId, reason: StopReason, out: &mut StepOutput) {
        self.states.remove(&id);
        if let Some(s) = self.sched.remove(id) {
            self.recent.push(s.cache_root, &s.tokens[s.prompt_len..]);
            out.events.push((id, SeqEvent::Finished { reason, usage: usage_of(&s) }));
        }
    }

    /// Takes the KV events (block stored / evicted) since the last call.
    pub fn drain_kv_events(&mut self) -> Vec<KvEvent> {
        let mut events = std::mem::take(&mut self.kv_events);
        self.note_stored(&events);
        events.extend(self.disk.iter().flat_map(|d| d.take_events()));
        events
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
        let device = self.backend.device_memory();
        WorkerSignals {
            kv_blocks_total: kv.total as u32,
            kv_blocks_free: kv.free as u32,
            kv_blocks_cached: kv.cached_evictable as u32,
            kv_blocks_pinned: self.sched.num_pinned() as u32,
            kv_fragmentation_ratio: self.sched.fragmentation(),
            block_size: kv.block_size as u32,
            // The device picture: a GPU's own memory (used, total), or on the CPU the weights
            // plus the KV blocks sequences hold, against weights plus the whole (preallocated)
            // KV pool.
            memory_used_bytes: device.map_or((self.backend.weight_bytes() + self.backend.kv().bytes / kv.total.max(1) * (kv.total - kv.free)) as u64, |d| d.0),
            unavailable: self.unavailable.is_some(),
            memory_limit_bytes: device.map_or((self.backend.weight_bytes() + self.backend.kv().bytes) as u64, |d| d.1),
            running: self.sched.num_running() as u32,
            waiting: self.sched.num_waiting() as u32,
            waiting_prefill_tokens: self.sched.waiting_prefill_tokens(),
            active_decode_blocks: self.sched.active_decode_blocks() as u32,
            prefix_hit_ratio: if queries > 0 { hits as f32 / queries as f32 } else { 0.0 },
            prefix_cache_hits_total: st.prefix_cache_hits_total,
            prefix_cache_queries_total: st.prefix_cache_queries_total,
            preemptions_total: st.preemptions_total,
            repreemptions_total: st.repreemptions_total,
            generated_tokens_total: self.generated_total,
            draft_tokens_total: self.drafted_total,
            draft_accepted_total: self.accepted_total,
            kv_blocks_imported_total: self.imported_total,
            kv_blocks_served_total: self.served_total,
            kv_disk: self.disk_signals(),
            tokens_per_second: tps,
            // The step-time fit's terms per token and per 1,000 attended pairs, once it has seen
            // enough steps.
            prefill_us_per_token: if self.step_time.is_warm() { (self.step_time.coefficients().1 * 1e3).max(0.0) as f32 } else { 0.0 },
            prefill_us_per_kilo_pair: if self.step_time.is_warm() { (self.step_time.coefficients().2 * 1e3).max(0.0) as f32 } else { 0.0 },
            at_ms: now.duration_since(self.started_at).as_millis() as u64,
        }
    }

    /// Every prefix hash currently cached (for a full resync of a cluster index).
    pub fn cached_hashes(&self) -> Vec<u64> {
        let mut all = self.sched.cached_hashes();
        all.extend(self.disk.iter().flat_map(|d| d.disk_names()));
        all
    }
}

fn usage_of(s: &crate::scheduler::Sequence) -> Usage {
    Usage {
        prompt_tokens_uncached: (s.prompt_len - s.cached_prompt_tokens) as u32,
        prompt_tokens_cached: s.cached_prompt_tokens as u32,
        output_tokens: s.generated() as u32,
    }
}
