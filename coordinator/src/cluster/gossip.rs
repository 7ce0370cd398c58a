//! What a node gossips, and how a value from a peer becomes data: the pure core of the
//! publisher. No I/O and no clock (every method that needs time takes `now`).
//!
//! Keys a node publishes:
//! - `state` (`joining` / `ready` / `draining`) and `http` (its HTTP address);
//! - `w:<worker>`: the worker's device and queue limit ([`WorkerDesc`], JSON);
//! - `sig:<worker>`: its [`WorkerSignals`] (JSON);
//! - `kvbits:<worker>` and `kv:<worker>:<shard>`: the cached block hashes, 16 hex digits each,
//!   sorted, split by their top `kvbits` bits into `2^kvbits` shards, so that one stored block
//!   rewrites one shard. The shard count grows with the cache (16 at first, doubling whenever a
//!   shard would pass [`MAX_HASHES_PER_SHARD`]), so no value exceeds the gossip message limit,
//!   whatever the cache size.
//!
//! **A peer's values are validated like a client's.** Every decoder returns an error instead
//! of panicking, on any bytes: non-ASCII text, odd lengths, oversized values, numbers out of
//! range. Sizes are bounded ([`MAX_VALUE_BYTES`], [`MAX_WORKERS_PER_NODE`]), and the caches
//! here forget nodes and workers that are no longer gossiped.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use zerolayer_common::{KvEvent, WorkerSignals};

use crate::view::NodeState;

/// Top bits that pick a digest shard: at least 4 (16 shards), at most 12 (4,096 shards, a
/// cache of 8 M blocks).
pub const MIN_SHARD_BITS: u32 = 4;
pub const MAX_SHARD_BITS: u32 = 12;
/// Hashes per shard before the shard count doubles: 2,048 × 16 hex digits = 32 KiB, half of
/// chitchat's largest message.
pub const MAX_HASHES_PER_SHARD: usize = 2048;
/// The largest gossiped value accepted (a digest shard of 4,000 hashes; signals are ~600 bytes).
pub const MAX_VALUE_BYTES: usize = 64 * 1024;
/// Workers accepted per node; more `w:` keys are ignored.
pub const MAX_WORKERS_PER_NODE: usize = 64;
/// The longest worker id or device name accepted.
pub const MAX_NAME_BYTES: usize = 64;
/// The shortest silence after which a peer the failure detector gives up on counts as dead.
pub const MIN_DEAD_SILENCE: Duration = Duration::from_millis(1500);

pub const KEY_STATE: &str = "state";
pub const KEY_HTTP: &str = "http";
/// Sequences a draining node still has to move.
pub const KEY_MOVING: &str = "moving";

/// A gossiped count (`moving`): a decimal u32, anything else is refused.
pub fn decode_count(v: &str) -> Result<u32, GossipError> {
    if v.is_empty() || v.len() > 10 || !v.bytes().all(|b| b.is_ascii_digit()) {
        return Err(GossipError::Malformed(format!("count {:?}", v.chars().take(16).collect::<String>())));
    }
    v.parse().map_err(|_| GossipError::OutOfRange(format!("count {v}")))
}

/// Why a gossiped value was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GossipError {
    #[error("value of {0} bytes exceeds the {MAX_VALUE_BYTES}-byte limit")]
    TooLarge(usize),
    #[error("malformed value: {0}")]
    Malformed(String),
    #[error("out of range: {0}")]
    OutOfRange(String),
}

pub fn worker_key(worker: &str) -> String {
    format!("w:{worker}")
}

pub fn signals_key(worker: &str) -> String {
    format!("sig:{worker}")
}

pub fn digest_key(worker: &str, shard: usize) -> String {
    format!("kv:{worker}:{shard:x}")
}

pub fn shard_bits_key(worker: &str) -> String {
    format!("kvbits:{worker}")
}

