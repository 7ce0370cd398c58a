//! The worker actor: one per device. It owns the model, the KV cache and the scheduler (through
//! [`Engine`]), and runs the engine loop on a dedicated OS thread, off the async runtime.
//!
//! Shape: [`WorkerHandle`] (cheap `Clone`) → ractor actor (a thin shell that forwards) → a
//! bounded command channel → the engine thread, which steps the engine and streams
//! [`SeqEvent`]s back on each request's bounded reply channel.
//!
//! - Submit carries token ids, sampling params and the reply stream; the engine validates and
//!   acknowledges. A full command channel or waiting queue is refused at once (`QueueFull`).
//! - Cancel frees the sequence's blocks. Dropping a [`SeqStream`] cancels too, and so does a
//!   reply channel found closed by the engine.
//! - A client that reads slowly never blocks the engine: events that do not fit its channel
//!   are merged into one pending delta (bounded by `max_tokens`) and delivered later.
//! - Signals ([`WorkerSignals`]) are published on a watch channel at least every 100 ms, and
//!   KV events on a bounded broadcast channel (a lagging reader resyncs from a snapshot).
//!
//! The actor mailbox (ractor's) is unbounded by construction; it only carries submit/cancel
//! messages whose number is bounded by the node's in-flight limit, and forwards each with
//! `try_send` into the bounded engine channel.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::sync::{broadcast, mpsc, oneshot, watch};
use zerolayer_common::{KvEvent, SamplingParams, SeqEvent, StopReason, WorkerSignals};

use crate::engine::Engine;
use crate::error::{NodeError, Result};
use crate::scheduler::SeqId;

/// Capacity of each request's reply channel.
pub const REPLY_CAPACITY: usize = 64;
/// Capacity of the command channel into the engine thread.
pub const COMMAND_CAPACITY: usize = 1024;
/// Capacity of the KV event broadcast.
pub const KV_EVENT_CAPACITY: usize = 4096;
/// Signals are published at least this often.
pub const SIGNAL_INTERVAL: Duration = Duration::from_millis(100);

/// A request to a worker.
pub struct SubmitRequest {
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
}

enum EngineCmd {
    Submit { id: SeqId, req: SubmitRequest, reply: mpsc::Sender<SeqEvent>, ack: oneshot::Sender<Result<()>> },
    Cancel { id: SeqId },
    /// A snapshot of every cached block hash (for a KV-event reader that lagged).
    CachedHashes { reply: oneshot::Sender<Vec<u64>> },
    Shutdown,
}

/// Messages the worker actor handles.
pub enum WorkerMsg {
    Submit { id: SeqId, req: SubmitRequest, reply: mpsc::Sender<SeqEvent>, ack: oneshot::Sender<Result<()>> },
    Cancel { id: SeqId },
}

struct WorkerActor;

struct ActorState {
    engine_tx: SyncSender<EngineCmd>,
}

impl Actor for WorkerActor {
    type Msg = WorkerMsg;
    type State = ActorState;
    type Arguments = SyncSender<EngineCmd>;

    async fn pre_start(&self, _myself: ActorRef<Self::Msg>, engine_tx: Self::Arguments) -> std::result::Result<Self::State, ActorProcessingErr> {
        Ok(ActorState { engine_tx })
    }

    async fn handle(&self, _myself: ActorRef<Self::Msg>, msg: Self::Msg, state: &mut Self::State) -> std::result::Result<(), ActorProcessingErr> {
        match msg {
            WorkerMsg::Submit { id, req, reply, ack } => match state.engine_tx.try_send(EngineCmd::Submit { id, req, reply, ack }) {
                Ok(()) => {}
                Err(TrySendError::Full(EngineCmd::Submit { ack, .. })) => {
                    let _ = ack.send(Err(NodeError::QueueFull(COMMAND_CAPACITY)));
                }
                Err(TrySendError::Disconnected(EngineCmd::Submit { ack, .. })) => {
                    let _ = ack.send(Err(NodeError::ShuttingDown));
                }
                Err(_) => unreachable!(),
            },
            WorkerMsg::Cancel { id } => {
                // Best effort: if the channel is full the engine will find the reply closed.
                let _ = state.engine_tx.try_send(EngineCmd::Cancel { id });
            }
        }
        Ok(())
    }

