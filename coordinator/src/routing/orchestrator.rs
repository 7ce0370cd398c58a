//! Draining a node: the node's coordinator actor (ractor), which owns the cluster-level
//! orchestration of this node: drain, undrain and the moves they make, and the prefix
//! fetches placement asks of this node's workers ([`super::fetching`]).
//!
//! A drain:
//! 1. marks the node `draining`: `/ready` turns 503, the node gossips it, and placement (here
//!    at once, elsewhere within a gossip round) stops choosing its workers; a request that
//!    still arrives here is placed on other nodes;
//! 2. moves every sequence off its workers, running or waiting, prefilling or decoding. First
//!    the pre-copy: while the sequences keep running, the KV of their computed full blocks
//!    (immutable once full) travels to the target placement picks for each
//!    (`WorkerHandle::pre_copy`). Then the worker exports all of its sequences at one step
//!    boundary (`WorkerHandle::export`), and
//!    [`MOVES_AT_ONCE`] of them travel at a time, each to its pre-copy's target (or the one
//!    placement picks now): only the blocks the target does not cache yet (those computed since
//!    the pre-copy) travel to its prefix cache (in process for a worker of this
//!    node, over QUIC for another node, `cluster::migrate`); then the sequence's stream here
//!    ends with `Moved`, and the coordinator holding its client continues it there by exact
//!    replay, computing only the last partial block. A transfer that fails ends it with
//!    `Lost` instead: the continuation recomputes;
//! 3. keeps checking until the workers hold no sequence (and stays draining until `undrain`);
//! 4. then warms the cluster up: each worker's hottest cached chains go to the workers
//!    placement would choose for them (`warm_up`), so that the prefixes hit here keep hitting
//!    once this node stops. Until it stops, the node also serves fetches of its cached blocks.
//!
//! With no other ready worker in the cluster nothing moves: the sequences finish here (a single
//! node's SIGTERM drain, as before clusters).
//!
//! The request path never waits on this actor's mailbox: placement reads the published view.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use serde::Serialize;
use zerolayer_common::StopReason;
use futures::StreamExt;
use zerolayer_worker::actor::Handover;
use zerolayer_worker::migrate::Export;
use zerolayer_worker::scheduler::SeqId;

use crate::cluster::{migrate, Cluster, LocalWorker};
use crate::routing::dispatch::{Dispatcher, Target};
use crate::routing::fetching;
use zerolayer_common::wire::FetchFrom;
use zerolayer_common::{block_hashes_from, Job};
use zerolayer_worker::actor::CachedAsk;
use crate::view::NodeState;

/// How often a drain looks for sequences still on its workers.
const RECHECK: Duration = Duration::from_millis(100);
/// Transfers a drain runs at once.
const MOVES_AT_ONCE: usize = 4;

/// What a drain did, so far.
#[derive(Clone, Debug, Default, Serialize)]
pub struct DrainReport {
    pub node: String,
    pub draining: bool,
    /// Sequences on this node's workers now.
    pub sequences: usize,
    /// Sequences moved with their KV (the target caches some of their blocks).
    pub moved_with_kv: u64,
    /// Sequences moved without KV (waiting ones, or a failed transfer): recomputed there.
    pub moved_without_kv: u64,
    pub kv_bytes_sent: u64,
    pub kv_blocks_moved: u64,
    /// Milliseconds spent moving sequences (transfer and import, after the export).
    pub move_ms: u64,
    /// Milliseconds from the drain's start until its workers first held no sequence.
    pub emptied_after_ms: Option<u64>,
    /// The warm-up (after the moves): cached chains copied to other workers, the blocks of them
    /// those workers now cache, the bytes sent (also in `kv_bytes_sent`), and how long it took.
    /// The warm-up has ended (or had nothing to do): the node can stop without losing its
    /// cache's hottest prefixes.
    pub warmed: bool,
    pub warmed_chains: u64,
    pub warmed_blocks: u64,
    pub warm_bytes: u64,
    pub warm_ms: u64,
    /// The last moves (at most [`RECENT_MOVES`]), for benchmarks and operators.
    pub recent: Vec<MoveRecord>,
}

