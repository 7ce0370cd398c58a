//! Placement: which worker in the cluster runs a request. A pure function (sans-IO, no clock)
//! over a [`ClusterView`] (see [`crate::view`]) and a [`RequestSummary`]; the coordinator builds the view from local
//! worker signals and gossip, calls [`place`], and logs the decision.
//!
//! Algorithm (the form SGLang's cache-aware router and Dynamo's KV router converged on):
//! 1. **Hard filters.** A worker is skipped if its node is not `ready`; its waiting queue is
//!    full; its memory is over `memory_high_water`; or its free + evictable KV blocks cannot hold
//!    the uncached part of the prompt plus `decode_headroom_blocks`. If capacity is the only
//!    reason every worker was skipped (KV space, or memory over the high-water mark, which on a
//!    worker whose KV pool is reserved at startup is KV held by running sequences), the request
//!    is placed anyway (by the same policy, among those workers) and waits in that worker's
//!    bounded queue for blocks to free up: a burst of long prompts queues, as on a single
//!    engine, instead of failing with 529. A full queue or a node that is not ready still
//!    refuses.
//! 2. **Policy.**
//!    - `round_robin`: the `rr`-th candidate in (node, worker) order.
//!    - `least_loaded`: fewest running + waiting sequences, then fewest active blocks.
//!    - `cache_aware`: first the imbalance guard — when `max load − min load > abs` and
//!      `max > rel × min`, pick by load alone. Otherwise the argmin of
//!      `overlap_weight × uncached_prefill_blocks + active_decode_blocks
//!       + queue_weight × waiting_prefill_blocks + remote_hop_blocks (if remote)
//!       + fragmentation_weight × fragmentation + memory_weight × (memory use − soft limit)⁺`.
//! 3. **Ties** (equal cost within 1e-9) go to the local worker, then to the `rr`-th of the tied
//!    candidates, so equal workers share the work instead of the first one taking it all.
//!
//! **Fetch** (`cache_aware` with `fetch`): another worker of the model may cache more of the
//! prompt's prefix than a candidate (a busy one, or one on a draining node, which placement
//! skips but which still serves its blocks). A candidate may then pull those blocks before it
//! prefills: its cost counts them as cached, plus `fetch ratio × overlap_weight` per fetched
//! block (and the hop, for a holder on another node). The ratio is what a fetched block costs
//! against computing it: this node's recently measured seconds per fetched block over the
//! candidate's measured prefill time for those positions, or `fetch_cost_prior` until both are
//! known. A node a fetch recently failed from is no holder. "Wait for
//! the holder" is the holder's own cost, "recompute" the candidate's without a fetch; the least
//! of all wins.
//!
//! **Disk tier.** A worker's set also names the blocks only its disk tier holds
//! (`zerolayer_common::disk_name`). The prompt's blocks after its RAM prefix that the worker
//! holds on disk are read back before it prefills, so each counts as `disk_hit_cost` of an
//! uncached block: a disk hit is priced between a RAM hit and a miss. The KV-space filter still
//! counts them as uncached (they need RAM blocks).
//!
//! The prefix overlap is exact: a worker's cached set holds the chained block hashes it caches
//! (see `zerolayer_common::hash`), and a prompt's overlap is its longest prefix of blocks in it.

use serde::Serialize;
use zerolayer_common::{PlacementConfig, PlacementPolicy};

use crate::view::{ClusterView, NodeState, WorkerView};

/// What placement needs to know about a request.
#[derive(Clone, Debug)]
pub struct RequestSummary {
    /// Chained hashes of the prompt's full blocks.
    pub block_hashes: Vec<u64>,
    pub prompt_tokens: usize,
    pub max_tokens: usize,
    /// Seconds this node has measured per fetched block, if it has fetched recently.
    pub fetch_secs_per_block: Option<f64>,
    /// Nodes not to fetch from (a fetch from them failed recently).
    pub avoid_holders: Vec<String>,
}