/// The shard of a block hash: its top `bits` bits.
pub fn shard_of(h: u64, bits: u32) -> usize {
    (h >> (64 - bits)) as usize
}

/// A gossiped shard-bit count, within [`MIN_SHARD_BITS`]..=[`MAX_SHARD_BITS`].
pub fn decode_shard_bits(v: &str) -> Result<u32, GossipError> {
    let b = decode_count(v)?;
    if !(MIN_SHARD_BITS..=MAX_SHARD_BITS).contains(&b) {
        return Err(GossipError::OutOfRange(format!("shard bits {b}")));
    }
    Ok(b)
}

/// The worker a `w:` key names, if the key is one and the name is acceptable.
pub fn worker_of_key(key: &str) -> Option<&str> {
    let id = key.strip_prefix("w:")?;
    valid_name(id).then_some(id)
}

/// Worker ids and device names: 1..=64 bytes of ASCII letters, digits, `-`, `_`, `.` and `:`.
pub fn valid_name(s: &str) -> bool {
    !s.is_empty() && s.len() <= MAX_NAME_BYTES && s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'))
}

/// A worker as its node describes it once.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerDesc {
    pub device: String,
    /// The id of the model it serves (a name as `valid_name` allows).
    pub model: String,
    pub max_waiting: u32,
}

fn bounded(v: &str) -> Result<(), GossipError> {
    if v.len() > MAX_VALUE_BYTES {
        return Err(GossipError::TooLarge(v.len()));
    }
    Ok(())
}

pub fn encode_desc(d: &WorkerDesc) -> String {
    serde_json::to_string(d).unwrap_or_default()
}

pub fn decode_desc(v: &str) -> Result<WorkerDesc, GossipError> {
    bounded(v)?;
    let d: WorkerDesc = serde_json::from_str(v).map_err(|e| GossipError::Malformed(e.to_string()))?;
    if !valid_name(&d.device) {
        return Err(GossipError::Malformed(format!("device name {:?}", d.device)));
    }
    if !valid_name(&d.model) {
        return Err(GossipError::Malformed(format!("model id {:?}", d.model)));
    }
    if d.max_waiting > 1 << 20 {
        return Err(GossipError::OutOfRange(format!("max_waiting {}", d.max_waiting)));
    }
    Ok(d)
}

pub fn encode_signals(s: &WorkerSignals) -> String {
    serde_json::to_string(s).unwrap_or_default()
}

/// Parses a peer's signals and checks that they describe a possible worker: the block counts
/// are consistent, the ratios are finite and in [0, 1], and the block size is sane. Placement
/// does arithmetic on these, so nothing out of range gets through.
pub fn decode_signals(v: &str) -> Result<WorkerSignals, GossipError> {
    bounded(v)?;
    let s: WorkerSignals = serde_json::from_str(v).map_err(|e| GossipError::Malformed(e.to_string()))?;
    let bad = |what: String| Err(GossipError::OutOfRange(what));
    if s.block_size == 0 || s.block_size > 4096 {
        return bad(format!("block_size {}", s.block_size));
    }
    if s.kv_blocks_free > s.kv_blocks_total || s.kv_blocks_cached > s.kv_blocks_free || s.kv_blocks_pinned > s.kv_blocks_total {
        return bad(format!("blocks: free {} cached {} pinned {} total {}", s.kv_blocks_free, s.kv_blocks_cached, s.kv_blocks_pinned, s.kv_blocks_total));
    }
    for (name, r) in [("kv_fragmentation_ratio", s.kv_fragmentation_ratio), ("prefix_hit_ratio", s.prefix_hit_ratio)] {
        if !(0.0..=1.0).contains(&r) {
            return bad(format!("{name} {r}"));
        }
    }
    if !s.tokens_per_second.is_finite() || s.tokens_per_second < 0.0 {
        return bad(format!("tokens_per_second {}", s.tokens_per_second));
    }
    if !(s.prefill_us_per_token.is_finite() && s.prefill_us_per_token >= 0.0 && s.prefill_us_per_kilo_pair.is_finite() && s.prefill_us_per_kilo_pair >= 0.0) {
        return bad(format!("prefill_us_per_token {}, prefill_us_per_kilo_pair {}", s.prefill_us_per_token, s.prefill_us_per_kilo_pair));
    }
    if s.draft_accepted_total > s.draft_tokens_total {
        return bad(format!("draft tokens kept {} > verified {}", s.draft_accepted_total, s.draft_tokens_total));
    }
    if s.memory_used_bytes > s.memory_limit_bytes {
        return bad(format!("memory used {} > limit {}", s.memory_used_bytes, s.memory_limit_bytes));
    }
    Ok(s)
}

