//! One valid frame of every kind, for the round-trip tests, the `frames` fuzz target's seeds
//! and the mutation pass over the decoders (`tests/tests/fuzz_corpus.rs`).

use super::rank::{RankItem, RankJoin, RankMsg};
use super::{AdminCall, BlockHeader, FetchAsk, FetchFrom, ImportHeader, Lookup, Open, Reply, Submit};
use crate::job::{Job, TenantClaim};
use crate::types::{CachePin, SamplingParams, SeqEvent, Share, StopReason, TokenLogprob, Usage};

fn import_header() -> ImportHeader {
    ImportHeader {
        request_id: "req_2".into(),
        origin_node: "a".into(),
        worker: "cpu0".into(),
        block_size: 4,
        block_bytes: 1024,
        tokens: (0..8).collect(),
        cache_root: 9,
        blocks: vec![BlockHeader { hash: 1, checksum: 2, sent: false }, BlockHeader { hash: 3, checksum: 4, sent: true }],
    }
}

/// Every kind of [`Open`].
pub fn opens() -> Vec<Open> {
    let job = Job {
        request_id: "req_1".into(),
        model: "m".into(),
        prompt: (0..700).collect(),
        params: SamplingParams { stop_sequences: vec!["\n\n".into()], seed: Some(7), ..SamplingParams::greedy(9) },
        share: Share::of("team-a", 2.0),
        resume: vec![5, 6],
        pins: vec![CachePin { tokens: 640, ttl_secs: 300 }],
        cache_root: 0x1234_5678_9abc_def1,
        claim: TenantClaim { tenant: "team-a".into(), cache_salt: Some("s".into()) },
    };
    vec![
        Open::Submit(Submit { origin_node: "a".into(), worker: "cpu0".into(), job, fetch: Some(FetchFrom { node: "b".into(), worker: "cpu1".into(), have: 2, blocks: 40 }) }),
        Open::Import(import_header()),
        Open::Fetch(FetchAsk { origin_node: "a".into(), request_id: "req_3".into(), worker: "cpu0".into(), cache_root: 9, tokens: (0..64).collect(), from_block: 2 }),
        Open::Rank(RankJoin { origin_node: "a".into(), worker: "tp0".into(), rank: 1, size: 2, block_size: 16, num_blocks: 64, nccl_id: vec![7; 128] }),
        Open::Admin(AdminCall { origin_node: "a".into(), action: "drain".into(), key: "k".into(), arg: String::new() }),
        Open::Lookup(Lookup { origin_node: "a".into(), id: "resp_1".into(), tenant: "alice".into(), delete: false }),
    ]
}

/// Every kind of [`Reply`].
pub fn replies() -> Vec<Reply> {
    vec![
        Reply::Accepted,
        Reply::Refused { overloaded: true, message: "full".into() },
        Reply::Imported { blocks: 7 },
        Reply::Found { found: true, body: b"{}".to_vec() },
        Reply::Done { status: 401, body: b"{}".to_vec() },
        Reply::Blocks(import_header()),
        Reply::Event(SeqEvent::Delta { tokens: vec![1, 2], text: "hé".into(), logprobs: vec![TokenLogprob { token: 2, logprob: -0.5, top: vec![(2, -0.5), (7, -1.25)] }] }),
        Reply::Event(SeqEvent::Finished { reason: StopReason::StopSequence("x".into()), usage: Usage { output_tokens: 3, ..Default::default() } }),
        Reply::Event(SeqEvent::Finished { reason: StopReason::Moved { node: "b".into(), worker: "cpu0".into(), kv_tokens: 96 }, usage: Usage::default() }),
    ]
}

/// The items of the sample `Forward`: 4 tokens and 3 table entries between them.
pub fn rank_items() -> Vec<RankItem> {
    vec![RankItem { tokens: 3, table: 2, start_pos: 0, logits: 1 }, RankItem { tokens: 1, table: 1, start_pos: 9, logits: 0 }]
}

/// Every kind of [`RankMsg`].
pub fn ranks() -> Vec<RankMsg> {
    vec![
        RankMsg::Joining,
        RankMsg::Ready { num_blocks: 64, weight_bytes: 1 << 30 },
        RankMsg::Failed { message: "no".into() },
        RankMsg::Forward { tokens: vec![1, 2, 3, 4], tables: vec![0, 1, 2], items: rank_items() },
        RankMsg::Partial(vec![1.5, -0.0, f32::MIN_POSITIVE]),
        RankMsg::Sum(vec![]),
        RankMsg::Done { error: Some("x".into()) },
        RankMsg::Read { block: 3 },
        RankMsg::Block { bytes: vec![1, 2, 3], error: None },
        RankMsg::Write { block: 4, bytes: vec![9; 10] },
        RankMsg::Written { error: None },
    ]
}

/// Which decoder [`exercise`] feeds: its input's first byte, modulo 3.
pub const DECODERS: [&str; 3] = ["open", "reply", "rank"];

/// What a peer's frame body (`data` after its first byte, which picks the decoder) can do to a
/// decoder: nothing but be read or refused. A body that reads encodes to a frame that reads
/// and encodes to the same bytes again (bytes, not values: a peer may send NaNs). The `frames`
/// fuzz target's body, and the mutation pass's.
pub fn exercise(data: &[u8]) -> bool {
    let Some((&pick, body)) = data.split_first() else { return false };
    let again = |first: Vec<u8>, second: Vec<u8>| {
        assert_eq!(first, second, "a decoded frame encodes to bytes that read back as itself");
        true
    };
    match pick % 3 {
        0 => super::decode_open(body).is_ok_and(|o| {
            let f = super::encode_open(&o).expect("a decoded frame encodes");
            again(f.clone(), super::encode_open(&super::decode_open(&f[4..]).expect("it reads again")).unwrap())
        }),
        1 => super::decode_reply(body).is_ok_and(|r| {
            let f = super::encode_reply(&r).expect("a decoded frame encodes");
            again(f.clone(), super::encode_reply(&super::decode_reply(&f[4..]).expect("it reads again")).unwrap())
        }),
        _ => super::rank::decode_rank(body).is_ok_and(|m| {
            let f = super::rank::encode_rank(&m).expect("a decoded frame encodes");
            again(f.clone(), super::rank::encode_rank(&super::rank::decode_rank(&f[4..]).expect("it reads again")).unwrap())
        }),
    }
}

/// Every sample as an input of [`exercise`]: the decoder's byte, then the frame's body.
pub fn inputs() -> Vec<Vec<u8>> {
    let with = |pick: u8, f: Vec<u8>| [&[pick][..], &f[4..]].concat();
    let mut out: Vec<Vec<u8>> = opens().iter().map(|o| with(0, super::encode_open(o).unwrap())).collect();
    out.extend(replies().iter().map(|r| with(1, super::encode_reply(r).unwrap())));
    out.extend(ranks().iter().map(|m| with(2, super::rank::encode_rank(m).unwrap())));
    out
}