/// Moves kept in a report.
pub const RECENT_MOVES: usize = 256;

/// One sequence's move.
#[derive(Clone, Debug, Default, Serialize)]
pub struct MoveRecord {
    /// Tokens of the sequence (prompt and output so far).
    pub tokens: usize,
    /// Tokens whose KV the target now caches.
    pub kv_tokens: u32,
    pub bytes_sent: u64,
    /// Copied ahead of the export while the sequence kept running (its full blocks then), and
    /// how long that took (milliseconds); the stream does not pause for it.
    pub precopy_bytes: u64,
    pub precopy_ms: f64,
    /// Waiting for the worker's current step to end before the export (milliseconds): a step
    /// is never interrupted, so a long prefill chunk holds the move back.
    pub wait_ms: f64,
    /// Choosing the target, transferring the blocks and importing them (milliseconds).
    pub ms: f64,
    pub to: String,
}

pub enum OrchestratorMsg {
    Drain(RpcReplyPort<DrainReport>),
    Undrain(RpcReplyPort<DrainReport>),
    Report(RpcReplyPort<DrainReport>),
    /// Pull a job's prefix blocks from the worker that holds them into local worker `into`,
    /// before the job runs there; answered when the fetch has ended, either way.
    Fetch { into: String, job: Box<Job>, from: FetchFrom, done: RpcReplyPort<()> },
}

/// What a drain works with.
#[derive(Clone)]
pub struct OrchestratorContext {
    pub node_id: String,
    pub cluster: Arc<Cluster>,
    pub dispatch: Arc<Dispatcher>,
    pub workers: Vec<LocalWorker>,
}

pub struct Orchestrator;

pub struct OrchestratorState {
    ctx: OrchestratorContext,
    report: Arc<Mutex<DrainReport>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl OrchestratorState {
    async fn report(&self) -> DrainReport {
        let mut r = self.report.lock().unwrap_or_else(|e| e.into_inner()).clone();
        r.draining = self.ctx.cluster.state() == NodeState::Draining;
        r.sequences = sequences_here(&self.ctx.workers).await;
        r
    }
}

impl Actor for Orchestrator {
    type Msg = OrchestratorMsg;
    type State = OrchestratorState;
    type Arguments = OrchestratorContext;

    async fn pre_start(&self, _me: ActorRef<Self::Msg>, ctx: OrchestratorContext) -> Result<Self::State, ActorProcessingErr> {
        let report = Arc::new(Mutex::new(DrainReport { node: ctx.node_id.clone(), ..Default::default() }));
        Ok(OrchestratorState { ctx, report, task: None })
    }

    async fn handle(&self, _me: ActorRef<Self::Msg>, msg: Self::Msg, state: &mut Self::State) -> Result<(), ActorProcessingErr> {
        match msg {
            OrchestratorMsg::Drain(reply) => {
                if state.task.as_ref().is_none_or(|t| t.is_finished()) {
                    state.ctx.cluster.set_state(NodeState::Draining);
                    *state.report.lock().unwrap_or_else(|e| e.into_inner()) = DrainReport { node: state.ctx.node_id.clone(), ..Default::default() };
                    tracing::info!(node = %state.ctx.node_id, "draining: moving every sequence off this node's workers");
                    state.task = Some(tokio::spawn(drain(state.ctx.clone(), state.report.clone())));
                }
                let _ = reply.send(state.report().await);
            }
            OrchestratorMsg::Undrain(reply) => {
                if let Some(t) = state.task.take() {
                    t.abort();
                }
                state.ctx.cluster.moving.store(0, std::sync::atomic::Ordering::Release);
                if state.ctx.cluster.state() == NodeState::Draining {
                    state.ctx.cluster.set_state(NodeState::Ready);
                    tracing::info!(node = %state.ctx.node_id, "undrained: taking work again");
                }
                let _ = reply.send(state.report().await);
            }
            OrchestratorMsg::Report(reply) => {
                let _ = reply.send(state.report().await);
            }
            OrchestratorMsg::Fetch { into, job, from, done } => {
                // Off the mailbox: a fetch never holds up a drain or another fetch.
                let (cluster, dispatch) = (state.ctx.cluster.clone(), state.ctx.dispatch.clone());
                tokio::spawn(async move {
                    fetching::run(&cluster, &dispatch.fetch_cost, &into, &job, from).await;
                    let _ = done.send(());
                });
            }
        }
        Ok(())
    }

