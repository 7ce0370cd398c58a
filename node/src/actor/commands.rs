//! What travels from the worker actor to its engine thread ([`EngineCmd`], with a
//! [`Submission`] for each job), what comes back for a moved sequence ([`Handover`]), and a
//! sequence's event route to its client ([`Route`]).

use std::collections::VecDeque;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use zerolayer_common::{Job, SeqEvent, StopReason, Usage};

use crate::engine::StepHook;
use crate::error::Result;
use crate::migrate::{CachedChain, Export, ImportReport, KvImport};
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
    pub(super) id: SeqId,
    pub(super) job: Job,
    pub(super) reply: mpsc::Sender<SeqEvent>,
    pub(super) ack: oneshot::Sender<Result<()>>,
}

/// A sequence taken off this worker by [`WorkerHandle::export`]: what it carries, and its
/// client's event channel, which the new owner's events will follow.
pub struct Handover {
    /// The sequence's id on the worker it left.
    pub id: SeqId,
    pub export: Export,
    pub(super) route: Option<Route>,
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

pub(super) enum EngineCmd {
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

pub(super) struct Route {
    pub(super) tx: mpsc::Sender<SeqEvent>,
    /// Events that did not fit the channel, merged (at most a delta and a final event).
    pub(super) pending: VecDeque<SeqEvent>,
}

impl Route {
    /// Delivers `ev` (after anything pending). Returns false if the receiver is gone.
    pub(super) fn deliver(&mut self, ev: Option<SeqEvent>) -> bool {
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
