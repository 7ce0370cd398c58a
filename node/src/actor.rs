//! The worker actor: one per device. It owns the model, the KV cache and the scheduler (through
//! [`Engine`]), and runs the engine loop on a dedicated OS thread, off the async runtime.
//!
//! Shape: [`WorkerHandle`] (cheap `Clone`) → the ractor actor, which receives every command
//! ([`WorkerMsg`]: submit, cancel, cached hashes, shutdown) and owns the engine thread → a
//! bounded command channel → the engine thread, which steps the engine and streams
//! [`SeqEvent`]s back on each request's bounded reply channel.
//!
//! - Submit carries token ids, sampling params and the reply stream; the engine validates and
//!   acknowledges. A full command channel or waiting queue is refused at once (`QueueFull`).
//!   A sequence still open when the worker stops ends `Lost`: its coordinator continues it
//!   elsewhere.
//! - Cancel frees the sequence's blocks. Dropping a [`SeqStream`] cancels too, and so does a
//!   reply channel found closed by the engine.
//! - A client that reads slowly never blocks the engine: events that do not fit its channel
//!   are merged into one pending delta (bounded by `max_tokens`) and delivered later.
//! - Signals ([`WorkerSignals`]) are published on a watch channel at least every 100 ms, and
//!   KV events on a bounded broadcast channel (a lagging reader resyncs from a snapshot).
//!
//! The actor mailbox (ractor's) is unbounded by construction; it carries submit and cancel
//! messages, whose number the node's in-flight limit bounds, and rare control messages, and it
//! forwards each with `try_send` into the bounded engine channel (a full one refuses at once).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::sync::{broadcast, mpsc, oneshot, watch};
use zerolayer_common::{Job, KvEvent, SeqEvent, StopReason, Usage, WorkerSignals};

use crate::backend::KvGeometry;
use crate::engine::{Engine, StepHook};
use crate::migrate::{CachedChain, Export, ImportReport, KvImport};
use crate::error::{WorkerError, Result};
use crate::scheduler::SeqId;

/// Capacity of each request's reply channel.
pub const REPLY_CAPACITY: usize = 64;
/// Capacity of the command channel into the engine thread.
pub const COMMAND_CAPACITY: usize = 1024;
/// Capacity of the KV event broadcast.
pub const KV_EVENT_CAPACITY: usize = 4096;
/// Signals are published at least this often.
pub const SIGNAL_INTERVAL: Duration = Duration::from_millis(100);

/// A [`Job`] on its way into the engine thread: the same value in the actor's mailbox and in
/// the engine's command channel (the actor moves it on, it never rebuilds it).
pub struct Submission {
    id: SeqId,
    job: Job,
    reply: mpsc::Sender<SeqEvent>,
    ack: oneshot::Sender<Result<()>>,
}

/// A sequence taken off this worker by [`WorkerHandle::export`]: what it carries, and its
/// client's event channel, which the new owner's events will follow.
pub struct Handover {
    /// The sequence's id on the worker it left.
    pub id: SeqId,
    pub export: Export,
    route: Option<Route>,
}

impl Handover {
    /// Ends the sequence's stream here with `reason` (`Moved` once its KV is on the target,
    /// `Lost` if the move failed and it must be replayed), after any events still held back.
    pub async fn finish(mut self, reason: StopReason) {
        let Some(r) = self.route.take() else { return };
        let output_tokens = self.export.generated.len() as u32;
        let fin = SeqEvent::Finished { reason, usage: Usage { output_tokens, ..Default::default() } };
        for ev in r.pending.into_iter().chain(std::iter::once(fin)) {
            if r.tx.send(ev).await.is_err() {
                return; // the client is gone
            }
        }
    }
}

/// A chain of cached blocks another worker asks for: the blocks `tokens` (a whole number of
/// blocks) spell from `cache_root`, from block `from_block` on.
#[derive(Clone, Debug)]
pub struct CachedAsk {
    pub cache_root: u64,
    pub tokens: Vec<u32>,
    pub from_block: usize,
}

enum EngineCmd {
    Submit(Submission),
    Cancel { id: SeqId },
    /// A snapshot of every cached block hash (for a KV-event reader that lagged).
    CachedHashes { reply: oneshot::Sender<Vec<u64>> },
    SetStepHook { hook: Option<StepHook> },
    Sequences { reply: oneshot::Sender<Vec<SeqId>> },
    Export { ids: Vec<SeqId>, reply: oneshot::Sender<Vec<Handover>> },
    PreCopy { ids: Vec<SeqId>, reply: oneshot::Sender<Vec<(SeqId, Export)>> },
    Import { import: KvImport, reply: oneshot::Sender<Result<ImportReport>> },
    ReadCached { ask: CachedAsk, reply: oneshot::Sender<CachedChain> },
    HotChains { max: usize, reply: oneshot::Sender<Vec<(u64, Vec<u32>)>> },
    Shutdown,
}