/// Why a worker was skipped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Skip {
    NotReady,
    /// The worker's backend is gone (its signals say `unavailable`).
    Unavailable,
    QueueFull,
    Memory,
    KvSpace,
}

/// A scored candidate (for the decision log and tests).
#[derive(Clone, Debug, PartialEq)]
pub struct Scored {
    pub index: usize,
    pub cost: f64,
    pub cached_blocks: usize,
    /// Blocks to fetch from another worker first, if that is how this candidate was priced.
    pub fetch: Option<FetchPlan>,
}

/// Prefix blocks a worker pulls from another before it runs a request.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FetchPlan {
    /// The holder, an index into the view.
    pub holder: usize,
    /// Blocks of the chain the chosen worker caches (the fetch starts after them).
    pub have: usize,
    /// Blocks of the chain the holder caches.
    pub blocks: usize,
}

/// The workers that could serve a fetch of `req`'s prefix, with how many of its blocks each
/// caches: any worker of a ready or draining node that still runs.
fn holders(view: &ClusterView, req: &RequestSummary) -> Vec<(usize, usize)> {
    view.workers
        .iter()
        .enumerate()
        .filter(|(_, w)| matches!(w.state, NodeState::Ready | NodeState::Draining) && !w.signals.unavailable && !req.avoid_holders.contains(&w.node))
        .map(|(i, w)| (i, cached_prefix_blocks(w, &req.block_hashes)))
        .filter(|&(_, n)| n > 0)
        .collect()
}

/// What fetching blocks `have..blocks` costs against computing them on `w` (see the module's
/// doc): the measured seconds per fetched block over `w`'s measured prefill time for those
/// positions (its per-token term, and its attention term over the pairs they attend).
fn fetch_ratio(w: &WorkerView, req: &RequestSummary, cfg: &PlacementConfig, have: usize, blocks: usize) -> f64 {
    let bs = w.signals.block_size.max(1) as f64;
    let (from, to) = (have as f64 * bs, blocks as f64 * bs);
    let pairs = (to * to - from * from) / 2.0;
    let recompute_secs = (w.signals.prefill_us_per_token as f64 * (to - from) + w.signals.prefill_us_per_kilo_pair as f64 * pairs / 1e3) * 1e-6;
    match req.fetch_secs_per_block {
        Some(f) if w.signals.prefill_us_per_token > 0.0 && recompute_secs > 0.0 && f.is_finite() => (f * (blocks - have) as f64 / recompute_secs).clamp(0.01, 10.0),
        _ => cfg.fetch_cost_prior,
    }
}

/// The candidate `i` (caching `cached` blocks) scored, with a fetch where one lowers its cost.
fn score(view: &ClusterView, req: &RequestSummary, cfg: &PlacementConfig, holders: &[(usize, usize)], i: usize, cached: usize) -> Scored {
    let w = &view.workers[i];
    let plain = Scored { index: i, cost: cost(w, req, cached, cfg), cached_blocks: cached, fetch: None };
    let best = holders.iter().filter(|&&(j, n)| j != i && n >= cached + cfg.min_fetch_blocks.max(1) as usize).max_by_key(|&&(j, n)| (n, std::cmp::Reverse(j)));
    let Some(&(holder, blocks)) = best.filter(|_| cfg.fetch) else { return plain };
    let fetched = (blocks - cached) as f64;
    let hop = if view.workers[holder].node != w.node { cfg.remote_hop_blocks } else { 0.0 };
    let with_fetch = cost(w, req, blocks, cfg) + fetch_ratio(w, req, cfg, cached, blocks) * cfg.overlap_weight * fetched + hop;
    if with_fetch < plain.cost {
        Scored { index: i, cost: with_fetch, cached_blocks: cached, fetch: Some(FetchPlan { holder, have: cached, blocks }) }
    } else {
        plain
    }
}

