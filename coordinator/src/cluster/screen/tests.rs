use std::collections::HashMap;

use super::wire::{write::encode, Kv, NodeDigest};
use super::*;

/// chitchat's state, as the screen sees it: keys per node state.
#[derive(Default)]
struct Fake(HashMap<Id, Vec<String>>);

impl Known for Fake {
    fn node_states(&self) -> usize {
        self.0.len()
    }
    fn knows(&self, id: &Id) -> bool {
        self.0.contains_key(id)
    }
    fn keys(&self, id: &Id) -> usize {
        self.0.get(id).map_or(0, Vec::len)
    }
    fn has_key(&self, id: &Id, key: &str) -> bool {
        self.0.get(id).is_some_and(|k| k.iter().any(|x| x == key))
    }
}

fn policy() -> Policy {
    Policy { me: "a".into(), generation: 100, configured: vec!["a".into(), "b".into()], allow_join: false }
}

fn id(node: &str, generation: u64) -> Id {
    Id { node: node.into(), generation, addr: "127.0.0.1:7000".parse().unwrap() }
}

fn node(i: Id) -> Op {
    Op::Node { id: i, last_gc_version: 0, from_version_excluded: 0 }
}

fn kv(key: &str, version: u64) -> Op {
    Op::Kv(Kv { key: key.into(), value: "v".into(), version, status: 0 })
}

fn ack(ops: Vec<Op>) -> Vec<u8> {
    encode(&Message::Ack { delta: ops })
}

fn known_b() -> Fake {
    Fake([(id("b", 5), vec!["state".to_string()])].into())
}

/// The chitchat crash (finding 2): a key at version 100, then the node's max version set to
/// 5. chitchat 0.13 asserts `max_version >= key version` while applying it.
#[test]
fn a_max_version_below_a_key_is_refused() {
    let k = known_b();
    let crash = ack(vec![node(id("b", 5)), kv("state", 100), Op::SetMaxVersion(5)]);
    assert_eq!(check(&crash, &policy(), &k), Err(Refusal::MaxBelowKey { node: "b".into(), max: 5, key: 100 }));
    let fine = ack(vec![node(id("b", 5)), kv("state", 100), Op::SetMaxVersion(120)]);
    assert!(check(&fine, &policy(), &k).is_ok());
    let fine = ack(vec![node(id("b", 5)), Op::SetMaxVersion(3), kv("state", 4)]);
    assert!(check(&fine, &policy(), &k).is_ok());
}

#[test]
fn deltas_chitchat_would_refuse_are_refused_here_too() {
    let k = known_b();
    for (ops, why) in [
        (vec![kv("state", 1)], "a key before any node"),
        (vec![node(id("b", 5)), kv("state", 2), kv("http", 2)], "key versions must increase"),
        (vec![node(id("b", 5)), Op::SetMaxVersion(9), kv("http", 9)], "key versions must increase"),
        (vec![node(id("b", 5)), node(id("b", 5))], "a node twice"),
    ] {
        assert_eq!(check(&ack(ops), &policy(), &k), Err(Refusal::Delta(why)));
    }
}

/// Only a node speaks for itself: a delta about its current generation and a digest entry for
/// a later one (an eviction attempt) are cut out, and the rest goes on. Older generations are
/// ordinary gossip.
#[test]
fn a_peer_cannot_speak_for_this_node() {
    let k = known_b();
    let d = NodeDigest { heartbeat: 1, last_gc_version: 0, max_version: 1 };
    let me = Message::SynAck {
        digest: vec![(id("a", 100), d), (id("a", 101), d), (id("b", 5), d)],
        delta: vec![node(id("a", 100)), kv("state", 1), node(id("b", 5)), kv("state", 2), node(id("a", 99)), kv("state", 3)],
    };
    let cut = Message::SynAck {
        digest: vec![(id("a", 100), d), (id("b", 5), d)],
        delta: vec![node(id("b", 5)), kv("state", 2), node(id("a", 99)), kv("state", 3)],
    };
    let got = check(&encode(&me), &policy(), &k).unwrap();
    assert_eq!(got.message, cut);
    assert_eq!(got.rewritten.as_deref().map(wire::decode), Some(Ok(cut.clone())));
    assert_eq!(check(&encode(&cut), &policy(), &k).unwrap().rewritten, None, "its own digest entry and older generations are ordinary");
}