/// Every command to the worker: the actor receives them all and is the only sender into the
/// engine thread.
pub enum WorkerMsg {
    Submit(Submission),
    Cancel { id: SeqId },
    /// A snapshot of every cached block hash (for a KV-event reader that lagged).
    CachedHashes { reply: oneshot::Sender<Result<Vec<u64>>> },
    /// Installs or removes the engine's step hook (tests and fault injection).
    SetStepHook { hook: Option<StepHook>, done: oneshot::Sender<Result<()>> },
    /// The ids of every sequence the worker holds (a drain moves each).
    Sequences { reply: oneshot::Sender<Result<Vec<SeqId>>> },
    /// Takes sequences off the worker for a move, at one step boundary (see [`Handover`]).
    Export { ids: Vec<SeqId>, reply: oneshot::Sender<Result<Vec<Handover>>> },
    /// What an export of these sequences would carry now, leaving them running (a drain's
    /// pre-copy).
    PreCopy { ids: Vec<SeqId>, reply: oneshot::Sender<Result<Vec<(SeqId, Export)>>> },
    /// Writes KV blocks into the worker's prefix cache.
    Import { import: KvImport, reply: oneshot::Sender<Result<ImportReport>> },
    /// Reads the cached blocks of a chain for another worker that fetches them.
    ReadCached { ask: CachedAsk, reply: oneshot::Sender<Result<CachedChain>> },
    /// The hottest cached chains (root, tokens), at most `max`.
    HotChains { max: usize, reply: oneshot::Sender<Result<Vec<(u64, Vec<u32>)>>> },
    /// Stop the engine after its current step, wait for its thread, then stop the actor.
    Shutdown { done: oneshot::Sender<()> },
}

struct WorkerActor;

struct ActorState {
    engine_tx: SyncSender<EngineCmd>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ActorState {
    /// Hands a command to the engine thread without blocking; gives it back if it cannot.
    fn forward(&self, cmd: EngineCmd) -> std::result::Result<(), Box<(EngineCmd, WorkerError)>> {
        match self.engine_tx.try_send(cmd) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(cmd)) => Err(Box::new((cmd, WorkerError::QueueFull(COMMAND_CAPACITY)))),
            Err(TrySendError::Disconnected(cmd)) => Err(Box::new((cmd, WorkerError::ShuttingDown))),
        }
    }
}

impl Actor for WorkerActor {
    type Msg = WorkerMsg;
    type State = ActorState;
    type Arguments = (SyncSender<EngineCmd>, std::thread::JoinHandle<()>);

    async fn pre_start(&self, _myself: ActorRef<Self::Msg>, (engine_tx, thread): Self::Arguments) -> std::result::Result<Self::State, ActorProcessingErr> {
        Ok(ActorState { engine_tx, thread: Some(thread) })
    }

