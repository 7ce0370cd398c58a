//! API keys, the admin key, and per-key rate limits.
//!
//! - Keys come from `[auth]` (inline or a file). With none configured the API is open; the node
//!   says so at startup.
//! - A key is accepted as `x-api-key` or `Authorization: Bearer`. Comparison is constant-time
//!   over the bytes, and keys never reach logs: callers are named by index (`key#3`).
//! - `/admin/*` needs the admin key; a valid user key there gets 403.
//! - Rate limits are GCRA token buckets from `governor`, one per key: requests per minute,
//!   checked before the request is handled, and prompt tokens per minute, charged once the
//!   prompt is tokenized. Every response carries `anthropic-ratelimit-*` headers.

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use axum::http::{HeaderMap, HeaderValue};
use governor::clock::{Clock, DefaultClock};
use governor::middleware::StateInformationMiddleware;
use governor::state::keyed::DefaultKeyedStateStore;
use governor::{Quota, RateLimiter};
use zerolayer_common::ClusterConfig;

use crate::error::ApiError;

type Limiter = RateLimiter<String, DefaultKeyedStateStore<String>, DefaultClock, StateInformationMiddleware>;

/// Who is calling. Never holds the key itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Caller {
    /// Auth is disabled (no keys configured).
    Open,
    /// The user key at this index.
    User(usize),
    Admin,
}

impl Caller {
    fn bucket(&self) -> String {
        match self {
            Caller::Open => "open".into(),
            Caller::User(i) => format!("key#{i}"),
            Caller::Admin => "admin".into(),
        }
    }
}

struct Bucket {
    limiter: Limiter,
    per_minute: u32,
}

impl Bucket {
    fn new(per_minute: u32) -> Option<Self> {
        NonZeroU32::new(per_minute)
            .map(|n| Bucket { limiter: RateLimiter::keyed(Quota::per_minute(n)).with_middleware::<StateInformationMiddleware>(), per_minute })
    }

    /// Takes `n` units; on refusal returns how long until they would fit.
    fn take(&self, key: &String, n: u32) -> Result<u32, Duration> {
        let Some(n) = NonZeroU32::new(n) else { return Ok(self.per_minute) };
        match self.limiter.check_key_n(key, n) {
            Ok(Ok(snap)) => Ok(snap.remaining_burst_capacity()),
            Ok(Err(not_until)) => Err(not_until.wait_time_from(DefaultClock::default().now())),
            Err(_) => Err(Duration::from_secs(60)), // more than a whole minute's budget
        }
    }

    /// When the bucket would be full again, given `remaining`.
    fn reset_at(&self, remaining: u32) -> SystemTime {
        let per_unit = Duration::from_secs(60) / self.per_minute;
        SystemTime::now() + per_unit * self.per_minute.saturating_sub(remaining)
    }
}

/// Authentication and rate limiting for one node.
pub struct Guard {
    keys: Vec<Vec<u8>>,
    admin: Option<Vec<u8>>,
    requests: Option<Bucket>,
    tokens: Option<Bucket>,
    /// Last known remaining capacity per bucket key, for response headers. Bounded by the
    /// number of configured keys (+ admin + open).
    last: Mutex<HashMap<String, (u32, u32)>>,
}

/// Constant-time equality over the bytes (the length is not secret).
fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let mut diff = 0u8;
    for (x, y) in a.iter().zip(b) {
        diff |= x ^ y;
    }
    std::hint::black_box(diff) == 0
}

impl Guard {
    pub fn from_config(cfg: &ClusterConfig) -> anyhow::Result<Self> {
        let keys = cfg.api_keys()?.into_iter().map(String::into_bytes).collect();
        Ok(Guard {
            keys,
            admin: cfg.auth.admin_key.clone().map(String::into_bytes),
            requests: Bucket::new(cfg.limits.requests_per_minute),
            tokens: Bucket::new(cfg.limits.tokens_per_minute),
            last: Mutex::new(HashMap::new()),
        })
    }

    /// Whether API keys are enforced.
    pub fn enabled(&self) -> bool {
        !self.keys.is_empty()
    }

    fn presented(headers: &HeaderMap) -> Option<&[u8]> {
        if let Some(v) = headers.get("x-api-key") {
            return Some(v.as_bytes());
        }
        let auth = headers.get("authorization")?.as_bytes();
        let prefix = b"Bearer ";
        (auth.len() > prefix.len() && auth[..prefix.len()].eq_ignore_ascii_case(prefix)).then(|| &auth[prefix.len()..])
    }

    fn identify(&self, key: &[u8]) -> Option<Caller> {
        // Check every key, so timing does not reveal which one matched.
        let mut found = None;
        for (i, k) in self.keys.iter().enumerate() {
            if ct_eq(k, key) && found.is_none() {
                found = Some(Caller::User(i));
            }
        }
        if let Some(a) = &self.admin {
            if ct_eq(a, key) {
                found = Some(Caller::Admin);
            }
        }
        found
    }

