//! Tensor-parallel groups that span nodes, the QUIC half: one bi-stream per rank with the
//! cluster's mutual TLS (the frames are `zerolayer_common::wire::rank`). Everything that touches
//! a tensor (rank 0's shard and star, the remote ranks, the hosted rank's shard and loop) is the
//! worker's [`zerolayer_worker::ranks`]; this module only carries its streams.
//!
//! - [`lead`]: the leading node dials each rank's node, opens its stream and sends its join,
//!   then hands the streams to the worker's `Group::form`.
//! - [`host`]: the node that hosts a rank accepts its stream, refuses it while leaving, and runs
//!   the worker's rank loop on a thread of its own; one rank per (leader, worker, rank).
//! - Here: [`RankStream`], a QUIC stream as the worker's [`RankChannels`] (the model's kernel
//!   threads block; the stream is async), and [`Connections`], the group's connections as the
//!   worker's [`RankLink`] (closed together when the group breaks).
//!
//! A group lives as long as its streams: a rank that goes breaks the group within the QUIC idle
//! timeout, and every wait on it ends in an error, not a hang.

pub mod host;
pub mod lead;
#[cfg(all(test, feature = "cuda-emulator"))]
mod on_the_emulator;

use std::sync::mpsc::sync_channel;
use std::sync::{Arc, Mutex};

use zerolayer_common::wire::rank::{decode_rank, encode_rank, RankMsg, MAX_RANK_FRAME_BYTES};
use zerolayer_common::wire::frame_len_within;
use zerolayer_worker::ranks::{RankChannels, RankLink, STREAM_CAPACITY};

/// A rank stream over QUIC, seen from threads as the worker's [`RankChannels`]: frames out go
/// through a bounded channel to a writer thread, frames in are read by a reader thread and
/// routed to `sums` (the collective's: `Partial`, `Sum`) or `control` (everything else). Both
/// threads block on the stream through the runtime that created it, and end when it does: the
/// writer when every sender is dropped (it then finishes the stream), the reader when the
/// stream or connection ends.
pub struct RankStream;

impl RankStream {
    /// Starts the two threads on `send`/`recv` (call within a tokio runtime). `name` names them.
    pub fn start(name: &str, mut send: quinn::SendStream, mut recv: quinn::RecvStream) -> anyhow::Result<RankChannels> {
        let rt = tokio::runtime::Handle::current();
        let (out, outbox) = sync_channel::<RankMsg>(STREAM_CAPACITY);
        let (sums_tx, sums) = sync_channel(STREAM_CAPACITY);
        let (control_tx, control) = sync_channel(STREAM_CAPACITY);
        let wrt = rt.clone();
        std::thread::Builder::new().name(format!("zl-rank-out-{name}")).spawn(move || {
            while let Ok(m) = outbox.recv() {
                let frame = match encode_rank(&m) {
                    Ok(f) => f,
                    Err(e) => {
                        tracing::warn!(error = %e, "a rank frame could not be encoded; closing the stream");
                        break;
                    }
                };
                if wrt.block_on(send.write_all(&frame)).is_err() {
                    return;
                }
            }
            let _ = send.finish();
        })?;
        std::thread::Builder::new().name(format!("zl-rank-in-{name}")).spawn(move || loop {
            let m = match rt.block_on(read_rank_frame(&mut recv)) {
                Ok(Some(m)) => m,
                Ok(None) => return,
                Err(e) => {
                    tracing::debug!(error = %e, "a rank stream ended");
                    return;
                }
            };
            let to = if matches!(m, RankMsg::Partial(_) | RankMsg::Sum(_)) { &sums_tx } else { &control_tx };
            if to.send(m).is_err() {
                return;
            }
        })?;
        Ok(RankChannels { out, sums, control })
    }
}

/// The next rank frame, or `None` if the stream finished cleanly before one.
pub async fn read_rank_frame(recv: &mut quinn::RecvStream) -> anyhow::Result<Option<RankMsg>> {
    let mut header = [0u8; 4];
    match recv.read_exact(&mut header).await {
        Ok(()) => {}
        Err(quinn::ReadExactError::FinishedEarly(0)) => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let n = frame_len_within(header, MAX_RANK_FRAME_BYTES)?;
    let mut body = vec![0u8; n];
    recv.read_exact(&mut body).await?;
    Ok(Some(decode_rank(&body)?))
}

/// The connections of a group, closed together when it breaks or is dropped, so that every
/// thread waiting on one of its streams (here and on the hosts) stops waiting. It also holds
/// the endpoint that drives them, for as long as any rank of the group does.
#[derive(Clone, Default)]
pub struct Connections {
    conns: Arc<Mutex<Vec<quinn::Connection>>>,
    _endpoint: Option<quinn::Endpoint>,
}

impl RankLink for Connections {
    fn close(&self, why: &str) {
        Connections::close(self, why)
    }
}

impl Connections {
    /// The connections of a group that `endpoint` dials.
    pub fn on(endpoint: quinn::Endpoint) -> Self {
        Connections { conns: Arc::default(), _endpoint: Some(endpoint) }
    }
    pub fn add(&self, c: quinn::Connection) {
        self.conns.lock().unwrap_or_else(|e| e.into_inner()).push(c);
    }
    pub fn close(&self, why: &str) {
        for c in self.conns.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            c.close(1u32.into(), why.as_bytes());
        }
    }
}