    async fn handle(&self, myself: ActorRef<Self::Msg>, msg: Self::Msg, state: &mut Self::State) -> std::result::Result<(), ActorProcessingErr> {
        match msg {
            WorkerMsg::Submit(sub) => {
                if let Err(refused) = state.forward(EngineCmd::Submit(sub)) {
                    if let (EngineCmd::Submit(sub), e) = *refused {
                        let _ = sub.ack.send(Err(e));
                    }
                }
            }
            WorkerMsg::Cancel { id } => {
                // Best effort: if the channel is full the engine will find the reply closed.
                let _ = state.forward(EngineCmd::Cancel { id });
            }
            WorkerMsg::CachedHashes { reply } => {
                let (tx, rx) = oneshot::channel();
                answer_from_engine(state.forward(EngineCmd::CachedHashes { reply: tx }), rx, reply);
            }
            WorkerMsg::Sequences { reply } => {
                let (tx, rx) = oneshot::channel();
                answer_from_engine(state.forward(EngineCmd::Sequences { reply: tx }), rx, reply);
            }
            WorkerMsg::Export { ids, reply } => {
                let (tx, rx) = oneshot::channel();
                answer_from_engine(state.forward(EngineCmd::Export { ids, reply: tx }), rx, reply);
            }
            WorkerMsg::PreCopy { ids, reply } => {
                let (tx, rx) = oneshot::channel();
                answer_from_engine(state.forward(EngineCmd::PreCopy { ids, reply: tx }), rx, reply);
            }
            WorkerMsg::Import { import, reply } => {
                let (tx, rx) = oneshot::channel();
                match state.forward(EngineCmd::Import { import, reply: tx }) {
                    Ok(()) => {
                        tokio::spawn(async move {
                            let _ = reply.send(rx.await.unwrap_or(Err(WorkerError::ShuttingDown)));
                        });
                    }
                    Err(refused) => {
                        let _ = reply.send(Err(refused.1));
                    }
                }
            }
            WorkerMsg::ReadCached { ask, reply } => {
                let (tx, rx) = oneshot::channel();
                answer_from_engine(state.forward(EngineCmd::ReadCached { ask, reply: tx }), rx, reply);
            }
            WorkerMsg::HotChains { max, reply } => {
                let (tx, rx) = oneshot::channel();
                answer_from_engine(state.forward(EngineCmd::HotChains { max, reply: tx }), rx, reply);
            }
            WorkerMsg::SetStepHook { hook, done } => {
                let _ = done.send(state.forward(EngineCmd::SetStepHook { hook }).map_err(|refused| refused.1));
            }
            WorkerMsg::Shutdown { done } => {
                stop_engine(state).await;
                let _ = done.send(());
                myself.stop(None);
            }
        }
        Ok(())
    }

    async fn post_stop(&self, _myself: ActorRef<Self::Msg>, state: &mut Self::State) -> std::result::Result<(), ActorProcessingErr> {
        // Every handle is gone (or the actor was stopped): the engine thread stops too.
        let _ = state.engine_tx.try_send(EngineCmd::Shutdown);
        Ok(())
    }
}

/// Answers `reply` with what the engine thread sends on `rx` (off the actor, so a busy engine
/// never holds up the mailbox), or with why the command could not reach the engine.
fn answer_from_engine<T: Send + 'static>(
    sent: std::result::Result<(), Box<(EngineCmd, WorkerError)>>,
    rx: oneshot::Receiver<T>,
    reply: oneshot::Sender<Result<T>>,
) {
    match sent {
        Ok(()) => {
            tokio::spawn(async move {
                let _ = reply.send(rx.await.map_err(|_| WorkerError::ShuttingDown));
            });
        }
        Err(refused) => {
            let _ = reply.send(Err(refused.1));
        }
    }
}

/// Tells the engine thread to stop after its current step and waits for it, off the runtime.
async fn stop_engine(state: &mut ActorState) {
    let tx = state.engine_tx.clone();
    let thread = state.thread.take();
    let _ = tokio::task::spawn_blocking(move || {
        // Blocking send: a full command channel drains within a step.
        let _ = tx.send(EngineCmd::Shutdown);
        if let Some(t) = thread {
            let _ = t.join();
        }
    })
    .await;
}

/// A cheap handle to a running worker.
#[derive(Clone)]
pub struct WorkerHandle {
    actor: ActorRef<WorkerMsg>,
    signals: watch::Receiver<WorkerSignals>,
    kv_events: broadcast::Sender<KvEvent>,
    next_id: Arc<AtomicU64>,
    /// The shape of the engine's KV cache (fixed for its life).
    kv: KvGeometry,
    /// Stops the actor (and with it the engine thread) when the last handle is dropped.
    _owner: Arc<Owner>,
}

struct Owner(ActorRef<WorkerMsg>);

impl Drop for Owner {
    fn drop(&mut self) {
        self.0.stop(None);
    }
}

/// The events of one submitted sequence. Dropping it before `Finished` cancels the sequence.
pub struct SeqStream {
    pub id: SeqId,
    rx: mpsc::Receiver<SeqEvent>,
    actor: ActorRef<WorkerMsg>,
    finished: bool,
}

impl SeqStream {
    /// The next event, or `None` once the sequence is over.
    pub async fn recv(&mut self) -> Option<SeqEvent> {
        if self.finished {
            return None;
        }
        match self.rx.recv().await {
            Some(ev) => {
                if matches!(ev, SeqEvent::Finished { .. }) {
                    self.finished = true;
                }
                Some(ev)
            }
            None => {
                self.finished = true;
                Some(SeqEvent::Finished { reason: StopReason::Lost("worker stopped".into()), usage: Default::default() })
            }
        }
    }