    /// Authenticates an API call.
    pub fn authorize_api(&self, headers: &HeaderMap) -> Result<Caller, ApiError> {
        if !self.enabled() {
            return Ok(Caller::Open);
        }
        match Self::presented(headers) {
            None => Err(ApiError::Authentication("x-api-key header is required".into())),
            Some(k) => self.identify(k).ok_or_else(|| ApiError::Authentication("invalid x-api-key".into())),
        }
    }

    /// Authenticates an admin call: the admin key, or (with no admin key configured and auth
    /// disabled) an open dev node.
    pub fn authorize_admin(&self, headers: &HeaderMap) -> Result<Caller, ApiError> {
        if self.admin.is_none() && !self.enabled() {
            return Ok(Caller::Open);
        }
        match Self::presented(headers).map(|k| self.identify(k)) {
            None => Err(ApiError::Authentication("an admin key is required (x-api-key)".into())),
            Some(None) => Err(ApiError::Authentication("invalid x-api-key".into())),
            Some(Some(Caller::Admin)) => Ok(Caller::Admin),
            Some(Some(_)) => Err(ApiError::Permission("this key may not use the admin API".into())),
        }
    }

    fn remember(&self, caller: &Caller, requests: Option<u32>, tokens: Option<u32>) {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        let e = last.entry(caller.bucket()).or_insert((
            self.requests.as_ref().map_or(0, |b| b.per_minute),
            self.tokens.as_ref().map_or(0, |b| b.per_minute),
        ));
        if let Some(r) = requests {
            e.0 = r;
        }
        if let Some(t) = tokens {
            e.1 = t;
        }
    }

    /// Takes one request from the caller's bucket.
    pub fn take_request(&self, caller: &Caller) -> Result<(), ApiError> {
        let Some(b) = &self.requests else { return Ok(()) };
        match b.take(&caller.bucket(), 1) {
            Ok(rem) => {
                self.remember(caller, Some(rem), None);
                Ok(())
            }
            Err(wait) => {
                self.remember(caller, Some(0), None);
                Err(rate_limited("requests per minute", wait))
            }
        }
    }

    /// Charges `n` prompt tokens to the caller's bucket.
    pub fn take_tokens(&self, caller: &Caller, n: usize) -> Result<(), ApiError> {
        let Some(b) = &self.tokens else { return Ok(()) };
        match b.take(&caller.bucket(), n.min(u32::MAX as usize) as u32) {
            Ok(rem) => {
                self.remember(caller, None, Some(rem));
                Ok(())
            }
            Err(wait) => Err(rate_limited("input tokens per minute", wait)),
        }
    }

    /// The `anthropic-ratelimit-*` headers for this caller.
    pub fn add_headers(&self, caller: &Caller, h: &mut HeaderMap) {
        let (rr, tr) = self.last.lock().unwrap_or_else(|e| e.into_inner()).get(&caller.bucket()).copied().unwrap_or((
            self.requests.as_ref().map_or(0, |b| b.per_minute),
            self.tokens.as_ref().map_or(0, |b| b.per_minute),
        ));
        for (name, bucket, remaining) in [("requests", &self.requests, rr), ("tokens", &self.tokens, tr)] {
            if let Some(b) = bucket {
                let mut put = |suffix: &str, v: String| {
                    if let Ok(v) = HeaderValue::from_str(&v) {
                        h.insert(axum::http::HeaderName::try_from(format!("anthropic-ratelimit-{name}-{suffix}")).unwrap(), v);
                    }
                };
                put("limit", b.per_minute.to_string());
                put("remaining", remaining.to_string());
                put("reset", crate::clock::rfc3339_system(b.reset_at(remaining)));
            }
        }
    }
}

fn rate_limited(what: &str, wait: Duration) -> ApiError {
    let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    ApiError::RateLimited { message: format!("rate limit exceeded: {what}; retry after {secs} s"), retry_after_secs: secs.max(1) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constant_time_eq_is_eq() {
        assert!(ct_eq(b"abcdefgh", b"abcdefgh"));
        assert!(!ct_eq(b"abcdefgh", b"abcdefgX"));
        assert!(!ct_eq(b"abc", b"abcd"));
    }

    #[test]
    fn keys_and_admin() {
        let mut cfg = ClusterConfig::default();
        cfg.auth.api_keys = vec!["user-key-1".into()];
        cfg.auth.admin_key = Some("admin-key-1".into());
        let g = Guard::from_config(&cfg).unwrap();
        let h = |k: &str| {
            let mut m = HeaderMap::new();
            m.insert("x-api-key", k.parse().unwrap());
            m
        };
        let mut bearer = HeaderMap::new();
        bearer.insert("authorization", "Bearer user-key-1".parse().unwrap());
        assert_eq!(g.authorize_api(&h("user-key-1")).unwrap(), Caller::User(0));
        assert_eq!(g.authorize_api(&bearer).unwrap(), Caller::User(0));
        assert_eq!(g.authorize_api(&h("nope-nope")).unwrap_err().status(), 401);
        assert_eq!(g.authorize_api(&HeaderMap::new()).unwrap_err().status(), 401);
        assert_eq!(g.authorize_admin(&h("user-key-1")).unwrap_err().status(), 403);
        assert_eq!(g.authorize_admin(&h("admin-key-1")).unwrap(), Caller::Admin);
    }
}
