//! The per-tenant ledger of one node: its buckets (which take in every node's charges), its own
//! usage (what it gossips), and what it last saw of each peer's. Pure: no I/O, no clock.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use zerolayer_common::TenantLimits;

use super::bucket::Bucket;
use super::wire::{self, Counts, PeerUsage, WireError};

/// The limits a tenant can hit, in header order (`anthropic-ratelimit-<name>-*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dim {
    Requests,
    Tokens,
    InputTokens,
    OutputTokens,
}

impl Dim {
    pub const ALL: [Dim; 4] = [Dim::Requests, Dim::Tokens, Dim::InputTokens, Dim::OutputTokens];

    /// The header name part.
    pub fn as_str(self) -> &'static str {
        match self {
            Dim::Requests => "requests",
            Dim::Tokens => "tokens",
            Dim::InputTokens => "input-tokens",
            Dim::OutputTokens => "output-tokens",
        }
    }

    /// How a refusal names it.
    pub fn describe(self) -> &'static str {
        match self {
            Dim::Requests => "requests per minute",
            Dim::Tokens => "tokens per minute",
            Dim::InputTokens => "input tokens per minute",
            Dim::OutputTokens => "output tokens per minute",
        }
    }

    fn of(self, l: &TenantLimits) -> u32 {
        match self {
            Dim::Requests => l.requests_per_minute,
            Dim::Tokens => l.tokens_per_minute,
            Dim::InputTokens => l.input_tokens_per_minute,
            Dim::OutputTokens => l.output_tokens_per_minute,
        }
    }
}

/// Why a tenant was refused, and when to try again (`None`: the request alone exceeds a whole
/// minute's budget).
#[derive(Clone, Debug, PartialEq)]
pub struct Refusal {
    pub what: &'static str,
    pub retry_after: Option<Duration>,
}

/// One limit's state, for the `anthropic-ratelimit-*` headers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LimitState {
    pub dim: Dim,
    pub limit: u32,
    pub remaining: u32,
    pub full_in: Duration,
}

/// The last minute of a tenant's local usage, in 12 slots of 5 s.
#[derive(Clone, Debug, Default)]
struct Recent {
    slots: [(u64, Counts); 12],
}

const SLOT_SECS: u64 = 5;

impl Recent {
    fn add(&mut self, slot: u64, c: Counts) {
        let s = &mut self.slots[(slot % 12) as usize];
        if s.0 != slot {
            *s = (slot, Counts::default());
        }
        s.1.add(&c);
    }

    fn sum(&self, slot: u64) -> Counts {
        let mut out = Counts::default();
        for (s, c) in &self.slots {
            if *s + 12 > slot && *s <= slot {
                out.add(c);
            }
        }
        out
    }
}

struct TenantState {
    name: String,
    limits: TenantLimits,
    buckets: [Option<Bucket>; 4],
    inflight: u32,
    totals: Counts,
    recent: Recent,
}

impl TenantState {
    fn bucket(&mut self, d: Dim) -> Option<&mut Bucket> {
        self.buckets[d as usize].as_mut()
    }

    fn take(&mut self, c: Counts, now: Instant) {
        for (d, n) in [(Dim::Requests, c.requests), (Dim::Tokens, c.input + c.output), (Dim::InputTokens, c.input), (Dim::OutputTokens, c.output)] {
            if n > 0 {
                if let Some(b) = self.bucket(d) {
                    b.take(n as f64, now);
                }
            }
        }
    }
}

/// What a peer node last gossiped about one tenant.
#[derive(Clone, Copy, Debug)]
struct Seen {
    totals: Counts,
    inflight: u32,
}

/// `c`, each count capped at one minute of its limit where the tenant has one (requests; input
/// tokens by the input or the total limit; output tokens by the output or the total limit).
fn at_most_a_minute(c: Counts, l: &TenantLimits) -> Counts {
    let cap = |n: u64, limits: &[u32]| limits.iter().filter(|&&x| x > 0).map(|&x| x as u64).min().map_or(n, |m| n.min(m));
    Counts {
        requests: cap(c.requests, &[l.requests_per_minute]),
        input: cap(c.input, &[l.input_tokens_per_minute, l.tokens_per_minute]),
        output: cap(c.output, &[l.output_tokens_per_minute, l.tokens_per_minute]),
    }
}

/// A peer node: its id and generation (a restarted node is a new peer).
pub type Peer = (String, u64);