    /// Cancels the sequence now (the stream then ends with a `Cancelled` event).
    pub fn cancel(&self) {
        let _ = self.actor.send_message(WorkerMsg::Cancel { id: self.id });
    }
}

impl Drop for SeqStream {
    fn drop(&mut self) {
        if !self.finished {
            let _ = self.actor.send_message(WorkerMsg::Cancel { id: self.id });
        }
    }
}

impl WorkerHandle {
    /// Starts a worker around an engine: spawns the engine thread and the actor that owns it.
    pub async fn spawn(engine: Engine, name: &str) -> Result<Self> {
        let (tx, rx) = sync_channel(COMMAND_CAPACITY);
        let mut engine = engine;
        let initial = engine.signals();
        let kv = engine.backend().kv();
        let (sig_tx, sig_rx) = watch::channel(initial);
        let (kv_tx, _) = broadcast::channel(KV_EVENT_CAPACITY);
        let kv_tx2 = kv_tx.clone();
        let thread = std::thread::Builder::new()
            .name(format!("zl-engine-{name}"))
            .spawn(move || engine_loop(engine, rx, sig_tx, kv_tx2))
            .map_err(WorkerError::Io)?;
        let (actor, _join) =
            Actor::spawn(None, WorkerActor, (tx, thread)).await.map_err(|e| WorkerError::Model(format!("spawning worker actor: {e}")))?;
        Ok(WorkerHandle {
            actor: actor.clone(),
            signals: sig_rx,
            kv_events: kv_tx,
            next_id: Arc::new(AtomicU64::new(1)),
            kv,
            _owner: Arc::new(Owner(actor)),
        })
    }

    /// The shape of the worker's KV cache: what a KV transfer into it must match.
    pub fn kv_geometry(&self) -> KvGeometry {
        self.kv
    }

    /// Submits a sequence. Resolves once the engine has accepted (or refused) it.
    pub async fn submit(&self, job: Job) -> Result<SeqStream> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (reply, rx) = mpsc::channel(REPLY_CAPACITY);
        let (ack, ack_rx) = oneshot::channel();
        self.actor.send_message(WorkerMsg::Submit(Submission { id, job, reply, ack })).map_err(|_| WorkerError::ShuttingDown)?;
        ack_rx.await.map_err(|_| WorkerError::ShuttingDown)??;
        Ok(SeqStream { id, rx, actor: self.actor.clone(), finished: false })
    }

    /// The latest published signals.
    pub fn signals(&self) -> WorkerSignals {
        self.signals.borrow().clone()
    }

    /// A receiver that changes whenever signals are published.
    pub fn watch_signals(&self) -> watch::Receiver<WorkerSignals> {
        self.signals.clone()
    }

    /// Every block hash the worker's prefix cache holds now. A reader of [`Self::kv_events`]
    /// that lagged resynchronizes from this.
    pub async fn cached_hashes(&self) -> Result<Vec<u64>> {
        let (reply, rx) = oneshot::channel();
        self.actor.send_message(WorkerMsg::CachedHashes { reply }).map_err(|_| WorkerError::ShuttingDown)?;
        rx.await.map_err(|_| WorkerError::ShuttingDown)?
    }

    /// Subscribes to KV events (block stored / evicted).
    pub fn kv_events(&self) -> broadcast::Receiver<KvEvent> {
        self.kv_events.subscribe()
    }

    /// Every sequence the worker holds now (running, then waiting).
    pub async fn sequences(&self) -> Result<Vec<SeqId>> {
        let (reply, rx) = oneshot::channel();
        self.actor.send_message(WorkerMsg::Sequences { reply }).map_err(|_| WorkerError::ShuttingDown)?;
        rx.await.map_err(|_| WorkerError::ShuttingDown)?
    }

    /// Takes sequences `ids` off the worker for a move, all at the same step boundary (those
    /// that already ended are skipped). Their blocks stay in this worker's prefix cache; their
    /// clients' events now wait for [`Handover::finish`].
    pub async fn export(&self, ids: Vec<SeqId>) -> Result<Vec<Handover>> {
        let (reply, rx) = oneshot::channel();
        self.actor.send_message(WorkerMsg::Export { ids, reply }).map_err(|_| WorkerError::ShuttingDown)?;
        rx.await.map_err(|_| WorkerError::ShuttingDown)?
    }

    /// What [`WorkerHandle::export`] would hand over for `ids` now, leaving them running.
    pub async fn pre_copy(&self, ids: Vec<SeqId>) -> Result<Vec<(SeqId, Export)>> {
        let (reply, rx) = oneshot::channel();
        self.actor.send_message(WorkerMsg::PreCopy { ids, reply }).map_err(|_| WorkerError::ShuttingDown)?;
        rx.await.map_err(|_| WorkerError::ShuttingDown)?
    }

    /// Writes KV blocks into the worker's prefix cache (see [`crate::migrate`]).
    pub async fn import(&self, import: KvImport) -> Result<ImportReport> {
        let (reply, rx) = oneshot::channel();
        self.actor.send_message(WorkerMsg::Import { import, reply }).map_err(|_| WorkerError::ShuttingDown)?;
        rx.await.map_err(|_| WorkerError::ShuttingDown)?
    }

    /// The KV of the cached blocks of a chain, from `ask.from_block` on, for a worker that
    /// fetches them (see [`Engine::read_cached`]).
    pub async fn read_cached(&self, ask: CachedAsk) -> Result<CachedChain> {
        let (reply, rx) = oneshot::channel();
        self.actor.send_message(WorkerMsg::ReadCached { ask, reply }).map_err(|_| WorkerError::ShuttingDown)?;
        rx.await.map_err(|_| WorkerError::ShuttingDown)?
    }

    /// The worker's hottest cached chains, at most `max`, each as (root, tokens).
    pub async fn hot_chains(&self, max: usize) -> Result<Vec<(u64, Vec<u32>)>> {
        let (reply, rx) = oneshot::channel();
        self.actor.send_message(WorkerMsg::HotChains { max, reply }).map_err(|_| WorkerError::ShuttingDown)?;
        rx.await.map_err(|_| WorkerError::ShuttingDown)?
    }

    /// Installs (or, with `None`, removes) a hook the engine runs at the start of every step
    /// (see [`StepHook`]). For tests and fault injection.
    pub async fn set_step_hook(&self, hook: Option<StepHook>) -> Result<()> {
        let (done, rx) = oneshot::channel();
        self.actor.send_message(WorkerMsg::SetStepHook { hook, done }).map_err(|_| WorkerError::ShuttingDown)?;
        rx.await.map_err(|_| WorkerError::ShuttingDown)?
    }

    /// Stops the engine after its current step and waits for its thread; open sequences end
    /// with an error event. Returns at once if the worker already stopped.
    pub async fn shutdown(&self) {
        let (done, rx) = oneshot::channel();
        if self.actor.send_message(WorkerMsg::Shutdown { done }).is_ok() {
            let _ = rx.await;
        }
    }
}

