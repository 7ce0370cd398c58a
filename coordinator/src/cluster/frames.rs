//! Reading and writing the length-prefixed frames of `zerolayer_common::wire` on QUIC streams.

use zerolayer_common::wire::{self, Reply};

/// The next frame's body, or `None` if the stream finished cleanly before one.
pub async fn read_frame(recv: &mut quinn::RecvStream) -> anyhow::Result<Option<Vec<u8>>> {
    let mut header = [0u8; 4];
    match recv.read_exact(&mut header).await {
        Ok(()) => {}
        Err(quinn::ReadExactError::FinishedEarly(0)) => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let n = wire::frame_len(header)?;
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
