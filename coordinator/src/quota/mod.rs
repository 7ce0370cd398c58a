//! Per-key limits held across the whole cluster.
//!
//! - **Buckets.** Each node keeps, per tenant (one API key), a token bucket for each configured
//!   limit: requests, tokens (input + output), input tokens and output tokens per minute
//!   ([`bucket`]). Its own charges are taken at once; every other node's arrive through gossip
//!   and are taken as they arrive, into debt if they no longer fit ([`ledger`]).
//! - **Gossip.** Each node publishes, per tenant it served, its totals since it started, what of
//!   them fell in the last minute, and its requests in flight (`q:<tenant>`, [`wire`]). A reader
//!   charges the growth of the totals (or, on first sight, the last minute), and sums the
//!   in-flight counts for the concurrency cap. Values are signed by their node like every gossiped
//!   value, and validated like a client's.
//! - **The bound.** A node sees another's charges one propagation delay `D` after they happen
//!   (about `publish_interval_ms` plus two gossip rounds: ~300 ms with the defaults). So over any
//!   interval `T` a key gets at most `limit + rate × T` plus what the *other* nodes admitted for it
//!   in the last `D`, which they had not yet heard of: nothing for a client that moves between
//!   nodes more slowly than `D`, and at most `(N - 1) × limit` for simultaneous bursts on all `N`
//!   nodes. The same holds for the concurrency cap with `limit` the cap. Charges learned late
//!   become debt (at most one minute's worth), so the long-run rate is exact.
//! - **Tickets.** An admitted request holds a [`Ticket`]: its concurrency slot, released when the
//!   ticket drops, and the handle that charges its output tokens as they are generated.
//!
//! The ledger is pure (every method takes `now`); [`Quota`] is its thin shell (a mutex and the
//! clock).

pub mod bucket;
pub mod ledger;
pub mod wire;

use std::collections::HashSet;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use zerolayer_common::TenantLimits;

pub use ledger::{Dim, LimitState, Peer, Refusal, TenantUsage};
pub use wire::Counts;
use ledger::Ledger;

/// One node's ledger, shared by the API (admission and charges) and the gossip publisher.
pub struct Quota {
    ledger: Mutex<Ledger>,
}

impl Quota {
    /// One entry per tenant, in the order callers index them.
    pub fn new(tenants: Vec<(String, TenantLimits)>) -> Arc<Quota> {
        Arc::new(Quota { ledger: Mutex::new(Ledger::new(tenants, Instant::now())) })
    }

    fn ledger(&self) -> MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Admits one request of `tenant` (a generation takes a unit of the request limit when
    /// `request`): its concurrency slot is held by the ticket.
    pub fn admit(self: &Arc<Self>, tenant: usize, request: bool) -> Result<Ticket, Refusal> {
        self.ledger().admit(tenant, request, Instant::now())?;
        Ok(Ticket { quota: self.clone(), tenant })
    }

    /// Every configured limit of the tenant, now (for the response headers).
    pub fn limits(&self, tenant: usize) -> Vec<LimitState> {
        self.ledger().limits(tenant, Instant::now())
    }

    /// This node's gossip values (`q:<tenant>`).
    pub fn publish(&self) -> Vec<(String, String)> {
        self.ledger().publish(Instant::now())
    }

    /// Takes in one gossiped value from `peer`.
    pub fn observe(&self, peer: &Peer, tenant: &str, value: &str) -> Result<(), wire::WireError> {
        self.ledger().observe(peer, tenant, value, Instant::now())
    }

    /// Forgets peers that are no longer live.
    pub fn retain(&self, live: &HashSet<Peer>) {
        self.ledger().retain(live)
    }

    /// Peers whose usage is held (bounded by the live nodes).
    pub fn peers(&self) -> usize {
        self.ledger().peers()
    }

    /// Every tenant with usage (for `/admin/status`).
    pub fn usage(&self) -> Vec<TenantUsage> {
        self.ledger().usage(Instant::now())
    }
}

/// An admitted request: its tenant's concurrency slot (released on drop) and its charges.
pub struct Ticket {
    quota: Arc<Quota>,
    tenant: usize,
}

impl Ticket {
    /// Charges the prompt's tokens if they fit (`generation`: a generation, which also needs
    /// output budget left).
    pub fn charge_input(&self, n: u64, generation: bool) -> Result<(), Refusal> {
        self.quota.ledger().charge_input(self.tenant, n, generation, Instant::now())
    }

    /// Charges generated tokens.
    pub fn charge_output(&self, n: u64) {
        if n > 0 {
            self.quota.ledger().charge_output(self.tenant, n, Instant::now())
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.quota.ledger().release(self.tenant)
    }
}