/// The outcome of placement.
#[derive(Clone, Debug, PartialEq)]
pub enum Decision {
    /// Run on `view.workers[index]`. `ranked` holds the candidates, best first (cost order for
    /// `cache_aware`; for other policies the chosen one first).
    Place { index: usize, cached_blocks: usize, reason: &'static str, ranked: Vec<Scored> },
    /// No worker passed the filters.
    NoWorker { skipped: Vec<(usize, Skip)> },
}

/// Blocks of prompt that `w` already caches: the longest prefix of `hashes` in its set.
pub fn cached_prefix_blocks(w: &WorkerView, hashes: &[u64]) -> usize {
    hashes.iter().take_while(|h| w.cached.contains(h)).count()
}

/// Blocks of prompt after its first `from` that `w` holds in RAM or on its disk tier (named
/// [`zerolayer_common::disk_name`]), up to the first it holds in neither: what a restore reads
/// back instead of recomputing.
pub fn disk_tail_blocks(w: &WorkerView, hashes: &[u64], from: usize) -> usize {
    hashes.iter().skip(from).take_while(|&&h| w.cached.contains(&zerolayer_common::disk_name(h)) || w.cached.contains(&h)).count()
}

fn load(w: &WorkerView) -> u32 {
    w.signals.running.saturating_add(w.signals.waiting)
}

fn memory_ratio(w: &WorkerView) -> f64 {
    if w.signals.memory_limit_bytes == 0 {
        0.0
    } else {
        w.signals.memory_used_bytes as f64 / w.signals.memory_limit_bytes as f64
    }
}

fn filter(w: &WorkerView, req: &RequestSummary, cached: usize, cfg: &PlacementConfig) -> Option<Skip> {
    if w.state != NodeState::Ready {
        return Some(Skip::NotReady);
    }
    if w.signals.unavailable {
        return Some(Skip::Unavailable);
    }
    if w.signals.waiting >= w.max_waiting {
        return Some(Skip::QueueFull);
    }
    if memory_ratio(w) > cfg.memory_high_water {
        return Some(Skip::Memory);
    }
    let bs = w.signals.block_size.max(1) as usize;
    let prompt_blocks = req.prompt_tokens.div_ceil(bs);
    let headroom = (req.max_tokens.div_ceil(bs)).min(cfg.decode_headroom_blocks as usize);
    // Cached blocks are reused in place, so only the rest needs free (or evictable) blocks.
    let need = prompt_blocks.saturating_sub(cached) + headroom;
    if (w.signals.kv_blocks_free as usize) < need {
        return Some(Skip::KvSpace);
    }
    None
}

/// The cache-aware cost of running `req` on `w`, given `cached` blocks already there.
pub fn cost(w: &WorkerView, req: &RequestSummary, cached: usize, cfg: &PlacementConfig) -> f64 {
    let bs = w.signals.block_size.max(1) as f64;
    let prompt_blocks = (req.prompt_tokens as f64 / bs).ceil();
    // Blocks on the worker's disk tier are read back, at `disk_hit_cost` of a computed one.
    let on_disk = if w.signals.kv_disk.blocks > 0 { disk_tail_blocks(w, &req.block_hashes, cached) as f64 } else { 0.0 };
    let uncached = (prompt_blocks - cached as f64 - on_disk * (1.0 - cfg.disk_hit_cost)).max(0.0);
    let queued = w.signals.waiting_prefill_tokens as f64 / bs;
    let mut c = cfg.overlap_weight * uncached + w.signals.active_decode_blocks as f64 + cfg.queue_weight * queued;
    if !w.local {
        c += cfg.remote_hop_blocks;
    }
    c += cfg.fragmentation_weight * w.signals.kv_fragmentation_ratio.clamp(0.0, 1.0) as f64;
    c += cfg.memory_weight * (memory_ratio(w) - cfg.memory_soft_limit).max(0.0);
    c
}

/// Chooses a worker for `req`. `rr` is a counter the caller increments per request (round-robin
/// and tie-breaking); the same inputs always give the same decision.
pub fn place(view: &ClusterView, req: &RequestSummary, cfg: &PlacementConfig, rr: usize) -> Decision {
    let mut skipped = Vec::new();
    let mut cands: Vec<(usize, usize)> = Vec::new(); // (index, cached blocks)
    let mut kv_short: Vec<(usize, usize)> = Vec::new(); // skipped only for capacity
    for (i, w) in view.workers.iter().enumerate() {
        let cached = cached_prefix_blocks(w, &req.block_hashes);
        match filter(w, req, cached, cfg) {
            Some(s) => {
                if matches!(s, Skip::KvSpace | Skip::Memory) {
                    kv_short.push((i, cached));
                }
                skipped.push((i, s));
            }
            None => cands.push((i, cached)),
        }
    }
    let kv_wait = cands.is_empty();
    if kv_wait {
        if kv_short.is_empty() {
            return Decision::NoWorker { skipped };
        }
        cands = kv_short;
    }
    let decision = place_among(view, req, cfg, rr, cands);
    match decision {
        Decision::Place { index, cached_blocks, ranked, .. } if kv_wait => Decision::Place { index, cached_blocks, reason: "queued_for_kv", ranked },
        d => d,
    }
}

fn place_among(view: &ClusterView, req: &RequestSummary, cfg: &PlacementConfig, rr: usize, mut cands: Vec<(usize, usize)>) -> Decision {
    // A stable order, whatever order the view was built in.
    cands.sort_by(|a, b| {
        let (x, y) = (&view.workers[a.0], &view.workers[b.0]);
        (&x.node, &x.worker).cmp(&(&y.node, &y.worker))
    });
    let pick = |i: usize, cached: usize, reason: &'static str, ranked: Vec<Scored>| Decision::Place { index: i, cached_blocks: cached, reason, ranked };
    match cfg.policy {
        PlacementPolicy::RoundRobin => {
            let (i, c) = cands[rr % cands.len()];
            pick(i, c, "round_robin", vec![Scored { index: i, cost: 0.0, cached_blocks: c, fetch: None }])
        }
        PlacementPolicy::LeastLoaded => {
            let (i, c) = least_loaded(view, &cands, rr);
            pick(i, c, "least_loaded", vec![Scored { index: i, cost: load(&view.workers[i]) as f64, cached_blocks: c, fetch: None }])
        }
        PlacementPolicy::CacheAware => {
            let loads: Vec<u32> = cands.iter().map(|&(i, _)| load(&view.workers[i])).collect();
            let (max, min) = (*loads.iter().max().unwrap(), *loads.iter().min().unwrap());
            if max - min > cfg.balance_abs_threshold && max as f64 > cfg.balance_rel_threshold * min as f64 {
                let (i, c) = least_loaded(view, &cands, rr);
                return pick(i, c, "imbalance_guard", vec![Scored { index: i, cost: load(&view.workers[i]) as f64, cached_blocks: c, fetch: None }]);
            }
            let holders = if cfg.fetch { holders(view, req) } else { Vec::new() };
            let mut ranked: Vec<Scored> = cands.iter().map(|&(i, c)| score(view, req, cfg, &holders, i, c)).collect();
            ranked.sort_by(|a, b| a.cost.total_cmp(&b.cost));
            let best = ranked[0].cost;
            let tied: Vec<&Scored> = ranked.iter().filter(|s| s.cost - best <= 1e-9).collect();
            let chosen = tied
                .iter()
                .find(|s| view.workers[s.index].local)
                .copied()
                .unwrap_or_else(|| tied[rr % tied.len()]);
            let (i, c) = (chosen.index, chosen.cached_blocks);
            // Best first: move the chosen one to the front.
            let pos = ranked.iter().position(|s| s.index == i).unwrap();
            let first = ranked.remove(pos);
            let reason = if first.fetch.is_some() {
                "prefix_fetch"
            } else if c > 0 {
                "prefix_hit"
            } else if view.workers[i].signals.kv_disk.blocks > 0 && disk_tail_blocks(&view.workers[i], &req.block_hashes, 0) > 0 {
                "disk_hit"
            } else {
                "lowest_cost"
            };
            ranked.insert(0, first);
            pick(i, c, reason, ranked)
        }
    }
}

fn least_loaded(view: &ClusterView, cands: &[(usize, usize)], rr: usize) -> (usize, usize) {
    let key = |i: usize| {
        let w = &view.workers[i];
        (load(w), w.signals.active_decode_blocks as u64 + w.signals.waiting_prefill_tokens / w.signals.block_size.max(1) as u64)
    };
    let best = cands.iter().map(|&(i, _)| key(i)).min().unwrap();
    let tied: Vec<&(usize, usize)> = cands.iter().filter(|&&(i, _)| key(i) == best).collect();
    *tied[rr % tied.len()]
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use zerolayer_common::WorkerSignals;

    fn w(node: &str, local: bool) -> WorkerView {
        let signals = WorkerSignals { kv_blocks_total: 1000, kv_blocks_free: 1000, block_size: 16, memory_limit_bytes: 1000, memory_used_bytes: 100, ..Default::default() };
        crate::view::test_worker(node, local, signals)
    }

    fn req(blocks: usize) -> RequestSummary {
        RequestSummary { block_hashes: (1..=blocks as u64).collect(), prompt_tokens: blocks * 16 + 5, max_tokens: 64, fetch_secs_per_block: None, avoid_holders: vec![] }
    }

    fn with_cache(mut v: WorkerView, n: u64) -> WorkerView {
        v.cached = Arc::new((1..=n).collect());
        v
    }

    fn chosen(d: &Decision) -> usize {
        match d {
            Decision::Place { index, .. } => *index,
            Decision::NoWorker { skipped } => panic!("no worker: {skipped:?}"),
        }
    }

    fn cfg(policy: PlacementPolicy) -> PlacementConfig {
        PlacementConfig { policy, ..Default::default() }
    }

    #[test]
    fn each_hard_filter_skips_its_worker() {
        let c = cfg(PlacementPolicy::CacheAware);
        let r = req(10);
        // (mutation, expected skip) — the broken worker is the only local one, and it would win.
        let cases: Vec<(fn(&mut WorkerView), Skip)> = vec![
            (|w| w.state = NodeState::Draining, Skip::NotReady),
            (|w| w.state = NodeState::Dead, Skip::NotReady),
            (|w| w.state = NodeState::Joining, Skip::NotReady),
            (|w| w.signals.unavailable = true, Skip::Unavailable),
            (|w| w.signals.waiting = 8, Skip::QueueFull),
            (|w| w.signals.memory_used_bytes = 990, Skip::Memory),
            (|w| w.signals.kv_blocks_free = 4, Skip::KvSpace), // needs 1 uncached block + 4 headroom
        ];
        for (mutate, skip) in cases {
            let mut a = with_cache(w("a", true), 10);
            mutate(&mut a);
            let view = ClusterView { workers: vec![a, w("b", false)] };
            let d = place(&view, &r, &c, 0);
            assert_eq!(chosen(&d), 1, "{skip:?}: the filtered worker must not be chosen");
            let only = ClusterView { workers: vec![view.workers[0].clone()] };
            if matches!(skip, Skip::KvSpace | Skip::Memory) {
                // Short of capacity everywhere: it queues on that worker rather than failing.
                let Decision::Place { index, reason, .. } = place(&only, &r, &c, 0) else { panic!("KV-short worker refused") };
                assert_eq!((index, reason), (0, "queued_for_kv"));
            } else {
                assert_eq!(place(&only, &r, &c, 0), Decision::NoWorker { skipped: vec![(0, skip)] });
            }
        }
        // KV-short and queue-full: the KV-short one takes it; both queue-full: refused.
        let mut a = w("a", true);
        a.signals.kv_blocks_free = 0;
        let mut b = w("b", false);
        b.signals.waiting = 8;
        assert_eq!(chosen(&place(&ClusterView { workers: vec![a, b.clone()] }, &r, &c, 0)), 0);
        let mut b2 = b.clone();
        b2.worker = "w2".into();
        assert!(matches!(place(&ClusterView { workers: vec![b, b2] }, &r, &c, 0), Decision::NoWorker { .. }));
        // Cached blocks do not need free space: 1 uncached block + 4 headroom fits in 5.
        let mut a = with_cache(w("a", true), 10);
        a.signals.kv_blocks_free = 5;
        assert_eq!(chosen(&place(&ClusterView { workers: vec![a] }, &r, &c, 0)), 0);
    }

    #[test]
    fn prefix_hits_beat_a_hop_and_moderate_load() {
        // Without fetch (with it, the idle local worker would pull the 37 blocks: see
        // `a_prefix_held_elsewhere_is_fetched_where_that_costs_less`).
        let c = PlacementConfig { fetch: false, ..cfg(PlacementPolicy::CacheAware) };
        let r = req(37);
        let mut remote_hit = with_cache(w("b", false), 37);
        remote_hit.signals.active_decode_blocks = 20;
        remote_hit.signals.running = 2;
        let view = ClusterView { workers: vec![w("a", true), remote_hit, w("c", false)] };
        let d = place(&view, &r, &c, 0);
        assert_eq!(chosen(&d), 1);
        let Decision::Place { cached_blocks, reason, ranked, .. } = d else { unreachable!() };
        assert_eq!((cached_blocks, reason), (37, "prefix_hit"));
        // remote hit: 1 + 20 + 8 hop; local: 38 uncached blocks; remote miss: 38 + 8.
        let costs: Vec<f64> = ranked.iter().map(|s| s.cost).collect();
        assert_eq!(costs, vec![29.0, 38.0, 46.0]);
        // A partial overlap counts only the leading run of blocks.
        let mut holes = w("b", false);
        holes.cached = Arc::new([1u64, 2, 4, 5, 6].into_iter().collect());
        assert_eq!(cached_prefix_blocks(&holes, &r.block_hashes), 2);
    }

    #[test]
    fn a_disk_hit_is_priced_between_a_ram_hit_and_a_miss() {
        let c = PlacementConfig { fetch: false, ..cfg(PlacementPolicy::CacheAware) };
        // Real block hashes are odd; their disk names even.
        let hashes: Vec<u64> = (0..40u64).map(|i| 2 * i + 1).collect();
        let r = RequestSummary { block_hashes: hashes.clone(), ..req(40) };
        let on_disk = |v: WorkerView, ram: usize| {
            let mut v = v;
            v.signals.kv_disk.blocks = 100;
            v.cached = Arc::new(hashes[..ram].iter().copied().chain(hashes[ram..].iter().map(|&h| zerolayer_common::disk_name(h))).collect());
            v
        };
        let (miss, disk) = (w("a", true), on_disk(w("b", true), 0));
        let mut ram = w("c", true);
        ram.cached = Arc::new(hashes.iter().copied().collect());
        // 41 prompt blocks; 40 on disk at 0.2 of a computed one: 41 − 40 × 0.8 = 9.
        let costs = [cost(&miss, &r, 0, &c), cost(&disk, &r, 0, &c), cost(&ram, &r, 40, &c)];
        assert_eq!(costs.map(|x| (x * 1e6).round() / 1e6), [41.0, 9.0, 1.0]);
        let mixed = on_disk(w("d", true), 25);
        assert_eq!((cached_prefix_blocks(&mixed, &hashes), disk_tail_blocks(&mixed, &hashes, 25)), (25, 15));
        assert!((cost(&mixed, &r, 25, &c) - (16.0 - 15.0 * 0.8)).abs() < 1e-9);
        // Without a disk tier in its signals, a worker's even names are not read as disk hits.
        let mut silent = disk.clone();
        silent.signals.kv_disk.blocks = 0;
        assert_eq!(cost(&silent, &r, 0, &c), 41.0);
        let d = place(&ClusterView { workers: vec![miss.clone(), disk.clone()] }, &r, &c, 0);
        assert!(matches!(d, Decision::Place { index: 1, reason: "disk_hit", .. }), "{d:?}");
        assert_eq!(chosen(&place(&ClusterView { workers: vec![miss, disk, ram] }, &r, &c, 0)), 2, "RAM beats disk");
    }

    #[test]
    fn heavy_load_outweighs_a_prefix_hit() {
        let c = cfg(PlacementPolicy::CacheAware);
        let mut hit = with_cache(w("a", true), 37);
        hit.signals.active_decode_blocks = 200;
        hit.signals.waiting_prefill_tokens = 16 * 100;
        let view = ClusterView { workers: vec![hit, w("b", false)] };
        assert_eq!(chosen(&place(&view, &req(37), &c, 0)), 1);
    }

    #[test]
    fn imbalance_guard_overrides_the_cache() {
        let c = cfg(PlacementPolicy::CacheAware);
        let mut hit = with_cache(w("a", true), 37);
        hit.signals.running = 20; // load 20 vs 2: over abs 16 and rel 1.5
        let mut other = w("b", false);
        other.signals.running = 2;
        let view = ClusterView { workers: vec![hit.clone(), other.clone()] };
        let d = place(&view, &req(37), &c, 0);
        assert!(matches!(d, Decision::Place { index: 1, reason: "imbalance_guard", .. }), "{d:?}");
        // Within the absolute threshold the cache still wins.
        hit.signals.running = 10;
        let view = ClusterView { workers: vec![hit, other] };
        assert!(matches!(place(&view, &req(37), &c, 0), Decision::Place { index: 0, reason: "prefix_hit", .. }));
    }

    #[test]
    fn ties_prefer_local_then_rotate() {
        let c = cfg(PlacementPolicy::CacheAware);
        let view = ClusterView { workers: vec![w("c", false), w("a", true), w("b", false)] };
        for rr in 0..4 {
            assert_eq!(chosen(&place(&view, &req(3), &c, rr)), 1, "the local worker wins a tie");
        }
        // Two equal remote workers (the local one is busy): the counter alternates between them.
        let mut busy = w("a", true);
        busy.signals.active_decode_blocks = 50;
        let view = ClusterView { workers: vec![w("c", false), busy, w("b", false)] };
        let picks: Vec<usize> = (0..4).map(|rr| chosen(&place(&view, &req(3), &c, rr))).collect();
        assert_eq!(picks, vec![2, 0, 2, 0], "b, c, b, c in (node, worker) order");
    }

    #[test]
    fn round_robin_and_least_loaded_ignore_the_cache() {
        let view = ClusterView { workers: vec![with_cache(w("a", true), 37), w("b", false), w("c", false)] };
        let rr: Vec<usize> = (0..6).map(|k| chosen(&place(&view, &req(37), &cfg(PlacementPolicy::RoundRobin), k))).collect();
        assert_eq!(rr, vec![0, 1, 2, 0, 1, 2]);
        let mut v = view.clone();
        v.workers[0].signals.running = 3;
        v.workers[1].signals.running = 1;
        v.workers[2].signals.running = 1;
        v.workers[2].signals.active_decode_blocks = 9;
        for k in 0..3 {
            assert_eq!(chosen(&place(&v, &req(37), &cfg(PlacementPolicy::LeastLoaded), k)), 1, "fewest sequences, then fewest blocks");
        }
        // Filters apply to every policy.
        v.workers[1].state = NodeState::Dead;
        for k in 0..3 {
            assert_ne!(chosen(&place(&v, &req(37), &cfg(PlacementPolicy::RoundRobin), k)), 1);
        }
    }

    #[test]
    fn fragmentation_and_memory_pressure_add_cost() {
        let c = cfg(PlacementPolicy::CacheAware);
        let mut frag = w("a", false);
        frag.signals.kv_fragmentation_ratio = 0.5;
        let view = ClusterView { workers: vec![frag.clone(), w("b", false)] };
        assert_eq!(chosen(&place(&view, &req(4), &c, 0)), 1);
        let mut mem = w("a", false);
        mem.signals.memory_used_bytes = 950; // 0.95 > soft 0.85, below high water 0.97
        let view = ClusterView { workers: vec![mem, w("b", false)] };
        let d = place(&view, &req(4), &c, 0);
        let Decision::Place { index, ranked, .. } = d else { panic!() };
        assert_eq!(index, 1);
        assert!((ranked[1].cost - (5.0 + 8.0 + 64.0 * 0.1)).abs() < 1e-9, "{ranked:?}");
    }

    /// The holder of a prefix is on a draining node (skipped, but serving its blocks): the
    /// chosen worker fetches them, priced by the prior ratio until fetches and prefill speed
    /// are measured, and by their ratio then. No fetch where it is off, short, or dearer than
    /// recomputing.
    #[test]
    fn a_prefix_held_elsewhere_is_fetched_where_that_costs_less() {
        let c = cfg(PlacementPolicy::CacheAware);
        let mut holder = with_cache(w("a", true), 40);
        holder.state = NodeState::Draining;
        let view = ClusterView { workers: vec![holder, w("b", false), with_cache(w("c", false), 2)] };
        let r = req(40);
        let d = place(&view, &r, &c, 0);
        let Decision::Place { index, reason, ranked, .. } = &d else { panic!("{d:?}") };
        assert_eq!((*index, *reason), (2, "prefix_fetch"), "{ranked:?}");
        assert_eq!(ranked[0].fetch, Some(FetchPlan { holder: 0, have: 2, blocks: 40 }));
        // Not from a node a fetch recently failed from.
        let avoiding = RequestSummary { avoid_holders: vec!["a".into()], ..r.clone() };
        assert!(matches!(place(&view, &avoiding, &c, 0), Decision::Place { ref ranked, .. } if ranked[0].fetch.is_none()));
        // Off, it recomputes where it caches most.
        let off = PlacementConfig { fetch: false, ..c.clone() };
        assert!(matches!(place(&view, &r, &off, 0), Decision::Place { index: 2, reason: "prefix_hit", ref ranked, .. } if ranked[0].fetch.is_none()));
        // Too few blocks to be worth a round trip.
        assert!(matches!(place(&view, &req(5), &c, 0), Decision::Place { ref ranked, .. } if ranked[0].fetch.is_none()));
        // Measured: a fetched block takes 2 ms, computing one 0.1 ms × 16 = 1.6 ms (no attention
        // term): recompute.
        let mut slow = view.clone();
        for w in &mut slow.workers {
            w.signals.prefill_us_per_token = 100.0;
        }
        let measured = |s: f64| RequestSummary { fetch_secs_per_block: Some(s), ..r.clone() };
        assert!(matches!(place(&slow, &measured(0.002), &c, 0), Decision::Place { ref ranked, .. } if ranked[0].fetch.is_none()));
        assert!(matches!(place(&slow, &measured(0.0002), &c, 0), Decision::Place { ref ranked, .. } if ranked[0].fetch.is_some()));
        // The attention term counts: the 38 blocks from position 32 to 640 are 6.1 ms of tokens
        // at 10 µs each, and attend ~204k pairs, 20.4 ms more at 100 µs per 1,000. Fetching them
        // at 0.4 ms a block (15.2 ms) pays only with the attention term.
        for (kilo_pair_us, fetched) in [(0.0, false), (100.0, true)] {
            for w in &mut slow.workers {
                w.signals.prefill_us_per_token = 10.0;
                w.signals.prefill_us_per_kilo_pair = kilo_pair_us;
            }
            assert!(matches!(place(&slow, &measured(0.0004), &c, 0), Decision::Place { ref ranked, .. } if ranked[0].fetch.is_some() == fetched));
        }
    }
}