/// A node's gossiped `state`.
pub fn decode_state(v: &str) -> Result<NodeState, GossipError> {
    NodeState::parse(v).ok_or_else(|| GossipError::Malformed(format!("node state {:?}", v.chars().take(32).collect::<String>())))
}

/// One digest shard: the hashes as 16 lowercase hex digits each, in the given order.
pub fn encode_digest(hashes: &[u64]) -> String {
    use std::fmt::Write as _;
    let mut v = String::with_capacity(hashes.len() * 16);
    for h in hashes {
        let _ = write!(v, "{h:016x}");
    }
    v
}

/// Parses one digest shard. Works on bytes, so no input can split a character; refuses any
/// byte that is not a hex digit, a length that is not a multiple of 16, and oversized values.
pub fn decode_digest(v: &str) -> Result<Vec<u64>, GossipError> {
    bounded(v)?;
    let b = v.as_bytes();
    if !b.len().is_multiple_of(16) {
        return Err(GossipError::Malformed(format!("digest length {} is not a multiple of 16", b.len())));
    }
    let mut out = Vec::with_capacity(b.len() / 16);
    for chunk in b.chunks_exact(16) {
        let mut h = 0u64;
        for &c in chunk {
            let d = match c {
                b'0'..=b'9' => c - b'0',
                b'a'..=b'f' => c - b'a' + 10,
                b'A'..=b'F' => c - b'A' + 10,
                _ => return Err(GossipError::Malformed(format!("digest byte 0x{c:02x} is not a hex digit"))),
            };
            h = h << 4 | d as u64;
        }
        out.push(h);
    }
    Ok(out)
}

/// A local worker's prefix set, kept exact from its KV events, and which shards changed since
/// they were last published.
pub struct LocalDigest {
    set: HashSet<u64>,
    bits: u32,
    dirty: Vec<bool>,
}

impl Default for LocalDigest {
    fn default() -> Self {
        LocalDigest { set: HashSet::new(), bits: MIN_SHARD_BITS, dirty: vec![true; 1 << MIN_SHARD_BITS] }
    }
}

impl LocalDigest {
    /// Applies one event; returns whether the set changed.
    pub fn apply(&mut self, ev: KvEvent) -> bool {
        let mut changed = false;
        match ev {
            KvEvent::Stored { hashes } => {
                for h in hashes {
                    if self.set.insert(h) {
                        self.dirty[shard_of(h, self.bits)] = true;
                        changed = true;
                    }
                }
            }
            KvEvent::Evicted { hashes } => {
                for h in hashes {
                    if self.set.remove(&h) {
                        self.dirty[shard_of(h, self.bits)] = true;
                        changed = true;
                    }
                }
            }
        }
        changed
    }

    /// Applies every event waiting in `rx` without blocking. Returns (the set changed, the
    /// reader lagged): after a lag some events were lost, and the caller must [`Self::resync`]
    /// from a snapshot.
    pub fn drain(&mut self, rx: &mut tokio::sync::broadcast::Receiver<KvEvent>) -> (bool, bool) {
        use tokio::sync::broadcast::error::TryRecvError;
        let (mut changed, mut lagged) = (false, false);
        loop {
            match rx.try_recv() {
                Ok(ev) => changed |= self.apply(ev),
                Err(TryRecvError::Lagged(_)) => lagged = true,
                Err(_) => return (changed, lagged),
            }
        }
    }