/// One tenant's usage across the cluster, for `/admin/status`.
#[derive(Clone, Debug, serde::Serialize)]
pub struct TenantUsage {
    pub tenant: String,
    /// This node's totals since it started.
    pub local: Counts,
    /// Requests open now: here, and on every node this one hears from.
    pub inflight_here: u32,
    pub inflight_cluster: u32,
    /// Per limit: (name, limit, remaining).
    pub remaining: Vec<(&'static str, u32, u32)>,
}

pub struct Ledger {
    tenants: Vec<TenantState>,
    by_name: HashMap<String, usize>,
    peers: HashMap<Peer, HashMap<usize, Seen>>,
    epoch: Instant,
}

impl Ledger {
    /// One entry per tenant, in the order callers index them.
    pub fn new(tenants: Vec<(String, TenantLimits)>, now: Instant) -> Ledger {
        let by_name = tenants.iter().enumerate().map(|(i, (n, _))| (n.clone(), i)).collect();
        let tenants = tenants
            .into_iter()
            .map(|(name, limits)| TenantState {
                name,
                limits,
                buckets: Dim::ALL.map(|d| Bucket::new(d.of(&limits), now)),
                inflight: 0,
                totals: Counts::default(),
                recent: Recent::default(),
            })
            .collect();
        Ledger { tenants, by_name, peers: HashMap::new(), epoch: now }
    }

    fn slot(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.epoch).as_secs() / SLOT_SECS
    }

    fn record(&mut self, t: usize, c: Counts, now: Instant) {
        let slot = self.slot(now);
        let s = &mut self.tenants[t];
        s.totals.add(&c);
        s.recent.add(slot, c);
        s.take(c, now);
    }

    /// Requests the tenant has open across the cluster, as far as this node knows.
    pub fn inflight(&self, t: usize) -> u32 {
        self.tenants[t].inflight + self.peers.values().filter_map(|m| m.get(&t)).map(|s| s.inflight).sum::<u32>()
    }

    /// Admits one request: a concurrency slot and, when `request`, one unit of the request
    /// limit. Call [`Ledger::release`] when it ends.
    pub fn admit(&mut self, t: usize, request: bool, now: Instant) -> Result<(), Refusal> {
        let cap = self.tenants[t].limits.max_concurrent_requests;
        if cap > 0 && self.inflight(t) >= cap {
            return Err(Refusal { what: "concurrent requests", retry_after: Some(Duration::from_secs(1)) });
        }
        if request {
            if let Some(b) = self.tenants[t].bucket(Dim::Requests) {
                match b.wait_for(1.0, now) {
                    Some(w) if w.is_zero() => {}
                    w => return Err(Refusal { what: Dim::Requests.describe(), retry_after: w }),
                }
            }
            self.record(t, Counts { requests: 1, ..Default::default() }, now);
        }
        self.tenants[t].inflight += 1;
        Ok(())
    }

    pub fn release(&mut self, t: usize) {
        let s = &mut self.tenants[t];
        s.inflight = s.inflight.saturating_sub(1);
    }

    /// Charges `n` input tokens if they fit the token and input limits; a generation
    /// (`generation`) also needs some output budget left.
    pub fn charge_input(&mut self, t: usize, n: u64, generation: bool, now: Instant) -> Result<(), Refusal> {
        let s = &mut self.tenants[t];
        let mut checks = vec![(Dim::Tokens, n as f64), (Dim::InputTokens, n as f64)];
        if generation {
            checks.push((Dim::OutputTokens, 1.0));
        }
        for (d, need) in checks {
            if let Some(b) = s.bucket(d) {
                match b.wait_for(need, now) {
                    Some(w) if w.is_zero() => {}
                    w => return Err(Refusal { what: d.describe(), retry_after: w }),
                }
            }
        }
        self.record(t, Counts { input: n, ..Default::default() }, now);
        Ok(())
    }

    /// Charges `n` generated tokens (they were generated: taken into debt if need be).
    pub fn charge_output(&mut self, t: usize, n: u64, now: Instant) {
        if n > 0 {
            self.record(t, Counts { output: n, ..Default::default() }, now);
        }
    }

    /// Every configured limit of the tenant, now.
    pub fn limits(&mut self, t: usize, now: Instant) -> Vec<LimitState> {
        let s = &mut self.tenants[t];
        Dim::ALL
            .into_iter()
            .filter_map(|d| {
                let b = s.buckets[d as usize].as_mut()?;
                Some(LimitState { dim: d, limit: b.per_minute(), remaining: b.remaining(now), full_in: b.full_in(now) })
            })
            .collect()
    }