struct Route {
    tx: mpsc::Sender<SeqEvent>,
    /// Events that did not fit the channel, merged (at most a delta and a final event).
    pending: VecDeque<SeqEvent>,
}

impl Route {
    /// Delivers `ev` (after anything pending). Returns false if the receiver is gone.
    fn deliver(&mut self, ev: Option<SeqEvent>) -> bool {
        if let Some(ev) = ev {
            match (self.pending.back_mut(), ev) {
                (Some(SeqEvent::Delta { tokens, text, logprobs }), SeqEvent::Delta { tokens: t, text: x, logprobs: l }) => {
                    tokens.extend(t);
                    text.push_str(&x);
                    logprobs.extend(l);
                }
                (_, ev) => self.pending.push_back(ev),
            }
        }
        while let Some(ev) = self.pending.pop_front() {
            match self.tx.try_send(ev) {
                Ok(()) => {}
                Err(mpsc::error::TrySendError::Full(ev)) => {
                    self.pending.push_front(ev);
                    return true;
                }
                Err(mpsc::error::TrySendError::Closed(_)) => return false,
            }
        }
        true
    }
}

/// Answers the commands that ask the engine something or hand it KV without touching a
/// sequence's route (the rest come back).
fn answer(engine: &mut Engine, cmd: EngineCmd) -> Option<EngineCmd> {
    match cmd {
        EngineCmd::CachedHashes { reply } => {
            let _ = reply.send(engine.cached_hashes());
        }
        EngineCmd::SetStepHook { hook } => engine.set_step_hook(hook),
        EngineCmd::Sequences { reply } => {
            let _ = reply.send(engine.sequences());
        }
        EngineCmd::PreCopy { ids, reply } => {
            let _ = reply.send(ids.into_iter().filter_map(|id| engine.pre_copy(id).map(|e| (id, e))).collect());
        }
        EngineCmd::Import { import, reply } => {
            let _ = reply.send(engine.import(&import));
        }
        EngineCmd::HotChains { max, reply } => {
            let _ = reply.send(engine.hot_chains(max));
        }
        EngineCmd::ReadCached { ask, reply } => {
            let _ = reply.send(engine.read_cached(ask.cache_root, &ask.tokens, ask.from_block));
        }
        other => return Some(other),
    }
    None
}