    /// Replaces the set with a full snapshot (after the event stream lagged).
    pub fn resync(&mut self, all: impl IntoIterator<Item = u64>) {
        self.set = all.into_iter().collect();
        self.dirty.fill(true);
    }

    pub fn set(&self) -> &HashSet<u64> {
        &self.set
    }

    /// The shard-bit count the shards are published under.
    pub fn bits(&self) -> u32 {
        self.bits
    }

    /// The shards changed since the last call, encoded (sorted hashes), and marks them clean.
    /// First the shard count doubles as often as needed to keep every shard under
    /// [`MAX_HASHES_PER_SHARD`] on average (which rewrites them all).
    pub fn take_dirty(&mut self) -> Vec<(usize, String)> {
        while self.bits < MAX_SHARD_BITS && self.set.len() > MAX_HASHES_PER_SHARD << self.bits {
            self.bits += 1;
            self.dirty = vec![true; 1 << self.bits];
        }
        let mut shards: Vec<Vec<u64>> = vec![Vec::new(); 1 << self.bits];
        if self.dirty.iter().any(|&d| d) {
            for &h in &self.set {
                let s = shard_of(h, self.bits);
                if self.dirty[s] {
                    shards[s].push(h);
                }
            }
        }
        let mut out = Vec::new();
        for (s, hs) in shards.iter_mut().enumerate() {
            if std::mem::take(&mut self.dirty[s]) {
                hs.sort_unstable();
                out.push((s, encode_digest(hs)));
            }
        }
        out
    }
}

/// A remote worker: (node, generation, worker).
pub type RemoteWorkerKey = (String, u64, String);

/// Parsed digests of remote workers, re-parsed only when a shard's version changes.
#[derive(Default)]
pub struct RemoteDigests {
    /// The shard-bit count and shard versions each set was parsed from, and the set.
    by_worker: HashMap<RemoteWorkerKey, (u32, Vec<u64>, Arc<HashSet<u64>>)>,
}

impl RemoteDigests {
    /// The cached set of `worker` on `node` (generation `generation`), published in
    /// `2^bits` shards now at `versions`; `shard(s)` reads shard `s`'s value. A malformed
    /// shard counts as empty (and is reported in the returned errors).
    pub fn get(
        &mut self,
        node: &str,
        generation: u64,
        worker: &str,
        bits: u32,
        versions: &[u64],
        shard: impl Fn(usize) -> Option<String>,
    ) -> (Arc<HashSet<u64>>, Vec<GossipError>) {
        let key = (node.to_string(), generation, worker.to_string());
        if let Some((b, v, set)) = self.by_worker.get(&key) {
            if *b == bits && v[..] == versions[..] {
                return (set.clone(), Vec::new());
            }
        }
        let mut set = HashSet::new();
        let mut errors = Vec::new();
        for s in 0..1usize << bits {
            if let Some(v) = shard(s) {
                match decode_digest(&v) {
                    Ok(hs) => set.extend(hs.into_iter().filter(|h| shard_of(*h, bits) == s)),
                    Err(e) => errors.push(e),
                }
            }
        }
        let set = Arc::new(set);
        self.by_worker.insert(key, (bits, versions.to_vec(), set.clone()));
        (set, errors)
    }

    /// Forgets every worker not in `seen` (node, generation, worker): dead nodes, old
    /// generations and removed workers do not accumulate.
    pub fn retain(&mut self, seen: &HashSet<RemoteWorkerKey>) {
        self.by_worker.retain(|k, _| seen.contains(k));
    }

    pub fn len(&self) -> usize {
        self.by_worker.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_worker.is_empty()
    }
}

/// When each peer's heartbeat last advanced, as seen here; decides `dead`.
#[derive(Default)]
pub struct Liveness {
    heard: HashMap<(String, u64), (u64, Instant)>,
}