/// Invalid names refuse the message; what it says of a node the config does not admit is cut
/// out (unless joining is allowed), and the rest goes on to chitchat.
#[test]
fn strangers_are_cut_out_and_bad_names_refused() {
    let k = known_b();
    for name in ["b c", "", &"b".repeat(65), "é"] {
        let m = ack(vec![node(id(name, 1)), kv("state", 1)]);
        assert!(matches!(check(&m, &policy(), &k), Err(Refusal::Node(_))), "{name:?}");
    }
    let d = NodeDigest { heartbeat: 1, last_gc_version: 0, max_version: 1 };
    let mixed = Message::SynAck {
        digest: vec![(id("mallory", 1), d), (id("b", 5), d)],
        delta: vec![node(id("mallory", 1)), kv("state", 1), kv("http", 2), node(id("b", 5)), kv("state", 3)],
    };
    let clean = Message::SynAck { digest: vec![(id("b", 5), d)], delta: vec![node(id("b", 5)), kv("state", 3)] };
    let got = check(&encode(&mixed), &policy(), &k).unwrap();
    assert_eq!(got.message, clean);
    assert_eq!(got.rewritten.as_deref().map(wire::decode), Some(Ok(clean.clone())));
    let open = Policy { allow_join: true, ..policy() };
    assert_eq!(check(&encode(&mixed), &open, &k).unwrap(), Screened { message: mixed, rewritten: None });
    assert_eq!(check(&encode(&clean), &policy(), &k).unwrap().rewritten, None, "nothing to cut: the bytes go on as they came");
}

/// What a peer can make a node store is bounded: node states, keys per node, key and value
/// sizes.
#[test]
fn growth_past_the_bounds_is_refused() {
    let open = Policy { allow_join: true, ..policy() };
    let mut k = Fake::default();
    for g in 0..MAX_NODE_STATES as u64 - 1 {
        k.0.insert(id("b", g), vec![]);
    }
    let digest = |n: u64| {
        let d = NodeDigest { heartbeat: 1, last_gc_version: 0, max_version: 1 };
        encode(&Message::Syn { cluster_id: "c".into(), digest: (0..n).map(|i| (id(&format!("n{i}"), 1), d)).collect() })
    };
    assert!(check(&digest(1), &open, &k).is_ok());
    assert_eq!(check(&digest(2), &open, &k), Err(Refusal::TooManyNodes));

    let mut k = known_b();
    k.0.insert(id("b", 5), (0..MAX_KEYS_PER_NODE - 1).map(|i| format!("k{i}")).collect());
    assert!(check(&ack(vec![node(id("b", 5)), kv("k0", 1), kv("new", 2)]), &policy(), &k).is_ok());
    let two = ack(vec![node(id("b", 5)), kv("new", 1), kv("newer", 2)]);
    assert_eq!(check(&two, &policy(), &k), Err(Refusal::TooManyKeys("b".into())));

    let k = known_b();
    let long_key = ack(vec![node(id("b", 5)), kv(&"k".repeat(MAX_KEY_BYTES + 1), 1)]);
    assert_eq!(check(&long_key, &policy(), &k), Err(Refusal::TooLarge("b".into())));
    let big = Op::Kv(Kv { key: "sig:cpu0".into(), value: "x".repeat(MAX_VALUE_BYTES + 1), version: 1, status: 0 });
    assert_eq!(check(&ack(vec![node(id("b", 5)), big]), &policy(), &k), Err(Refusal::TooLarge("b".into())));
}