    async fn post_stop(&self, _myself: ActorRef<Self::Msg>, state: &mut Self::State) -> std::result::Result<(), ActorProcessingErr> {
        let _ = state.engine_tx.try_send(EngineCmd::Shutdown);
        Ok(())
    }
}

/// A cheap handle to a running worker.
#[derive(Clone)]
pub struct WorkerHandle {
    actor: ActorRef<WorkerMsg>,
    signals: watch::Receiver<WorkerSignals>,
    kv_events: broadcast::Sender<KvEvent>,
    next_id: Arc<AtomicU64>,
    inner: Arc<WorkerInner>,
}

struct WorkerInner {
    engine_tx: SyncSender<EngineCmd>,
    thread: std::sync::Mutex<Option<std::thread::JoinHandle<()>>>,
    actor: ActorRef<WorkerMsg>,
}

impl Drop for WorkerInner {
    fn drop(&mut self) {
        let _ = self.engine_tx.try_send(EngineCmd::Shutdown);
        self.actor.stop(None);
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
                Some(SeqEvent::Finished { reason: StopReason::Error("worker stopped".into()), usage: Default::default() })
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
    /// Starts a worker around an engine: spawns the engine thread and the actor.
    pub async fn spawn(engine: Engine, name: &str) -> Result<Self> {
        let (tx, rx) = sync_channel(COMMAND_CAPACITY);
        let mut engine = engine;
        let initial = engine.signals();
        let (sig_tx, sig_rx) = watch::channel(initial);
        let (kv_tx, _) = broadcast::channel(KV_EVENT_CAPACITY);
        let kv_tx2 = kv_tx.clone();
        let thread = std::thread::Builder::new()
            .name(format!("zl-engine-{name}"))
            .spawn(move || engine_loop(engine, rx, sig_tx, kv_tx2))
            .map_err(NodeError::Io)?;
        let (actor, _join) =
            Actor::spawn(None, WorkerActor, tx.clone()).await.map_err(|e| NodeError::Model(format!("spawning worker actor: {e}")))?;
        Ok(WorkerHandle {
            actor: actor.clone(),
            signals: sig_rx,
            kv_events: kv_tx,
            next_id: Arc::new(AtomicU64::new(1)),
            inner: Arc::new(WorkerInner { engine_tx: tx, thread: std::sync::Mutex::new(Some(thread)), actor }),
        })
    }

    /// Submits a sequence. Resolves once the engine has accepted (or refused) it.
    pub async fn submit(&self, req: SubmitRequest) -> Result<SeqStream> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (reply, rx) = mpsc::channel(REPLY_CAPACITY);
        let (ack, ack_rx) = oneshot::channel();
        self.actor.send_message(WorkerMsg::Submit { id, req, reply, ack }).map_err(|_| NodeError::ShuttingDown)?;
        ack_rx.await.map_err(|_| NodeError::ShuttingDown)??;
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
        self.inner.engine_tx.try_send(EngineCmd::CachedHashes { reply }).map_err(|_| NodeError::QueueFull(COMMAND_CAPACITY))?;
        rx.await.map_err(|_| NodeError::ShuttingDown)
    }

    /// Subscribes to KV events (block stored / evicted).
    pub fn kv_events(&self) -> broadcast::Receiver<KvEvent> {
        self.kv_events.subscribe()
    }

    /// Stops the engine thread after the current step and waits for it.
    pub fn shutdown(&self) {
        let _ = self.inner.engine_tx.try_send(EngineCmd::Shutdown);
        if let Some(t) = self.inner.thread.lock().unwrap().take() {
            let _ = t.join();
        }
        self.inner.actor.stop(None);
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
                (Some(SeqEvent::Delta { tokens, text }), SeqEvent::Delta { tokens: t, text: x }) => {
                    tokens.extend(t);
                    text.push_str(&x);
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
            match cmd {
                EngineCmd::Submit { id, req, reply, ack } => match engine.add(id, req.prompt, req.params) {
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
                EngineCmd::CachedHashes { reply } => {
                    let _ = reply.send(engine.cached_hashes());
                }
                EngineCmd::Shutdown => shutdown = true,
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
                    // A failed step fails every running sequence, and the worker keeps serving.
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
        r.deliver(Some(SeqEvent::Finished { reason: StopReason::Error("worker shut down".into()), usage: Default::default() }));
    }
    let _ = sig_tx.send(engine.signals());
}
