//! The engine thread: it takes commands off the bounded channel, steps the engine, and
//! delivers each sequence's events on its reply channel ([`Route`]: a slow reader's events
//! are merged and sent later, never waited for).

use std::collections::{HashMap, VecDeque};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use tokio::sync::{broadcast, watch};
use zerolayer_common::{KvEvent, SeqEvent, StopReason, WorkerSignals};

use super::commands::{EngineCmd, Handover, Route, Submission, COMMAND_CAPACITY, SIGNAL_INTERVAL};
use crate::engine::Engine;
use crate::scheduler::SeqId;

/// How long a stopping worker may spend copying its prefix cache to its disk tier.
pub const SHUTDOWN_SPILL: Duration = Duration::from_secs(5);

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

pub(super) fn engine_loop(mut engine: Engine, rx: Receiver<EngineCmd>, sig_tx: watch::Sender<WorkerSignals>, kv_tx: broadcast::Sender<KvEvent>) {
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
    // The prefix cache goes down to the disk tier (if any), for this worker's restart.
    let copied = engine.spill_all(Instant::now() + SHUTDOWN_SPILL);
    if copied > 0 {
        tracing::info!(blocks = copied, "KV cache copied to the disk tier before stopping");
    }
    let _ = sig_tx.send(engine.signals());
}
