//! Frames between nodes: rkyv archives behind a 4-byte little-endian length prefix.
//!
//! Every QUIC bi-stream between nodes opens with one [`Open`] frame:
//! - [`Open::Submit`]: a forwarded request, from the coordinator that accepted it to the node
//!   owning the chosen worker. Everything that comes back is a [`Reply`]: first `Accepted` or
//!   `Refused`, then `Event`s until `SeqEvent::Finished`.
//! - [`Open::Import`]: KV blocks of a sequence leaving a draining node, for the target
//!   worker's prefix cache. The header is followed by the raw bytes of every block it marks as
//!   sent, `block_bytes` each, in order, with no framing; the answer is one `Reply::Imported`
//!   or `Refused`.
//! - [`Open::Rank`]: a node asks another to host one rank of a tensor-parallel group that one of
//!   its workers leads. The stream then carries that rank's [`rank::RankMsg`] frames both ways
//!   for the group's lifetime (see [`rank`]).
//! - [`Open::Lookup`]: a node asks the node that stores a response (the Responses API's
//!   `previous_response_id`, `GET` and `DELETE /v1/responses/{id}`) for it, on a tenant's
//!   behalf; the answer is one `Reply::Found`.
//! - [`Open::Admin`]: an operator's drain, undrain or drain report for another node, passed on
//!   by the node that took the call, with the caller's key, which the receiving node checks
//!   against its own admin key; the answer is one `Reply::Done`.
//! - [`Open::Fetch`]: a node that is about to run a request asks the node whose worker caches
//!   more of its prefix for those blocks ([`FetchAsk`]). The answer is one `Reply::Blocks`
//!   header (the chain the holder found, from the asked block on), followed by the raw bytes of
//!   every block it marks as sent, as an import's; or one `Refused`.
//!
//! There is no per-element encoding beyond rkyv's archive, and a frame larger than
//! [`MAX_FRAME_BYTES`] is refused on both sides; an import's raw bytes are bounded by what the
//! header announces, which the receiver checks against its own cache before reading them.

pub mod frame;
pub mod rank;
#[doc(hidden)]
pub mod samples;

use crate::job::Job;
#[cfg(doc)]
use crate::types::CachePin;
use crate::types::SeqEvent;
use frame::{aligned, frame_within};
pub use frame::{frame_len_within, WireError};
use rank::RankJoin;

/// The largest frame either side accepts. A maximal prompt (8,192 tokens) archives to ~33 KB;
/// events are smaller. The limit bounds what a peer can make us buffer.
pub const MAX_FRAME_BYTES: usize = 4 << 20;

/// A sequence to run on one of the receiving node's workers: the [`Job`] as the front end built
/// it, and where it goes.
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct Submit {
    /// The node that holds the client connection.
    pub origin_node: String,
    /// The worker of the receiving node that placement chose.
    pub worker: String,
    /// The request itself (its pins are checked with [`CachePin::all_valid`] on arrival).
    pub job: Job,
    /// Where placement saw more of the prompt's prefix cached than the chosen worker holds:
    /// the receiving node fetches those blocks before it submits the job.
    pub fetch: Option<FetchFrom>,
}

/// A worker that caches more of a request's prefix than the worker placement chose.
#[derive(Clone, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct FetchFrom {
    pub node: String,
    pub worker: String,
    /// Blocks of the prompt's chain the chosen worker caches already (placement's view).
    pub have: u32,
    /// Blocks of the prompt's chain the holder caches (placement's view).
    pub blocks: u32,
}

/// A node asks another for the KV blocks of a chain that one of its workers caches.
#[derive(Clone, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct FetchAsk {
    /// The node that asks (and will import the blocks).
    pub origin_node: String,
    pub request_id: String,
    /// The holder's worker.
    pub worker: String,
    /// The chain's root (the request's cache scope) and the tokens its blocks hold, a whole
    /// number of blocks.
    pub cache_root: u64,
    pub tokens: Vec<u32>,
    /// The first block wanted: the asker caches the ones before it.
    pub from_block: u32,
}

/// One block of an import: its prefix hash, the checksum of its bytes, and whether the bytes
/// follow (the sender believes the target caches the others already).
#[derive(Clone, Copy, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct BlockHeader {
    pub hash: u64,
    pub checksum: u64,
    pub sent: bool,
}

/// KV blocks of a sequence that leaves a draining node.
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct ImportHeader {
    pub request_id: String,
    /// The node the blocks come from.
    pub origin_node: String,
    /// The receiving node's worker whose prefix cache takes them.
    pub worker: String,
    pub block_size: u32,
    pub block_bytes: u64,
    /// The tokens the blocks hold (the chain hashes are checked against them).
    pub tokens: Vec<u32>,
    /// The root the chain starts from (its sequence's cache scope).
    pub cache_root: u64,
    pub blocks: Vec<BlockHeader>,
}

