//! Reading and writing the length-prefixed frames of `zerolayer_common::wire` on QUIC streams.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use zerolayer_common::wire::{self, Reply};

/// Bytes of opening frames one peer may have this node reading at once: four of the largest
/// (an honest peer's are a few KB: a forwarded prompt of 8,192 tokens is ~33 KB). A stream
/// announcing more waits for the others, within the opening's timeout; without the bound, a
/// certified peer's 1,024 streams, each announcing 4 MiB, would hold 4 GiB.
pub const OPENING_BYTES_PER_PEER: usize = 4 * wire::MAX_FRAME_BYTES;

/// The budgets of [`OPENING_BYTES_PER_PEER`], one per peer node (peers whose certificate names
/// no configured node, which only `allow_join` lets in, share one), whatever its connections.
#[derive(Default)]
pub struct OpeningBudgets(Mutex<HashMap<Option<String>, Arc<Semaphore>>>);

impl OpeningBudgets {
    /// The budget of the peer that is `node` (bounded: the configured nodes, and one more).
    pub fn of(&self, node: &Option<String>) -> Arc<Semaphore> {
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        m.entry(node.clone()).or_insert_with(|| Arc::new(Semaphore::new(OPENING_BYTES_PER_PEER))).clone()
    }

    /// Bytes held by frames being read now, over every peer.
    pub fn held(&self) -> usize {
        let m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        m.values().map(|s| OPENING_BYTES_PER_PEER - s.available_permits()).sum()
    }
}

/// A stream's opening frame, read within its peer's `budget`: the body and the budget it holds
/// until dropped; `None` if the stream finished cleanly before one.
pub async fn read_opening(recv: &mut quinn::RecvStream, budget: &Arc<Semaphore>) -> anyhow::Result<Option<(Vec<u8>, OwnedSemaphorePermit)>> {
    let Some(n) = read_len(recv).await? else { return Ok(None) };
    let held = budget.clone().acquire_many_owned(n as u32).await?;
    let mut body = vec![0u8; n];
    recv.read_exact(&mut body).await?;
    Ok(Some((body, held)))
}

/// The next frame's announced length (checked against the limit), or `None` if the stream
/// finished cleanly before one.
async fn read_len(recv: &mut quinn::RecvStream) -> anyhow::Result<Option<usize>> {
    let mut header = [0u8; 4];
    match recv.read_exact(&mut header).await {
        Ok(()) => Ok(Some(wire::frame_len(header)?)),
        Err(quinn::ReadExactError::FinishedEarly(0)) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// The next frame's body, or `None` if the stream finished cleanly before one.
pub async fn read_frame(recv: &mut quinn::RecvStream) -> anyhow::Result<Option<Vec<u8>>> {
    let Some(n) = read_len(recv).await? else { return Ok(None) };
    let mut body = vec![0u8; n];
    recv.read_exact(&mut body).await?;
    Ok(Some(body))
}

/// The next frame, decoded as a [`Reply`]; an error if the stream finished before one.
pub async fn read_reply(recv: &mut quinn::RecvStream) -> anyhow::Result<Reply> {
    let body = read_frame(recv).await?.ok_or_else(|| anyhow::anyhow!("stream closed before a reply"))?;
    Ok(wire::decode_reply(&body)?)
}

pub async fn write_reply(send: &mut quinn::SendStream, r: &Reply) -> anyhow::Result<()> {
    send.write_all(&wire::encode_reply(r)?).await?;
    Ok(())
}