fn engine_loop(mut engine: Engine, rx: Receiver<EngineCmd>, sig_tx: watch::Sender<WorkerSignals>, kv_tx: broadcast::Sender<KvEvent>) {
    let mut routes: HashMap<SeqId, Route> = HashMap::new();
    // Finished sequences whose last events are still waiting for channel room.
    let mut draining: HashMap<SeqId, Route> = HashMap::new();
    let mut last_signal = Instant::now();
    let mut shutdown = false;
    while !shutdown {
        // Wait for work when idle; otherwise just drain what arrived.
        let first = if engine.has_work() || !draining.is_empty() {
            rx.try_recv().ok()
        } else {
            match rx.recv_timeout(SIGNAL_INTERVAL) {
                Ok(c) => Some(c),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => break,
            }
        };
        let mut cmds: Vec<EngineCmd> = first.into_iter().collect();
        while let Ok(c) = rx.try_recv() {
            cmds.push(c);
            if cmds.len() >= COMMAND_CAPACITY {
                break;
            }
        }
        for cmd in cmds {
            let Some(cmd) = answer(&mut engine, cmd) else { continue };
            match cmd {
                EngineCmd::Submit(Submission { id, job, reply, ack }) => match engine.add(id, job) {
                    Ok(()) => {
                        routes.insert(id, Route { tx: reply, pending: VecDeque::new() });
                        let _ = ack.send(Ok(()));
                    }
                    Err(e) => {
                        let _ = ack.send(Err(e));
                    }
                },
                EngineCmd::Cancel { id } => {
                    if let Some(ev) = engine.cancel(id) {
                        if let Some(mut r) = routes.remove(&id) {
                            if r.deliver(Some(ev)) && !r.pending.is_empty() {
                                draining.insert(id, r);
                            }
                        }
                    }
                }
                EngineCmd::Export { ids, reply } => {
                    let handovers = ids.into_iter().filter_map(|id| engine.export(id).map(|export| Handover { id, export, route: routes.remove(&id) })).collect();
                    let _ = reply.send(handovers);
                }
                EngineCmd::Shutdown => shutdown = true,
                // Answered by `answer`.
                _ => {}
            }
        }
        if shutdown {
            break;
        }
        if engine.has_work() {
            match engine.step() {
                Ok(out) => {
                    for (id, ev) in out.events {
                        let fin = matches!(ev, SeqEvent::Finished { .. });
                        let alive = routes.get_mut(&id).map(|r| r.deliver(Some(ev))).unwrap_or(false);
                        if fin {
                            if let Some(r) = routes.remove(&id) {
                                if alive && !r.pending.is_empty() {
                                    draining.insert(id, r);
                                }
                            }
                        } else if !alive {
                            // The client went away: free the sequence now.
                            engine.cancel(id);
                            routes.remove(&id);
                        }
                    }
                }
                Err(e) => {
                    // Defensive: a step reports its own failures as error events of the
                    // sequences it touched. Anything else fails every open sequence, and the
                    // worker keeps serving.
                    tracing::error!(error = %e, "engine step failed");
                    let ids: Vec<SeqId> = routes.keys().copied().collect();
                    for id in ids {
                        engine.cancel(id);
                        if let Some(mut r) = routes.remove(&id) {
                            r.deliver(Some(SeqEvent::Finished { reason: StopReason::Error(e.to_string()), usage: Default::default() }));
                        }
                    }
                }
            }
        }
        draining.retain(|_, r| r.deliver(None) && !r.pending.is_empty());
        for ev in engine.drain_kv_events() {
            let _ = kv_tx.send(ev);
        }
        if last_signal.elapsed() >= SIGNAL_INTERVAL || !engine.has_work() {
            let _ = sig_tx.send(engine.signals());
            last_signal = Instant::now();
        }
    }
    // Shutting down: every open sequence ends with an error event.
    for (id, mut r) in routes.drain() {
        engine.cancel(id);
        r.deliver(Some(SeqEvent::Finished { reason: StopReason::Lost("worker shut down".into()), usage: Default::default() }));
    }
    let _ = sig_tx.send(engine.signals());
}
