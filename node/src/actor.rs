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
//! - A worker with a disk tier reads a submitted prompt's blocks back from it before the job
//!   reaches the engine (`restore`); the engine thread's loop is `engine_thread`.
//!
//! The actor mailbox (ractor's) is unbounded by construction; it carries submit and cancel
//! messages, whose number the node's in-flight limit bounds, and rare control messages, and it
//! forwards each with `try_send` into the bounded engine channel (a full one refuses at once).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::Arc;

use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::sync::{broadcast, mpsc, oneshot, watch};
use zerolayer_common::{Job, KvEvent, SeqEvent, StopReason, WorkerSignals};

use crate::backend::KvGeometry;
use crate::engine::{Engine, StepHook};
use crate::migrate::{CachedChain, Export, ImportReport, KvImport};
use crate::error::{WorkerError, Result};
use crate::scheduler::SeqId;

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
    /// The worker's disk tier: a submitted prompt's blocks on it are read back first.
    disk: Option<Arc<crate::kv_disk::DiskTier>>,
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
    type Arguments = (SyncSender<EngineCmd>, std::thread::JoinHandle<()>, Option<Arc<crate::kv_disk::DiskTier>>);

    async fn pre_start(&self, _myself: ActorRef<Self::Msg>, (engine_tx, thread, disk): Self::Arguments) -> std::result::Result<Self::State, ActorProcessingErr> {
        Ok(ActorState { engine_tx, thread: Some(thread), disk })
    }

    async fn handle(&self, myself: ActorRef<Self::Msg>, msg: Self::Msg, state: &mut Self::State) -> std::result::Result<(), ActorProcessingErr> {
        match msg {
            WorkerMsg::Submit(sub) => {
                if let Some((disk, plan)) = state.disk.as_ref().and_then(|d| Some((d.clone(), restore::plan(d, &sub.job)?))) {
                    restore::spawn(disk, state.engine_tx.clone(), plan, sub);
                } else if let Err(refused) = state.forward(EngineCmd::Submit(sub)) {
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
        let disk = engine.disk();
        let (sig_tx, sig_rx) = watch::channel(initial);
        let (kv_tx, _) = broadcast::channel(KV_EVENT_CAPACITY);
        let kv_tx2 = kv_tx.clone();
        let thread = std::thread::Builder::new()
            .name(format!("zl-engine-{name}"))
            .spawn(move || engine_loop(engine, rx, sig_tx, kv_tx2))
            .map_err(WorkerError::Io)?;
        let (actor, _join) =
            Actor::spawn(None, WorkerActor, (tx, thread, disk)).await.map_err(|e| WorkerError::Model(format!("spawning worker actor: {e}")))?;
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

mod commands;
mod engine_thread;
mod restore;
pub use commands::{CachedAsk, Handover, Submission, COMMAND_CAPACITY, KV_EVENT_CAPACITY, REPLY_CAPACITY, SIGNAL_INTERVAL};
use commands::EngineCmd;
use engine_thread::engine_loop;