    async fn post_stop(&self, _me: ActorRef<Self::Msg>, state: &mut Self::State) -> Result<(), ActorProcessingErr> {
        if let Some(t) = state.task.take() {
            t.abort();
        }
        Ok(())
    }
}

async fn sequences_here(workers: &[LocalWorker]) -> usize {
    let mut n = 0;
    for w in workers {
        n += w.handle.sequences().await.map(|s| s.len()).unwrap_or(0);
    }
    n
}

/// The drain's loop: move what is here, until undrained (the actor aborts it).
async fn drain(ctx: OrchestratorContext, report: Arc<Mutex<DrainReport>>) {
    let t0 = Instant::now();
    loop {
        if ctx.cluster.state() != NodeState::Draining {
            return;
        }
        let mut left = 0;
        for w in &ctx.workers {
            let ids = w.handle.sequences().await.unwrap_or_default();
            left += ids.len();
            if ids.is_empty() || ctx.dispatch.target(&w.model, &[0], 0, 1, &[ctx.node_id.clone()]).is_none() {
                continue; // nothing here, or nowhere to go: they finish here
            }
            // Their full blocks ahead, while they run; then all at one step boundary, and (a few
            // at a time) to their targets.
            let precopied = precopy(&ctx, w, ids.clone()).await;
            let asked = Instant::now();
            let Ok(handovers) = w.handle.export(ids).await else { continue };
            let wait_ms = asked.elapsed().as_secs_f64() * 1e3;
            let precopied = &precopied;
            futures::stream::iter(handovers.into_iter().map(|h| {
                let pre = precopied.get(&h.id);
                move_one(&ctx, w, h, &report, wait_ms, pre)
            }))
                .buffer_unordered(MOVES_AT_ONCE)
                .collect::<Vec<()>>()
                .await;
        }
        ctx.cluster.moving.store(left as u32, std::sync::atomic::Ordering::Release);
        if left == 0 {
            let first = {
                let mut r = report.lock().unwrap_or_else(|e| e.into_inner());
                let first = r.emptied_after_ms.is_none();
                if first {
                    r.emptied_after_ms = Some(t0.elapsed().as_millis() as u64);
                    tracing::info!(node = %ctx.node_id, moved_with_kv = r.moved_with_kv, moved_without_kv = r.moved_without_kv, kv_bytes = r.kv_bytes_sent, "drained: no sequence left on this node's workers");
                }
                first
            };
            if first {
                warm_up(&ctx, &report).await;
            }
        }
        tokio::time::sleep(RECHECK).await;
    }
}

/// The warm-up, once the workers hold no sequence: each worker's hottest cached chains
/// (`cluster.drain_warm_chains` of them; its
/// cached prefixes, not only the running sequences' blocks) go to the worker placement would
/// choose for each, [`MOVES_AT_ONCE`] at a time, so the requests that would have hit them here
/// hit there once this node stops. A chain the target caches whole is skipped, and no block it
/// caches is sent.
async fn warm_up(ctx: &OrchestratorContext, report: &Mutex<DrainReport>) {
    let max = ctx.dispatch.drain_warm_chains() as usize;
    if max == 0 {
        report.lock().unwrap_or_else(|e| e.into_inner()).warmed = true;
        return;
    }
    let t0 = Instant::now();
    for w in &ctx.workers {
        let Ok(chains) = w.handle.hot_chains(max).await else { continue };
        let bs = w.handle.kv_geometry().block_size;
        let copies = futures::stream::iter(chains.into_iter().enumerate().map(|(i, (root, tokens))| async move {
            let target = ctx.dispatch.target(&w.model, &tokens, root, 1, std::slice::from_ref(&ctx.node_id))?;
            if block_hashes_from(root, &tokens, bs).iter().all(|h| target.cached.contains(h)) {
                return None;
            }
            let chain = w.handle.read_cached(CachedAsk { cache_root: root, tokens, from_block: 0 }).await.ok()?;
            let ex = Export { prompt: chain.tokens, generated: Vec::new(), seed: 0, cache_root: root, block_hashes: chain.block_hashes, kv: chain.kv, block_bytes: chain.block_bytes, block_size: chain.block_size };
            let request_id = format!("warm-{}-{}-{i}", ctx.node_id, w.id);
            transfer(ctx, &target, &ex, &HashSet::new(), &request_id).await.inspect_err(|e| tracing::debug!(%request_id, error = %e, "a warm-up copy failed")).ok()
        }))
        .buffer_unordered(MOVES_AT_ONCE)
        .filter_map(std::future::ready)
        .collect::<Vec<_>>()
        .await;
        let mut r = report.lock().unwrap_or_else(|e| e.into_inner());
        for t in copies {
            r.warmed_chains += 1;
            r.warmed_blocks += t.blocks as u64;
            r.warm_bytes += t.bytes;
            r.kv_bytes_sent += t.bytes;
        }
    }
    let mut r = report.lock().unwrap_or_else(|e| e.into_inner());
    r.warm_ms = t0.elapsed().as_millis() as u64;
    r.warmed = true;
    tracing::info!(node = %ctx.node_id, chains = r.warmed_chains, blocks = r.warmed_blocks, bytes = r.warm_bytes, ms = r.warm_ms, "warm-up: this node's hottest cached prefixes copied to the workers that will serve them");
}

/// A sequence's blocks copied ahead of its export: where to, and what that worker caches now.
struct Precopy {
    target: Target,
    hashes: HashSet<u64>,
    bytes: u64,
    ms: f64,
}

/// The pre-copy: each sequence's computed full blocks, to the worker placement picks for it,
/// while it keeps running ([`MOVES_AT_ONCE`] at a time). A sequence whose copy fails is simply
/// moved whole.
async fn precopy(ctx: &OrchestratorContext, w: &LocalWorker, ids: Vec<SeqId>) -> HashMap<SeqId, Precopy> {
    let Ok(copies) = w.handle.pre_copy(ids).await else { return HashMap::new() };
    futures::stream::iter(copies.into_iter().filter(|(_, ex)| !ex.block_hashes.is_empty()).map(|(id, ex)| async move {
        let t0 = Instant::now();
        let tokens: Vec<u32> = ex.prompt.iter().chain(&ex.generated).copied().collect();
        let target = ctx.dispatch.target(&w.model, &tokens, ex.cache_root, ex.generated.len().max(1), std::slice::from_ref(&ctx.node_id))?;
        let request_id = format!("precopy-{}-{}-{id}", ctx.node_id, w.id);
        match transfer(ctx, &target, &ex, &HashSet::new(), &request_id).await {
            Ok(t) => {
                let hashes = ex.block_hashes[..t.blocks as usize].iter().copied().collect();
                Some((id, Precopy { target, hashes, bytes: t.bytes, ms: t0.elapsed().as_secs_f64() * 1e3 }))
            }
            Err(e) => {
                tracing::debug!(%request_id, error = %e, "pre-copy failed; the move sends every block");
                None
            }
        }
    }))
    .buffer_unordered(MOVES_AT_ONCE)
    .filter_map(std::future::ready)
    .collect()
    .await
}

/// Puts `ex`'s blocks into `target`'s prefix cache: in process for a worker of this node, over
/// QUIC for another's, sending none of the blocks the target caches already (its published set,
/// and `known`).
async fn transfer(ctx: &OrchestratorContext, target: &Target, ex: &Export, known: &HashSet<u64>, request_id: &str) -> anyhow::Result<migrate::Transferred> {
    if target.local {
        let Some(tw) = ctx.cluster.local_worker(&target.worker) else { anyhow::bail!("local worker {} vanished", target.worker) };
        let imp = ex.to_import(|h| known.contains(&h));
        let r = tw.handle.import(imp).await.map_err(|e| anyhow::anyhow!("{e}"))?;
        return Ok(migrate::Transferred { blocks: r.usable() as u32, bytes: 0 });
    }
    let addr = ctx.cluster.peer_addr(&target.node).ok_or_else(|| anyhow::anyhow!("node {} is unreachable", target.node))?;
    let cached: HashSet<u64> = if known.is_empty() { (*target.cached).clone() } else { target.cached.union(known).copied().collect() };
    let header = migrate::header(request_id, &ctx.node_id, &target.worker, ex, &cached);
    migrate::send(&ctx.cluster, &target.node, addr, header, ex).await
}

/// Moves one exported sequence to its pre-copy's target, or the worker placement picks
/// (`wait_ms`: how long its export waited for the worker's step).
async fn move_one(ctx: &OrchestratorContext, w: &LocalWorker, handover: Handover, report: &Mutex<DrainReport>, wait_ms: f64, pre: Option<&Precopy>) {
    let t0 = Instant::now();
    let exclude = [ctx.node_id.clone()];
    let ex = &handover.export;
    let tokens: Vec<u32> = ex.prompt.iter().chain(&ex.generated).copied().collect();
    let remaining = ex.generated.len().max(1);
    let target = match pre {
        Some(p) => Some(p.target.clone()),
        None => ctx.dispatch.target(&w.model, &tokens, ex.cache_root, remaining, &exclude),
    };
    let Some(target) = target else {
        handover.finish(StopReason::Lost(format!("node {} drains and no worker could take the sequence", ctx.node_id))).await;
        return;
    };
    let request_id = format!("drain-{}-{}-{}", ctx.node_id, w.id, handover.id);
    let empty = HashSet::new();
    let moved = transfer(ctx, &target, ex, pre.map_or(&empty, |p| &p.hashes), &request_id).await;
    let (blocks, bs) = (ex.block_hashes.len(), ex.block_size);
    let reason = match &moved {
        Ok(t) => StopReason::Moved { node: target.node.clone(), worker: target.worker.clone(), kv_tokens: t.blocks * bs as u32 },
        Err(e) => {
            tracing::warn!(%request_id, to = %format!("{}/{}", target.node, target.worker), error = %e, "KV transfer failed; the sequence continues there by recompute");
            StopReason::Moved { node: target.node.clone(), worker: target.worker.clone(), kv_tokens: 0 }
        }
    };
    tracing::debug!(%request_id, to = %format!("{}/{}", target.node, target.worker), blocks, ?moved, "moved a sequence");
    let kv_tokens = match &reason {
        StopReason::Moved { kv_tokens, .. } => *kv_tokens,
        _ => 0,
    };
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    handover.finish(reason).await;
    let mut r = report.lock().unwrap_or_else(|e| e.into_inner());
    if r.recent.len() >= RECENT_MOVES {
        r.recent.remove(0);
    }
    let bytes_sent = moved.as_ref().map(|t| t.bytes).unwrap_or(0);
    let (precopy_bytes, precopy_ms) = pre.map_or((0, 0.0), |p| (p.bytes, p.ms));
    r.kv_bytes_sent += precopy_bytes;
    r.recent.push(MoveRecord { tokens: tokens.len(), kv_tokens, bytes_sent, precopy_bytes, precopy_ms, wait_ms, ms, to: format!("{}/{}", target.node, target.worker) });
    match moved {
        Ok(t) if t.blocks > 0 => {
            r.moved_with_kv += 1;
            r.kv_blocks_moved += t.blocks as u64;
            r.kv_bytes_sent += t.bytes;
        }
        _ => r.moved_without_kv += 1,
    }
    r.move_ms += t0.elapsed().as_millis() as u64;
    metrics::counter!("zerolayer_drain_moves_total", "node" => ctx.node_id.clone()).increment(1);
}
