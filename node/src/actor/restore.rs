//! Reading a submitted prompt's blocks back from the worker's disk tier before the engine
//! sees the job, off the engine thread: the reads run on a blocking thread, a chunk of
//! [`RESTORE_CHUNK_BLOCKS`] at a time, each imported into the prefix cache (an ordinary KV
//! import, through the engine's channel) before the next is read; then the job follows on the
//! same channel, so the engine admits it with those blocks cached. A record that does not hold,
//! or an import that stops, ends the restore there: the engine recomputes the rest, as it
//! would without a disk tier. Nothing fails the job.

use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::Arc;

use tokio::sync::oneshot;
use zerolayer_common::Job;

use super::commands::{EngineCmd, Submission, COMMAND_CAPACITY};
use crate::error::WorkerError;
use crate::kv_disk::{DiskTier, Plan, RESTORE_CHUNK_BLOCKS};

/// What a restore would read for `job` (its prompt, and the tokens a resumed job brings).
pub(super) fn plan(disk: &DiskTier, job: &Job) -> Option<Plan> {
    if job.resume.is_empty() {
        disk.plan(job.cache_root, &job.prompt)
    } else {
        let tokens: Vec<u32> = job.prompt.iter().chain(&job.resume).copied().collect();
        disk.plan(job.cache_root, &tokens)
    }
}

/// Restores `plan`'s blocks, then hands `sub` to the engine (or refuses it, as the actor
/// would, when the engine's channel is full or gone).
pub(super) fn spawn(disk: Arc<DiskTier>, engine_tx: SyncSender<EngineCmd>, plan: Plan, sub: Submission) {
    tokio::spawn(async move {
        restore(&disk, &engine_tx, plan).await;
        let refused = match engine_tx.try_send(EngineCmd::Submit(sub)) {
            Ok(()) => None,
            Err(TrySendError::Full(cmd)) => Some((cmd, WorkerError::QueueFull(COMMAND_CAPACITY))),
            Err(TrySendError::Disconnected(cmd)) => Some((cmd, WorkerError::ShuttingDown)),
        };
        if let Some((EngineCmd::Submit(sub), e)) = refused {
            let _ = sub.ack.send(Err(e));
        }
    });
}

async fn restore(disk: &Arc<DiskTier>, engine_tx: &SyncSender<EngineCmd>, plan: Plan) {
    let Ok(_permit) = disk.restores.clone().acquire_owned().await else { return };
    let plan = Arc::new(plan);
    let n = plan.blocks();
    let mut start = 0;
    while start < n {
        let end = (start + RESTORE_CHUNK_BLOCKS).min(n);
        let (d, p) = (disk.clone(), plan.clone());
        let Ok(import) = tokio::task::spawn_blocking(move || d.read(&p, start..end)).await else { return };
        let (tx, rx) = oneshot::channel();
        if engine_tx.try_send(EngineCmd::Import { import, reply: tx }).is_err() {
            return;
        }
        match rx.await {
            Ok(Ok(report)) => {
                disk.restored(report.imported);
                if report.skipped > 0 {
                    return;
                }
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "a restore from the KV disk tier was refused; the prompt is recomputed");
                return;
            }
            Err(_) => return,
        }
        start = end;
    }
}