/// What chitchat says of a peer, for [`Liveness::state`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Detector {
    /// Heartbeats arrive.
    Live,
    /// The phi-accrual detector gave up on it.
    Dead,
    /// Neither yet (just learned of).
    Unknown,
}

impl Liveness {
    /// Records the peer's heartbeat; returns how long it has not advanced.
    pub fn observe(&mut self, node: &str, generation: u64, heartbeat: u64, now: Instant) -> Duration {
        let e = self.heard.entry((node.to_string(), generation)).or_insert((heartbeat, now));
        if e.0 != heartbeat {
            *e = (heartbeat, now);
        }
        now.saturating_duration_since(e.1)
    }

    /// The peer's state: `dead` only once the detector fired *and* it has been silent for
    /// [`MIN_DEAD_SILENCE`] (chitchat's phi can fire on a short silence right after startup,
    /// when a few bursty samples make the mean gap tiny); otherwise what it gossips, or
    /// `joining` while the detector does not know it yet or its state is unreadable.
    pub fn state(detector: Detector, silent: Duration, gossiped: Option<&str>) -> NodeState {
        let claimed = gossiped.and_then(|s| decode_state(s).ok()).unwrap_or(NodeState::Joining);
        match detector {
            Detector::Dead if silent >= MIN_DEAD_SILENCE => NodeState::Dead,
            Detector::Dead | Detector::Live => claimed,
            Detector::Unknown => NodeState::Joining,
        }
    }

    /// Forgets peers not in `seen` (node, generation).
    pub fn retain(&mut self, seen: &HashSet<(String, u64)>) {
        self.heard.retain(|k, _| seen.contains(k));
    }

    pub fn len(&self) -> usize {
        self.heard.len()
    }

