//! What travels on a rank stream: one rank of a tensor-parallel group that spans nodes.
//!
//! The node whose worker leads the group (rank 0, the engine's) opens one bi-stream per remote
//! rank with [`Open::Rank`](super::Open::Rank) carrying a [`RankJoin`]. The node it names checks
//! the join and loads the model ([`RankMsg::Joining`]), builds that rank (its shard of the
//! model and of the KV cache; on GPUs this is where it joins the NCCL group, which completes
//! only once rank 0 joins too) and answers [`RankMsg::Ready`], or [`RankMsg::Failed`] at any
//! point; from then on the stream carries, in order:
//!
//! - leader → rank: `Forward` (a step's batch), `Read`/`Write` (a KV block, for moves), and
//!   `Sum` (the all-reduce result, once per all-reduce of a step);
//! - rank → leader: `Partial` (its share of an all-reduce), then `Done` at the end of a step,
//!   `Block`/`Written` for reads and writes.
//!
//! On CPU ranks the all-reduce is a star over these streams: the leader takes every rank's
//! partial, sums them in rank order (`((p₀ + p₁) + p₂) + …`, as every collective here does) and
//! sends the sum back, so a group across nodes computes the same bits as the same group of
//! threads on one node. GPU ranks sum through NCCL instead (the join carries the group's NCCL
//! id: the link is the only bootstrap channel), and no `Partial`/`Sum` travels.
//!
//! Everything a peer sends is checked before use (sizes against the receiver's own shapes, item
//! extents against the batch); a frame is at most [`MAX_RANK_FRAME_BYTES`].

use super::frame::{aligned, frame_within, WireError};

/// The largest rank frame either side accepts: a step's partial sums are `tokens × hidden` f32
/// (4,096 tokens of a 4,096-wide model is 64 MiB), a KV block's part is far smaller.
pub const MAX_RANK_FRAME_BYTES: usize = 80 << 20;

/// Asks the receiving node to host rank `rank` of `size` of worker `worker` of `origin_node`.
/// Both nodes read the model, the plan and the KV geometry from the same cluster config; the
/// block count is sent so that the host can check it computes the same one.
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct RankJoin {
    pub origin_node: String,
    pub worker: String,
    pub rank: u32,
    pub size: u32,
    pub block_size: u32,
    pub num_blocks: u32,
    /// GPU ranks: the NCCL unique id of the group (128 bytes) that rank 0 made; empty for CPU
    /// ranks, which sum over the streams.
    pub nccl_id: Vec<u8>,
}

/// One item of a step's batch, its tokens and block table given as lengths: the host cuts
/// them from the batch's vectors in order, and refuses a batch whose lengths do not add up.
#[derive(Clone, Copy, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct RankItem {
    pub tokens: u32,
    pub table: u32,
    pub start_pos: u32,
    /// Logits rows wanted: for the item's last `logits` tokens (0: none).
    pub logits: u32,
}

/// A frame on a rank stream after the join (module docs).
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum RankMsg {
    /// The join is accepted and the model loaded; the rank is being built (on GPUs: joining the
    /// NCCL group, which rank 0 must now join too).
    Joining,
    /// The rank is built: its KV blocks (the leader checks them against its own) and the bytes
    /// of its weights.
    Ready { num_blocks: u32, weight_bytes: u64 },
    /// The rank could not be built, or the join was refused.
    Failed { message: String },
    Forward { tokens: Vec<u32>, tables: Vec<u32>, items: Vec<RankItem> },
    Partial(Vec<f32>),
    Sum(Vec<f32>),
    /// The step ended on the rank (`error`: it ended in an error there).
    Done { error: Option<String> },
    Read { block: u32 },
    Block { bytes: Vec<u8>, error: Option<String> },
    Write { block: u32, bytes: Vec<u8> },
    Written { error: Option<String> },
}

/// A length-prefixed rank frame.
pub fn encode_rank(m: &RankMsg) -> Result<Vec<u8>, WireError> {
    let body = rkyv::to_bytes::<rkyv::rancor::Error>(m).map_err(|e| WireError::Malformed(e.to_string()))?;
    frame_within(&body, MAX_RANK_FRAME_BYTES)
}

/// Decodes a rank frame's body (without the length prefix), validating it first.
pub fn decode_rank(body: &[u8]) -> Result<RankMsg, WireError> {
    rkyv::from_bytes::<RankMsg, rkyv::rancor::Error>(&aligned(body)).map_err(|e| WireError::Malformed(e.to_string()))
}

/// The items of a `Forward` as ranges of its token and table vectors, or why they do not fit.
pub fn item_ranges(tokens: usize, tables: usize, items: &[RankItem]) -> Result<Vec<(std::ops::Range<usize>, std::ops::Range<usize>)>, String> {
    let (mut t, mut b) = (0usize, 0usize);
    let mut out = Vec::with_capacity(items.len());
    for (i, it) in items.iter().enumerate() {
        let (t1, b1) = (t + it.tokens as usize, b + it.table as usize);
        if t1 > tokens || b1 > tables {
            return Err(format!("item {i} reaches past the batch's tokens or block tables"));
        }
        out.push((t..t1, b..b1));
        (t, b) = (t1, b1);
    }
    if (t, b) != (tokens, tables) {
        return Err("the items do not cover the batch's tokens and block tables".into());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_frames_round_trip_and_bad_batches_are_refused() {
        let items = crate::wire::samples::rank_items();
        for m in crate::wire::samples::ranks() {
            let f = encode_rank(&m).unwrap();
            assert_eq!(crate::wire::frame::frame_len_within(f[..4].try_into().unwrap(), MAX_RANK_FRAME_BYTES).unwrap(), f.len() - 4);
            assert_eq!(decode_rank(&f[4..]).unwrap(), m);
        }
        assert!(decode_rank(&[0xff; 29]).is_err());
        assert_eq!(item_ranges(4, 3, &items).unwrap(), vec![(0..3, 0..2), (3..4, 2..3)]);
        assert!(item_ranges(3, 3, &items).is_err(), "past the tokens");
        assert!(item_ranges(5, 3, &items).is_err(), "tokens left over");
        assert!(item_ranges(4, 2, &items).is_err(), "past the tables");
        // A partial of 70 MB frames; one past the limit does not.
        assert!(encode_rank(&RankMsg::Partial(vec![0.0; 70 << 18])).is_ok());
        assert!(matches!(encode_rank(&RankMsg::Partial(vec![0.0; (MAX_RANK_FRAME_BYTES / 4) + 1])), Err(WireError::TooLarge(..))));
    }
}
