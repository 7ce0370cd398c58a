//! The block pool's tests: LRU eviction, pins, layout groups under a full pool, and random
//! operation sequences against the invariants.

use super::*;
use proptest::prelude::*;

/// Tokens standing for hash `h` (a test's blocks are named by their hash alone).
fn toks(h: u64, bs: usize) -> Vec<u32> {
    vec![h as u32; bs]
}

impl BlockPool {
    fn register_h(&mut self, b: BlockId, h: u64) -> bool {
        let t = toks(h, self.block_size);
        self.register(b, BlockName { hash: h, parent: 0, tokens: &t })
    }
    fn lookup_h(&self, h: u64) -> Option<BlockId> {
        self.lookup(BlockName { hash: h, parent: 0, tokens: &toks(h, self.block_size) })
    }
}

/// A colliding name (the same hash for other tokens, or under another parent) finds nothing:
/// a forged or chance collision cannot hand a request KV computed for other tokens.
#[test]
fn a_colliding_name_reuses_nothing() {
    let mut p = BlockPool::new(2, 4);
    let a = p.allocate().unwrap();
    assert!(p.register(a, BlockName { hash: 42, parent: 7, tokens: &[1, 2, 3, 4] }));
    p.release(a);
    assert_eq!(p.lookup(BlockName { hash: 42, parent: 7, tokens: &[1, 2, 3, 4] }), Some(a), "the same prefix is reused");
    assert_eq!(p.lookup(BlockName { hash: 42, parent: 7, tokens: &[1, 2, 3, 5] }), None, "other tokens under the same hash");
    assert_eq!(p.lookup(BlockName { hash: 42, parent: 8, tokens: &[1, 2, 3, 4] }), None, "another parent under the same hash");
    p.check_invariants();
}

#[test]
fn cached_blocks_survive_release_until_evicted_lru_first() {
    let mut p = BlockPool::new(3, 16);
    let a = p.allocate().unwrap();
    let b = p.allocate().unwrap();
    assert!(p.register_h(a, 11));
    assert!(p.register_h(b, 22));
    p.release(a);
    p.release(b);
    assert_eq!(p.num_free(), 3);
    assert_eq!(p.lookup_h(11), Some(a));
    // Reuse b: it leaves the LRU list.
    p.acquire(b);
    let c = p.allocate().unwrap(); // the plain free block
    let d = p.allocate().unwrap(); // evicts a (the only LRU entry)
    assert_eq!(d, a);
    assert_eq!(p.lookup_h(11), None);
    assert!(p.allocate().is_none());
    let (ev, overflow) = p.drain_events();
    assert!(!overflow);
    assert_eq!(ev, vec![KvEvent::Stored { hashes: vec![11, 22] }, KvEvent::Evicted { hashes: vec![11] }]);
    p.release(c);
    p.release(d);
    p.release(b);
    p.check_invariants();
}

#[test]
fn a_pinned_block_outlives_lru_pressure_until_its_pin_expires() {
    let mut p = BlockPool::new(4, 16);
    p.set_max_pinned(1);
    let a = p.allocate().unwrap();
    assert!(!p.pin(a, 100), "an uncached block cannot be pinned");
    assert!(p.register_h(a, 7));
    assert!(p.pin(a, 100));
    p.release(a);
    assert_eq!(p.num_free(), 3, "a pinned block is not free");
    // A flood: every other block is allocated, cached, released and reused again and again.
    for round in 0..10u64 {
        let bs: Vec<_> = (0..3).map(|_| p.allocate().unwrap()).collect();
        assert!(p.allocate().is_none(), "the pinned block is never handed out");
        for (k, &b) in bs.iter().enumerate() {
            p.register_h(b, 1000 + round * 10 + k as u64);
            assert!(!p.pin(b, 100), "the pinned share (1 block) is full");
            p.release(b);
        }
        p.check_invariants();
    }
    assert_eq!(p.lookup_h(7), Some(a));
    // A hit refreshes the pin: reused and pinned again until 200.
    p.acquire(a);
    assert!(p.pin(a, 200));
    p.release(a);
    p.expire_pins(150);
    assert_eq!(p.num_pinned(), 1);
    p.expire_pins(200);
    assert_eq!(p.num_pinned(), 0);
    assert_eq!(p.num_free(), 4);
    p.check_invariants();
    // Running work that needs the room takes it from idle pins.
    p.acquire(a);
    assert!(p.pin(a, 300));
    p.release(a);
    assert_eq!((p.num_free(), p.unpin_idle(), p.num_free(), p.num_pinned()), (3, 1, 4, 0));
    p.check_invariants();
    // Unpinned, it is evictable like any other (the LRU's newest, so evicted last).
    let all: Vec<_> = (0..4).map(|_| p.allocate().unwrap()).collect();
    assert!(all.contains(&a) && p.lookup_h(7).is_none());
    p.check_invariants();
}