    /// This node's usage of every tenant it has served, as gossip values (`q:<tenant>`).
    pub fn publish(&self, now: Instant) -> Vec<(String, String)> {
        let slot = self.slot(now);
        self.tenants
            .iter()
            .filter(|s| !s.totals.is_zero() || s.inflight > 0)
            .map(|s| (wire::key(&s.name), wire::encode(&PeerUsage { totals: s.totals, inflight: s.inflight, recent: s.recent.sum(slot) })))
            .collect()
    }

    /// Takes in a peer's gossiped usage of a tenant: the growth of its totals since the last
    /// value seen (the last minute's usage, the first time or after its counts went back) is
    /// charged to this node's buckets, and its in-flight count replaces the last one. A tenant
    /// this node does not know is ignored.
    ///
    /// A peer is held to what it could have admitted under the same limits: at most the
    /// tenant's concurrency cap in flight, and at most one minute of each per-minute limit per
    /// value. So a peer that lies can use up a tenant's shared limits as far as an honest node
    /// serving that tenant flat out could, never further (a 2²⁰ in-flight report no longer locks
    /// the tenant out past what the cap itself does).
    pub fn observe(&mut self, peer: &Peer, tenant: &str, value: &str, now: Instant) -> Result<(), WireError> {
        let u = wire::decode(value)?;
        let Some(&t) = self.by_name.get(tenant) else { return Ok(()) };
        let limits = self.tenants[t].limits;
        let seen = self.peers.entry(peer.clone()).or_default();
        let fresh = match seen.get(&t) {
            Some(prev) if prev.totals.within(&u.totals) => u.totals.minus(&prev.totals),
            _ => u.recent,
        };
        let inflight = match limits.max_concurrent_requests {
            0 => u.inflight,
            cap => u.inflight.min(cap),
        };
        seen.insert(t, Seen { totals: u.totals, inflight });
        self.tenants[t].take(at_most_a_minute(fresh, &limits), now);
        Ok(())
    }

    /// Forgets peers no longer heard from (dead, or an old generation).
    pub fn retain(&mut self, live: &HashSet<Peer>) {
        self.peers.retain(|p, _| live.contains(p));
    }

    pub fn peers(&self) -> usize {
        self.peers.len()
    }