impl ImportHeader {
    /// Raw bytes that follow the header.
    pub fn payload_bytes(&self) -> u64 {
        self.blocks.iter().filter(|b| b.sent).count() as u64 * self.block_bytes
    }
}

/// The first frame of every bi-stream between nodes.
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum Open {
    Submit(Submit),
    Import(ImportHeader),
    Rank(RankJoin),
    Lookup(Lookup),
    Admin(AdminCall),
    Fetch(FetchAsk),
}

/// An admin call for the receiving node, passed on by the node that took it.
#[derive(Clone, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct AdminCall {
    /// The node that passes it on.
    pub origin_node: String,
    /// `drain`, `undrain`, `report`, `audit` or `audit_since` (the receiver refuses anything
    /// else).
    pub action: String,
    /// The key the caller presented (`x-api-key` or bearer), empty for none.
    pub key: String,
    /// The action's argument: an audit id, or milliseconds since the epoch (empty for none).
    pub arg: String,
}

/// A stored response asked of the node that keeps it, for the tenant the asking node
/// authenticated (an entry of another tenant is not found).
#[derive(Clone, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct Lookup {
    /// The node that asks.
    pub origin_node: String,
    pub id: String,
    pub tenant: String,
    /// Forget it rather than send it.
    pub delete: bool,
}

/// What the receiving node sends back on the stream.
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum Reply {
    /// The worker admitted the sequence; events follow.
    Accepted,
    /// The worker refused it. `overloaded`: its queue was full (the origin answers 529).
    Refused { overloaded: bool, message: String },
    Event(SeqEvent),
    /// An import is done: the first `blocks` blocks of its chain are in the worker's cache.
    Imported { blocks: u32 },
    /// A lookup's answer: whether the response was there (and is now gone, for a delete), and
    /// its stored body (empty for a delete).
    Found { found: bool, body: Vec<u8> },
    /// An admin call's answer: the HTTP status and JSON body the receiving node's own admin API
    /// would have sent.
    Done { status: u16, body: Vec<u8> },
    /// A fetch's answer: the chain the holder caches (the blocks before the asked one marked
    /// not sent); the raw bytes of the sent blocks follow.
    Blocks(ImportHeader),
}

fn frame(body: &[u8]) -> Result<Vec<u8>, WireError> {
    frame_within(body, MAX_FRAME_BYTES)
}

/// The length a frame header announces, checked against the limit.
pub fn frame_len(header: [u8; 4]) -> Result<usize, WireError> {
    frame_len_within(header, MAX_FRAME_BYTES)
}

/// A length-prefixed `Open` frame.
pub fn encode_open(o: &Open) -> Result<Vec<u8>, WireError> {
    let body = rkyv::to_bytes::<rkyv::rancor::Error>(o).map_err(|e| WireError::Malformed(e.to_string()))?;
    frame(&body)
}

/// Decodes a frame body (without the length prefix), validating it first.
pub fn decode_open(body: &[u8]) -> Result<Open, WireError> {
    rkyv::from_bytes::<Open, rkyv::rancor::Error>(&aligned(body)).map_err(|e| WireError::Malformed(e.to_string()))
}

pub fn encode_reply(r: &Reply) -> Result<Vec<u8>, WireError> {
    let body = rkyv::to_bytes::<rkyv::rancor::Error>(r).map_err(|e| WireError::Malformed(e.to_string()))?;
    frame(&body)
}

pub fn decode_reply(body: &[u8]) -> Result<Reply, WireError> {
    rkyv::from_bytes::<Reply, rkyv::rancor::Error>(&aligned(body)).map_err(|e| WireError::Malformed(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_garbage_is_refused() {
        for o in samples::opens() {
            let f = encode_open(&o).unwrap();
            let n = frame_len(f[..4].try_into().unwrap()).unwrap();
            assert_eq!(n, f.len() - 4);
            assert_eq!(decode_open(&f[4..]).unwrap(), o);
        }
        let Open::Import(h) = &samples::opens()[1] else { panic!("the second sample is an import") };
        assert_eq!(h.payload_bytes(), 1024);
        for r in samples::replies() {
            let f = encode_reply(&r).unwrap();
            assert_eq!(decode_reply(&f[4..]).unwrap(), r);
        }
        let f = encode_open(samples::opens().last().unwrap()).unwrap();
        assert!(decode_open(&[0xff; 37]).is_err());
        assert!(decode_reply(&f[4..f.len() - 3]).is_err());
        assert!(matches!(frame_len((MAX_FRAME_BYTES as u32 + 1).to_le_bytes()), Err(WireError::TooLarge(..))));
    }
}
