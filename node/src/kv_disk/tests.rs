use super::*;
use crate::backend::KvGeometry;
use zerolayer_common::config::KvDtype;

fn geometry() -> KvGeometry {
    KvGeometry { block_size: 2, num_blocks: 8, dtype: KvDtype::F32, block_bytes: 1000, bytes: 8000 }
}

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("zl-kv-disk-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// A chain of `n` two-token blocks from root 0, and each block's bytes.
fn chain(n: usize) -> (Vec<u32>, Vec<u64>, Vec<Vec<u8>>) {
    let tokens: Vec<u32> = (0..2 * n as u32).map(|t| t * 7 + 1).collect();
    let hashes = zerolayer_common::block_hashes_from(0, &tokens, 2);
    let kv = (0..n).map(|i| (0..1000).map(|j| (i * 31 + j) as u8).collect()).collect();
    (tokens, hashes, kv)
}

fn spill_all(t: &DiskTier, tokens: &[u32], hashes: &[u64], kv: &[Vec<u8>], which: impl Fn(usize) -> bool) {
    for i in (0..hashes.len()).filter(|&i| which(i)) {
        assert!(t.evicted(hashes[i], 0), "block {i} is not on disk yet");
        let parent = if i == 0 { 0 } else { hashes[i - 1] };
        assert!(t.offer(Spill { hash: hashes[i], parent, tokens: tokens[2 * i..2 * i + 2].to_vec(), kv: kv[i].clone(), pin_until_unix_ms: 0, resident: false }));
    }
    assert!(t.flush(Instant::now() + Duration::from_secs(10)));
}

#[test]
fn spilled_blocks_come_back_and_survive_a_reopen_of_the_same_model_only() {
    let d = dir("reopen");
    let (tokens, hashes, kv) = chain(6);
    {
        let t = DiskTier::open(&d, "w", 1, [1; 32], &geometry()).unwrap();
        assert!(t.plan(0, &tokens).is_none(), "nothing on disk yet");
        // Blocks 0-1 stay in RAM; 2-4 go to disk; 5 is nowhere.
        spill_all(&t, &tokens, &hashes, &kv, |i| (2..5).contains(&i));
        assert!(!t.evicted(hashes[3], 0), "a block on disk is not written twice");
        let plan = t.plan(0, &tokens).unwrap();
        assert_eq!(plan.on_disk.iter().map(|p| p.0).collect::<Vec<_>>(), vec![2, 3, 4]);
        assert_eq!(plan.blocks(), 5);
        let imp = t.read(&plan, 0..5);
        assert_eq!(imp.cache_root, 0);
        assert_eq!(imp.tokens, tokens[..10]);
        for (i, (h, bytes)) in imp.blocks.iter().enumerate() {
            assert_eq!(*h, hashes[i]);
            assert_eq!(bytes.as_ref(), (2..5).contains(&i).then_some(&kv[i]), "block {i}");
        }
        // A chunk starts where the chain left off.
        let tail = t.read(&plan, 3..5);
        assert_eq!(tail.cache_root, hashes[2]);
        assert_eq!(tail.blocks[0].1.as_ref(), Some(&kv[3]));
        // Restored (now in RAM): not read again.
        t.mark_resident(&hashes[2..5]);
        assert!(t.plan(0, &tokens).is_none());
        assert!(!t.evicted(hashes[2], 0));
        assert_eq!(t.stats().written, 3);
    }
    let t = DiskTier::open(&d, "w", 1, [1; 32], &geometry()).unwrap();
    assert_eq!(t.stats().blocks, 3, "reloaded");
    let plan = t.plan(0, &tokens).unwrap();
    assert_eq!(t.read(&plan, 0..plan.blocks()).blocks[4].1.as_ref(), Some(&kv[4]));
    drop(t);
    let other = DiskTier::open(&d, "w", 1, [2; 32], &geometry()).unwrap();
    assert_eq!(other.stats().blocks, 0, "another model's blocks are not reloaded");
    assert!(other.plan(0, &tokens).is_none());
    drop(other);
    let resized = DiskTier::open(&d, "w", 2, [2; 32], &geometry()).unwrap();
    assert_eq!(resized.stats().blocks, 0);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_torn_record_is_a_miss_and_the_chain_stops_there() {
    let d = dir("torn");
    let (tokens, hashes, kv) = chain(4);
    let t = DiskTier::open(&d, "w", 1, [1; 32], &geometry()).unwrap();
    spill_all(&t, &tokens, &hashes, &kv, |_| true);
    let plan = t.plan(0, &tokens).unwrap();
    let (_, slot) = plan.on_disk[1];
    let f = OpenOptions::new().write(true).open(t.path()).unwrap();
    let h = Header { version: VERSION, block_size: 2, block_bytes: 1000, slots: 0, identity: [1; 32] };
    f.write_all_at(&[0xff; 16], h.offset(slot) + 500).unwrap();
    let imp = t.read(&plan, 0..4);
    assert_eq!(imp.blocks[0].1.as_ref(), Some(&kv[0]));
    assert!(imp.blocks[1..].iter().all(|b| b.1.is_none()), "nothing after the torn block is read");
    assert_eq!(t.stats().bad_reads, 1);
    assert!(!t.holds(hashes[1]), "the torn record is forgotten");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn the_disk_is_bounded_and_turns_over() {
    let d = dir("bounded");
    // 1 MiB of 1,064-byte records (rounded to 1,088): 963 slots.
    let t = DiskTier::open(&d, "w", 1, [1; 32], &geometry()).unwrap();
    let cap = t.stats().capacity;
    assert_eq!(cap, (1 << 20) / 1088);
    let (tokens, hashes, kv) = chain(cap + 50);
    spill_all(&t, &tokens, &hashes, &kv, |_| true);
    let s = t.stats();
    assert_eq!(s.blocks, cap);
    assert_eq!(s.written as usize, cap + 50);
    assert!(!t.holds(hashes[0]) && t.holds(hashes[cap + 49]), "the oldest blocks made room");
    assert!(std::fs::metadata(t.path()).unwrap().len() <= HEADER_BYTES + (1 << 20));
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn blocks_coming_onto_and_leaving_the_disk_are_events_under_disk_names() {
    let d = dir("events");
    let t = DiskTier::open(&d, "w", 1, [1; 32], &geometry()).unwrap();
    let cap = t.stats().capacity;
    let (tokens, hashes, kv) = chain(cap + 2);
    spill_all(&t, &tokens, &hashes, &kv, |_| true);
    let (mut on, mut off) = (std::collections::HashSet::new(), std::collections::HashSet::new());
    for ev in t.take_events() {
        match ev {
            KvEvent::Stored { hashes } => on.extend(hashes),
            KvEvent::Evicted { hashes } => off.extend(hashes),
        }
    }
    let names: std::collections::HashSet<u64> = hashes.iter().map(|&h| disk_name(h)).collect();
    assert_eq!(on, names, "every block written is announced");
    assert_eq!(off, hashes[..2].iter().map(|&h| disk_name(h)).collect::<std::collections::HashSet<u64>>(), "the two overwritten are withdrawn");
    assert!(on.iter().all(|h| h % 2 == 0), "disk names are even, RAM names odd");
    assert!(t.take_events().is_empty());
    assert_eq!(t.disk_names().len(), cap);
    drop(t);
    let again = DiskTier::open(&d, "w", 1, [1; 32], &geometry()).unwrap();
    let reloaded: usize = again.take_events().iter().map(|e| if let KvEvent::Stored { hashes } = e { hashes.len() } else { 0 }).sum();
    assert_eq!(reloaded, cap, "a reloaded tier announces what it holds");
    let _ = std::fs::remove_dir_all(&d);
}