    /// Every tenant with usage here or on any peer heard from.
    pub fn usage(&mut self, now: Instant) -> Vec<TenantUsage> {
        let active: Vec<usize> =
            (0..self.tenants.len()).filter(|&t| !self.tenants[t].totals.is_zero() || self.tenants[t].inflight > 0 || self.peers.values().any(|m| m.contains_key(&t))).collect();
        active
            .into_iter()
            .map(|t| {
                let inflight_cluster = self.inflight(t);
                let remaining = self.limits(t, now).into_iter().map(|l| (l.dim.as_str(), l.limit, l.remaining)).collect();
                let s = &self.tenants[t];
                TenantUsage { tenant: s.name.clone(), local: s.totals, inflight_here: s.inflight, inflight_cluster, remaining }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(rpm: u32, tpm: u32, otpm: u32, conc: u32) -> TenantLimits {
        TenantLimits { requests_per_minute: rpm, tokens_per_minute: tpm, output_tokens_per_minute: otpm, max_concurrent_requests: conc, ..Default::default() }
    }

    /// Two nodes' ledgers, joined by hand the way gossip joins them.
    fn gossip(from: &Ledger, from_id: &str, to: &mut Ledger, now: Instant) {
        for (k, v) in from.publish(now) {
            to.observe(&(from_id.to_string(), 1), wire::tenant_of_key(&k).unwrap(), &v, now).unwrap();
        }
    }

    #[test]
    fn requests_on_one_node_count_on_the_other() {
        let t0 = Instant::now();
        let mk = || Ledger::new(vec![("key#0".into(), limits(6, 0, 0, 0)), ("key#1".into(), limits(6, 0, 0, 0))], t0);
        let (mut a, mut b) = (mk(), mk());
        for _ in 0..6 {
            a.admit(0, true, t0).unwrap();
            a.release(0);
        }
        gossip(&a, "a", &mut b, t0);
        let r = b.admit(0, true, t0).unwrap_err();
        assert_eq!(r.what, "requests per minute");
        assert_eq!(r.retry_after, Some(Duration::from_secs(10)));
        assert_eq!(b.limits(0, t0)[0].remaining, 0);
        // Another key is untouched; the same value again charges nothing more.
        b.admit(1, true, t0).unwrap();
        gossip(&a, "a", &mut b, t0);
        assert!(b.admit(0, true, t0 + Duration::from_secs(10)).is_ok());
        // A new charge on a: only the growth is taken.
        a.admit(0, true, t0 + Duration::from_secs(20)).unwrap();
        gossip(&a, "a", &mut b, t0 + Duration::from_secs(20));
        assert_eq!(b.limits(0, t0 + Duration::from_secs(20))[0].remaining, 0);
    }

    #[test]
    fn output_tokens_and_concurrency_are_shared() {
        let t0 = Instant::now();
        let mk = || Ledger::new(vec![("team".into(), limits(0, 0, 20, 2))], t0);
        let (mut a, mut b) = (mk(), mk());
        a.admit(0, true, t0).unwrap();
        a.charge_input(0, 100, true, t0).unwrap();
        a.charge_output(0, 20, t0);
        a.admit(0, true, t0).unwrap();
        gossip(&a, "a", &mut b, t0);
        // Two open on a: b refuses a third; its output budget is spent as well.
        assert_eq!(b.inflight(0), 2);
        assert_eq!(b.admit(0, true, t0).unwrap_err().what, "concurrent requests");
        a.release(0);
        a.release(0);
        gossip(&a, "a", &mut b, t0);
        b.admit(0, true, t0).unwrap();
        assert_eq!(b.charge_input(0, 10, true, t0).unwrap_err().what, "output tokens per minute");
        // count_tokens-style charges need no output budget.
        b.charge_input(0, 10, false, t0).unwrap();
        // A peer forgotten (dead) no longer holds slots.
        a.admit(0, true, t0).unwrap();
        a.admit(0, true, t0).unwrap();
        gossip(&a, "a", &mut b, t0);
        assert_eq!(b.inflight(0), 3);
        b.retain(&HashSet::new());
        assert_eq!(b.inflight(0), 1);
    }

    #[test]
    fn a_new_reader_charges_only_the_last_minute() {
        let t0 = Instant::now();
        let mk = || Ledger::new(vec![("key#0".into(), limits(0, 1000, 0, 0))], t0);
        let mut a = mk();
        a.admit(0, true, t0).unwrap();
        a.charge_input(0, 900, true, t0).unwrap();
        let later = t0 + Duration::from_secs(120);
        a.admit(0, true, later).unwrap();
        a.charge_input(0, 300, true, later).unwrap();
        // b starts after the first charge is two minutes old: it takes only the recent 300.
        let mut b = Ledger::new(vec![("key#0".into(), limits(0, 1000, 0, 0))], later);
        gossip(&a, "a", &mut b, later);
        assert_eq!(b.limits(0, later)[0].remaining, 700);
        // A restarted peer (counts went back) is read the same way.
        let mut a2 = mk();
        a2.admit(0, true, later).unwrap();
        a2.charge_input(0, 50, true, later).unwrap();
        gossip(&a2, "a", &mut b, later);
        assert_eq!(b.limits(0, later)[0].remaining, 650);
        // Unknown tenants are ignored; garbage is an error, not a panic.
        assert!(b.observe(&("a".into(), 1), "nobody", "1,1,1,0,1,1,1", later).is_ok());
        assert!(b.observe(&("a".into(), 1), "key#0", "1,1,1", later).is_err());
    }

    /// A peer's report is held to what a node could have admitted under the tenant's limits:
    /// 2²⁰ requests in flight count as the concurrency cap (the tenant is at its cap, as one
    /// honest node serving it flat out would put it, and is served again once the peer reports
    /// less), and a jump of a billion tokens charges one minute's budget, not a billion.
    #[test]
    fn a_peer_is_held_to_what_it_could_have_admitted() {
        let t0 = Instant::now();
        let mut b = Ledger::new(vec![("key#0".into(), limits(100, 1000, 0, 4))], t0);
        let liar = ("mallory".to_string(), 1);
        b.observe(&liar, "key#0", &format!("0,0,0,{},0,0,0", 1u32 << 20), t0).unwrap();
        assert_eq!(b.inflight(0), 4, "capped at the tenant's own cap");
        b.observe(&liar, "key#0", "0,0,0,1,0,0,0", t0).unwrap();
        assert_eq!(b.inflight(0), 1);
        b.admit(0, false, t0).expect("served again");
        b.observe(&liar, "key#0", "1000000000,1000000000,0,0,0,0,0", t0).unwrap();
        let later = t0 + Duration::from_secs(60);
        assert!(b.limits(0, later).iter().all(|l| l.remaining == l.limit), "one minute's budget taken, and refilled a minute later: {:?}", b.limits(0, later));
    }
}
