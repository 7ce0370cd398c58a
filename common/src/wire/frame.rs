//! The framing every stream between nodes shares: a 4-byte little-endian length, then an rkyv
//! archive, each kind of stream with its own size limit.

#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("frame of {0} bytes exceeds the {1}-byte limit")]
    TooLarge(usize, usize),
    #[error("malformed frame: {0}")]
    Malformed(String),
}

/// `body` behind its length, refused if over `limit`.
pub(crate) fn frame_within(body: &[u8], limit: usize) -> Result<Vec<u8>, WireError> {
    if body.len() > limit {
        return Err(WireError::TooLarge(body.len(), limit));
    }
    let mut out = Vec::with_capacity(4 + body.len());
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(body);
    Ok(out)
}

/// The length a frame header announces, checked against `limit` (the Open/Reply frames' or a
/// rank stream's, [`super::rank::MAX_RANK_FRAME_BYTES`]).
pub fn frame_len_within(header: [u8; 4], limit: usize) -> Result<usize, WireError> {
    let n = u32::from_le_bytes(header) as usize;
    if n > limit {
        return Err(WireError::TooLarge(n, limit));
    }
    Ok(n)
}

/// A frame body copied to rkyv's alignment, for validation and decoding.
pub(crate) fn aligned(body: &[u8]) -> rkyv::util::AlignedVec<16> {
    let mut v = rkyv::util::AlignedVec::<16>::with_capacity(body.len());
    v.extend_from_slice(body);
    v
}