    pub fn is_empty(&self) -> bool {
        self.heard.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_round_trip_and_garbage_is_refused_without_panic() {
        let hs = vec![0, 1, u64::MAX, 0x0123_4567_89ab_cdef];
        assert_eq!(decode_digest(&encode_digest(&hs)).unwrap(), hs);
        assert_eq!(decode_digest("").unwrap(), Vec::<u64>::new());
        // Non-ASCII: 'é' is two bytes, so byte-offset slicing would split it.
        for bad in ["é123456789abcdef", "0123456789abcdeé", "0123456789abcdeg", "0123", "日本語日本語日本語日本語日本", "\u{0}000000000000000"] {
            assert!(decode_digest(bad).is_err(), "{bad:?} must be refused");
        }
        assert!(matches!(decode_digest(&"0".repeat(MAX_VALUE_BYTES + 16)), Err(GossipError::TooLarge(_))));
    }

    #[test]
    fn signals_and_descriptions_are_validated() {
        let good = WorkerSignals { kv_blocks_total: 10, kv_blocks_free: 5, kv_blocks_cached: 2, block_size: 4, memory_limit_bytes: 9, memory_used_bytes: 3, ..Default::default() };
        assert_eq!(decode_signals(&encode_signals(&good)).unwrap(), good);
        let mut cases = vec![];
        for f in [
            |s: &mut WorkerSignals| s.kv_blocks_free = 11,
            |s: &mut WorkerSignals| s.kv_blocks_cached = 6,
            |s: &mut WorkerSignals| s.kv_blocks_pinned = 11,
            |s: &mut WorkerSignals| s.block_size = 0,
            |s: &mut WorkerSignals| s.kv_fragmentation_ratio = 2.0,
            |s: &mut WorkerSignals| s.prefix_hit_ratio = -0.5,
            |s: &mut WorkerSignals| s.tokens_per_second = -1.0,
            |s: &mut WorkerSignals| s.prefill_us_per_token = f32::NAN,
            |s: &mut WorkerSignals| s.memory_used_bytes = 10,
            |s: &mut WorkerSignals| s.draft_accepted_total = 1,
        ] {
            let mut s = good.clone();
            f(&mut s);
            cases.push(encode_signals(&s));
        }
        cases.extend(["{".into(), "null".into(), "\"é\"".into(), "{\"kv_blocks_total\": -1}".into(), "ü".repeat(10)]);
        for c in cases {
            assert!(decode_signals(&c).is_err(), "{c} must be refused");
        }
        // NaN cannot be written as JSON at all; serde_json writes null, which is refused.
        let mut nan = good.clone();
        nan.prefix_hit_ratio = f32::NAN;
        assert!(decode_signals(&encode_signals(&nan)).is_err());

        let d = WorkerDesc { device: "cuda:0".into(), model: "qwen2.5-coder-0.5b".into(), max_waiting: 256 };
        assert_eq!(decode_desc(&encode_desc(&d)).unwrap(), d);
        for bad in [r#"{"device":"cpu é","model":"m","max_waiting":1}"#, r#"{"device":"","model":"m","max_waiting":1}"#, r#"{"device":"cpu","model":"m","max_waiting":4294967295}"#, r#"{"device":"cpu","model":"m m","max_waiting":1}"#, r#"{"device":"cpu","max_waiting":1}"#, "[]"] {
            assert!(decode_desc(bad).is_err(), "{bad}");
        }
        assert_eq!(worker_of_key("w:cpu0"), Some("cpu0"));
        assert_eq!(worker_of_key("w:cpü"), None);
        assert_eq!(worker_of_key("sig:cpu0"), None);
        assert_eq!(decode_state("ready").unwrap(), NodeState::Ready);
        assert_eq!(decode_count("12").unwrap(), 12);
        for bad in ["", "-1", "1.5", "99999999999", "١٢", "12 "] {
            assert!(decode_count(bad).is_err(), "{bad:?}");
        }
        assert!(decode_state("réady").is_err());
    }

    #[test]
    fn local_digest_publishes_only_changed_shards() {
        let mut d = LocalDigest::default();
        assert_eq!(d.take_dirty().len(), 16, "every shard is published once at first");
        assert!(d.take_dirty().is_empty());
        let (a, b) = (0x1000_0000_0000_0001u64, 0x2000_0000_0000_0002u64);
        assert!(d.apply(KvEvent::Stored { hashes: vec![a, b] }));
        assert!(!d.apply(KvEvent::Stored { hashes: vec![a] }), "no change, no dirt");
        let dirty = d.take_dirty();
        assert_eq!(dirty, vec![(1, encode_digest(&[a])), (2, encode_digest(&[b]))]);
        d.apply(KvEvent::Evicted { hashes: vec![a] });
        assert_eq!(d.take_dirty(), vec![(1, String::new())]);
        d.resync([b]);
        assert_eq!(d.take_dirty().len(), 16);
        assert_eq!(d.set().len(), 1);
    }

    #[test]
    fn shards_multiply_as_the_cache_grows_and_no_value_passes_the_limit() {
        let mut d = LocalDigest::default();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let hashes: Vec<u64> = (0..200_000)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x
            })
            .collect();
        d.apply(KvEvent::Stored { hashes: hashes.clone() });
        let shards = d.take_dirty();
        assert_eq!(d.bits(), 7, "200,000 hashes: 128 shards of ~1,560");
        assert_eq!(shards.len(), 128);
        assert!(shards.iter().all(|(_, v)| v.len() <= MAX_VALUE_BYTES), "largest shard {} bytes", shards.iter().map(|(_, v)| v.len()).max().unwrap());
        // A reader rebuilds exactly the set.
        let mut r = RemoteDigests::default();
        let versions = vec![1u64; 128];
        let (set, errors) = r.get("b", 1, "cpu0", 7, &versions, |s| shards.iter().find(|(i, _)| *i == s).map(|(_, v)| v.clone()));
        assert!(errors.is_empty());
        assert_eq!(set.len(), hashes.len());
        assert!(decode_shard_bits("13").is_err() && decode_shard_bits("3").is_err() && decode_shard_bits("7").is_ok());
    }

    #[test]
    fn a_lagging_reader_knows_it_must_resync() {
        let (tx, mut rx) = tokio::sync::broadcast::channel(4);
        let mut d = LocalDigest::default();
        for h in 1..=10u64 {
            tx.send(KvEvent::Stored { hashes: vec![h] }).unwrap();
        }
        let (changed, lagged) = d.drain(&mut rx);
        assert!(changed && lagged, "6 of 10 events were lost");
        assert_eq!(d.set().len(), 4, "only the last 4 arrived");
        d.resync(1..=10);
        assert_eq!(d.set().len(), 10);
        tx.send(KvEvent::Evicted { hashes: vec![3] }).unwrap();
        assert_eq!(d.drain(&mut rx), (true, false));
        assert_eq!(d.set().len(), 9);
    }

    #[test]
    fn remote_digests_reparse_on_version_change_and_forget_the_unseen() {
        let mut r = RemoteDigests::default();
        let h = 0x3000_0000_0000_0003u64;
        let value = encode_digest(&[h]);
        let mut versions = vec![0u64; 16];
        versions[3] = 1;
        let (set, errs) = r.get("b", 7, "cpu0", 4, &versions, |s| (s == 3).then(|| value.clone()));
        assert!(errs.is_empty());
        assert!(set.contains(&h));
        // Same versions: the cached set, without reading the shards.
        let (again, _) = r.get("b", 7, "cpu0", 4, &versions, |_| panic!("must not re-read"));
        assert!(Arc::ptr_eq(&set, &again));
        // A malformed shard and a hash in the wrong shard are dropped; the rest stays usable.
        versions[3] = 2;
        versions[4] = 1;
        let wrong_shard = encode_digest(&[h]);
        let (set, errs) = r.get("b", 7, "cpu0", 4, &versions, |s| match s {
            3 => Some("zz".into()),
            4 => Some(wrong_shard.clone()),
            _ => None,
        });
        assert_eq!(errs.len(), 1);
        assert!(set.is_empty());
        r.get("c", 1, "cpu0", 4, &versions, |_| None);
        assert_eq!(r.len(), 2);
        r.retain(&[("c".to_string(), 1, "cpu0".to_string())].into_iter().collect());
        assert_eq!(r.len(), 1);
    }

    #[test]
    fn dead_only_after_the_detector_and_enough_silence() {
        let mut l = Liveness::default();
        let t0 = Instant::now();
        assert_eq!(l.observe("b", 1, 5, t0), Duration::ZERO);
        let silent = l.observe("b", 1, 5, t0 + Duration::from_millis(1400));
        assert_eq!(Liveness::state(Detector::Dead, silent, Some("ready")), NodeState::Ready, "never dead before 1.5 s of silence");
        let silent = l.observe("b", 1, 5, t0 + Duration::from_millis(1600));
        assert_eq!(Liveness::state(Detector::Dead, silent, Some("ready")), NodeState::Dead);
        assert_eq!(Liveness::state(Detector::Live, silent, Some("ready")), NodeState::Ready, "the detector decides first");
        // A heartbeat that advances resets the silence.
        assert_eq!(l.observe("b", 1, 6, t0 + Duration::from_millis(1700)), Duration::ZERO);
        assert_eq!(Liveness::state(Detector::Unknown, Duration::ZERO, Some("ready")), NodeState::Joining);
        assert_eq!(Liveness::state(Detector::Live, Duration::ZERO, Some("réady")), NodeState::Joining, "unreadable state");
        assert_eq!(Liveness::state(Detector::Live, Duration::ZERO, Some("draining")), NodeState::Draining);
        l.observe("c", 1, 0, t0);
        l.retain(&[("c".to_string(), 1)].into_iter().collect());
        assert_eq!(l.len(), 1);
    }
}