#[derive(Debug, Clone)]
enum Op {
    Alloc,
    /// `allocate_after` the held block at this index (none when nothing is held).
    AllocAfter(usize),
    Share(usize),
    Release(usize),
    Register(usize, u8),
    Reuse(u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => Just(Op::Alloc),
        3 => any::<usize>().prop_map(Op::AllocAfter),
        2 => any::<usize>().prop_map(Op::Share),
        3 => any::<usize>().prop_map(Op::Release),
        2 => (any::<usize>(), any::<u8>()).prop_map(|(i, h)| Op::Register(i, h)),
        2 => any::<u8>().prop_map(Op::Reuse),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    /// Random alloc/share/release/register/reuse/evict sequences never leak a block,
    /// double-free one, or break a refcount; releasing everything returns every block.
    #[test]
    fn pool_invariants_hold(ops in proptest::collection::vec(op(), 1..300), n in 1usize..12, bs in prop_oneof![Just(4usize), Just(16)]) {
        let mut p = BlockPool::new(n, bs);
        // Our model of who holds references: one entry per reference.
        let mut held: Vec<BlockId> = vec![];
        for o in ops {
            match o {
                Op::Alloc => {
                    match p.allocate() {
                        Some(b) => { prop_assert_eq!(p.refcount(b), 1); held.push(b) }
                        None => prop_assert_eq!(p.num_free(), 0),
                    }
                }
                Op::AllocAfter(i) => {
                    let prev = (!held.is_empty()).then(|| held[i % held.len()]);
                    match p.allocate_after(prev) {
                        Some(b) => { prop_assert_eq!(p.refcount(b), 1); held.push(b) }
                        None => prop_assert_eq!(p.num_free(), 0),
                    }
                }
                Op::Share(i) if !held.is_empty() => {
                    let b = held[i % held.len()];
                    p.acquire(b);
                    held.push(b);
                }
                Op::Release(i) if !held.is_empty() => {
                    let b = held.swap_remove(i % held.len());
                    p.release(b);
                }
                Op::Register(i, h) if !held.is_empty() => {
                    let b = held[i % held.len()];
                    p.register_h(b, h as u64 + 1);
                }
                Op::Reuse(h) => {
                    if let Some(b) = p.lookup_h(h as u64 + 1) {
                        p.acquire(b);
                        held.push(b);
                    }
                }
                _ => {}
            }
            p.check_invariants();
            for b in 0..n as u32 {
                let refs = held.iter().filter(|&&x| x == b).count() as u32;
                prop_assert_eq!(p.refcount(b), refs, "refcount of {}", b);
            }
            prop_assert_eq!(p.num_free() + held.iter().collect::<std::collections::HashSet<_>>().len(), n);
        }
        for b in held.drain(..) {
            p.release(b);
        }
        p.check_invariants();
        prop_assert_eq!(p.num_free(), n);
    }
}

/// Waves of `seqs` sequences, each growing in turns to `len` blocks (every full block
/// registered under a fresh hash, as a prompt's and an answer's are), then released in turn:
/// per wave, the share of each sequence's block pairs that lie next to each other in one layout
/// group (attention's contiguous runs).
fn run_waves(p: &mut BlockPool, waves: usize, seqs: usize, len: usize) -> Vec<f64> {
    let group = zerolayer_kernels::attention::run_group(p.block_size()) as u32;
    let mut hash = 0u64;
    let mut shares = vec![];
    for _ in 0..waves {
        let mut tables: Vec<Vec<BlockId>> = vec![vec![]; seqs];
        for _ in 0..len {
            for t in tables.iter_mut() {
                let b = p.allocate_after(t.last().copied()).expect("room for the wave");
                hash += 1;
                p.register_h(b, hash);
                t.push(b);
            }
        }
        let (mut next, mut pairs) = (0, 0);
        for t in &tables {
            for w in t.windows(2) {
                pairs += 1;
                next += usize::from(w[1] == w[0] + 1 && w[1] % group != 0);
            }
        }
        shares.push(next as f64 / pairs as f64);
        for t in &tables {
            for &b in t {
                p.release(b);
            }
        }
        p.check_invariants();
    }
    shares
}

#[test]
fn growing_sequences_keep_whole_groups_once_the_pool_has_filled_with_cached_blocks() {
    // 64 groups of 16 blocks; each wave takes 5 of the pool's 8 parts, so from the second wave
    // on, every block comes from evicting cached ones.
    let mut p = BlockPool::new(1024, 4);
    let group = zerolayer_kernels::attention::run_group(4);
    assert_eq!(group, 16);
    let shares = run_waves(&mut p, 6, 8, 80);
    // A sequence of 80 blocks in whole groups of 16 has 75 of its 79 pairs in a group.
    let ideal = 75.0 / 79.0;
    assert!(shares[0] >= ideal - 1e-9, "a fresh pool: {shares:?}");
    for (w, s) in shares.iter().enumerate().skip(1) {
        assert!(*s >= 0.9 * ideal, "wave {w}, from evicted cached blocks: {shares:?}");
    }
}

#[test]
fn a_group_with_a_referenced_block_is_not_evicted_whole() {
    // Two groups of 16, every block cached; block 3 stays referenced, so group 0 cannot be
    // freed whole although its blocks are the oldest in the LRU list.
    let mut p = BlockPool::new(32, 4);
    let blocks: Vec<_> = (0..32).map(|_| p.allocate().unwrap()).collect();
    assert_eq!(blocks, (0..32).collect::<Vec<_>>());
    for &b in &blocks {
        assert!(p.register_h(b, 100 + b as u64));
    }
    for &b in blocks.iter().filter(|&&b| b != 3) {
        p.release(b);
    }
    p.drain_events();
    assert_eq!(p.allocate_after(None), Some(16), "group 1 is freed whole and started");
    assert_eq!(p.allocate_after(Some(16)), Some(17), "and the sequence continues in it");
    assert!((16..32).all(|b| p.lookup_h(100 + b).is_none()), "group 1's cached blocks are evicted");
    assert!((0..16).all(|b| p.lookup_h(100 + b) == Some(b as BlockId)), "group 0's are kept");
    let (events, _) = p.drain_events();
    assert_eq!(events, vec![KvEvent::Evicted { hashes: (116..132).collect() }]);
    p.check_invariants();
    // With group 1 in use, no group can be freed whole: its free blocks go first, then
    // cached blocks one at a time, the least recently used first.
    let more: Vec<_> = (0..14).map(|_| p.allocate_after(None).unwrap()).collect();
    assert!(more.iter().all(|&b| (18..32).contains(&b)), "group 1's free blocks: {more:?}");
    assert!((0..16).all(|b| p.lookup_h(100 + b).is_some()), "nothing evicted while they last");
    assert_eq!(p.allocate_after(None), Some(0));
    assert_eq!(p.lookup_h(100), None);
    p.check_invariants();
}

/// Two chains from root 9 (1→2→3, and 1→4 sharing block 1) and one from root 8 (5): the leaves
/// come newest first, a pinned one before all, each chain whole from its root.
#[test]
fn hot_chains_are_whole_chains_newest_leaf_first() {
    let mut p = BlockPool::new(8, 2);
    let reg = |p: &mut BlockPool, h: u64, parent: u64| {
        let b = p.allocate().unwrap();
        assert!(p.register(b, BlockName { hash: h, parent, tokens: &toks(h, 2) }));
        b
    };
    let b1 = reg(&mut p, 1, 9);
    let b2 = reg(&mut p, 2, 1);
    let b3 = reg(&mut p, 3, 2);
    let b4 = reg(&mut p, 4, 1);
    let b5 = reg(&mut p, 5, 8);
    for b in [b1, b2, b3, b5, b4] {
        p.release(b);
    }
    let chains = p.hot_chains(10);
    assert_eq!(chains, vec![(9, vec![b1, b4]), (8, vec![b5]), (9, vec![b1, b2, b3])], "leaves newest first, whole chains");
    assert_eq!(p.hot_chains(1).len(), 1);
    assert_eq!(p.block_tokens(b3), &[3, 3]);
    // A pinned leaf comes first.
    p.set_max_pinned(8);
    p.acquire(b3);
    assert!(p.pin(b3, 100));
    p.release(b3);
    assert_eq!(p.hot_chains(10)[0], (9, vec![b1, b2, b3]));
    p.check_invariants();
}
