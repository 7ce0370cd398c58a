//! API keys, the admin key, and who a caller is.
//!
//! - Keys come from `[auth]` (inline, a file, or named `[[auth.keys]]` with their own settings).
//!   With none configured the API is open; the node says so at startup.
//! - A key is accepted as `x-api-key` or `Authorization: Bearer`. Comparison is constant-time
//!   over the bytes, and keys never reach logs: callers are named by tenant (`key#3`, or the
//!   configured name).
//! - `/admin/*` needs the admin key; a valid user key there gets 403.
//! - Each caller is a tenant of the [`Quota`] (limits held cluster-wide): the guard admits its
//!   requests, and every response carries its `anthropic-ratelimit-*` headers.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::http::{HeaderMap, HeaderValue};
use zerolayer_common::config::CacheScope;
use zerolayer_common::{ClusterConfig, Job, Share, Tenant, TenantLimits};

use crate::error::ApiError;
use crate::quota::{Quota, Refusal, Ticket};

/// Who is calling. Never holds the key itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Caller {
    /// Auth is disabled (no keys configured).
    Open,
    /// The user key (tenant) at this index.
    User(usize),
    Admin,
}

/// Authentication, and each caller's tenant and limits.
pub struct Guard {
    keys: Vec<Vec<u8>>,
    admin: Option<Vec<u8>>,
    /// The user tenants, then `open`, then `admin`.
    tenants: Vec<Tenant>,
    pub quota: Arc<Quota>,
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
        let mut tenants = cfg.tenants()?;
        let keys = tenants.iter().map(|t| t.key.clone().into_bytes()).collect();
        tenants.push(Tenant { name: "open".into(), key: String::new(), weight: 1.0, allow_ignore_eos: true, allow_fallback: true, cache_scope: CacheScope::Shared, limits: cfg.default_limits() });
        tenants.push(Tenant { name: "admin".into(), key: String::new(), weight: 1.0, allow_ignore_eos: true, allow_fallback: true, cache_scope: CacheScope::Shared, limits: TenantLimits::default() });
        let quota = Quota::new(tenants.iter().map(|t| (t.name.clone(), t.limits)).collect());
        Ok(Guard { keys, admin: cfg.auth.admin_key.clone().map(String::into_bytes), tenants, quota })
    }

    /// The caller's index among the tenants.
    fn index(&self, caller: &Caller) -> usize {
        let users = self.tenants.len() - 2;
        match caller {
            Caller::User(i) => (*i).min(users),
            Caller::Open => users,
            Caller::Admin => users + 1,
        }
    }

    pub fn tenant(&self, caller: &Caller) -> &Tenant {
        &self.tenants[self.index(caller)]
    }

    /// The tenant of this name (a configured key's name, `open` or `admin`).
    pub fn tenant_named(&self, name: &str) -> Option<&Tenant> {
        self.tenants.iter().find(|t| t.name == name)
    }

    /// A forwarded job as this node's config says it runs: the claimed tenant must be one of
    /// this node's (with keys enforced here, `open` is not), its weight and options are this
    /// node's, and its cache scope is recomputed from the claim with the cluster's secret.
    /// Whatever share, root or option the sender set is replaced or refused.
    pub fn rederive(&self, mut job: Job, secret: &[u8; 32]) -> Result<Job, String> {
        let name = job.claim.tenant.as_str();
        let tenant = self.tenant_named(name).filter(|t| !(self.enabled() && t.name == "open"));
        let tenant = tenant.ok_or_else(|| format!("tenant {:?} is not configured on this node", name.chars().take(64).collect::<String>()))?;
        if job.params.ignore_eos && !tenant.allow_ignore_eos {
            return Err(format!("ignore_eos is not enabled for tenant {}", tenant.name));
        }
        let salt = job.claim.cache_salt.as_deref();
        if salt.is_some_and(|s| s.is_empty() || s.chars().count() > 256) {
            return Err("cache_salt: expected a string of 1 to 256 characters".into());
        }
        job.share = Share::of(&tenant.name, tenant.weight);
        job.cache_root = zerolayer_common::scope_root(secret, &tenant.cache_scope_name(salt));
        Ok(job)
    }

    /// Whether API keys are enforced.
    pub fn enabled(&self) -> bool {
        !self.keys.is_empty()
    }

    /// The key a call presents: `x-api-key`, or a bearer token.
    pub(crate) fn presented(headers: &HeaderMap) -> Option<&[u8]> {
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

    /// Admits a request of the caller: a concurrency slot and, for a generation (`request`),
    /// one unit of its request limit.
    pub fn admit(&self, caller: &Caller, request: bool) -> Result<Ticket, ApiError> {
        self.quota.admit(self.index(caller), request).map_err(rate_limited)
    }

    /// The `anthropic-ratelimit-*` headers for this caller: each configured limit, as this node
    /// knows it across the cluster.
    pub fn add_headers(&self, caller: &Caller, h: &mut HeaderMap) {
        let now = SystemTime::now();
        for l in self.quota.limits(self.index(caller)) {
            let name = l.dim.as_str();
            let mut put = |suffix: &str, v: String| {
                if let (Ok(n), Ok(v)) = (axum::http::HeaderName::try_from(format!("anthropic-ratelimit-{name}-{suffix}")), HeaderValue::from_str(&v)) {
                    h.insert(n, v);
                }
            };
            put("limit", l.limit.to_string());
            put("remaining", l.remaining.to_string());
            put("reset", crate::clock::rfc3339_system(now + l.full_in));
        }
    }
}

/// A refusal as the API's 429.
pub fn rate_limited(r: Refusal) -> ApiError {
    match r.retry_after {
        Some(wait) => {
            let secs = (wait.as_secs() + u64::from(wait.subsec_nanos() > 0)).max(1);
            ApiError::RateLimited { message: format!("rate limit exceeded: {}; retry after {secs} s", r.what), retry_after_secs: secs }
        }
        None => ApiError::RateLimited {
            message: format!("rate limit exceeded: this request alone is more than the key's {}", r.what),
            retry_after_secs: Duration::from_secs(60).as_secs(),
        },
    }
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

    /// A forwarded job runs under the receiving node's terms: its weight, its options, and a
    /// cache root recomputed from the claim; an unknown tenant, or `open` where keys are
    /// enforced, is refused.
    #[test]
    fn a_forwarded_job_is_rederived_from_this_nodes_config() {
        use zerolayer_common::config::KeyConfig;
        use zerolayer_common::{SamplingParams, TenantClaim};
        let mut cfg = ClusterConfig::default();
        cfg.auth.keys = vec![
            KeyConfig { name: "alice".into(), key: "sk-alice-0000".into(), weight: 2.0, ..Default::default() },
            KeyConfig { name: "bob".into(), key: "sk-bob-00000".into(), allow_ignore_eos: true, cache_scope: CacheScope::Shared, ..Default::default() },
        ];
        let g = Guard::from_config(&cfg).unwrap();
        let secret = [7u8; 32];
        let claim = |t: &str, salt: Option<&str>| TenantClaim { tenant: t.into(), cache_salt: salt.map(str::to_string) };
        let forged = Job::new(vec![1, 2, 3], SamplingParams::greedy(4)).shared(Share::of("alice", 1000.0)).scoped(0xbad);
        let j = g.rederive(forged.clone().claimed(claim("alice", None)), &secret).unwrap();
        assert_eq!(j.share, Share::of("alice", 2.0), "the weight is this node's");
        assert_eq!(j.cache_root, zerolayer_common::scope_root(&secret, "key:alice"), "the root comes from the claim");
        let salted = g.rederive(forged.clone().claimed(claim("alice", Some("s"))), &secret).unwrap();
        assert_eq!(salted.cache_root, zerolayer_common::scope_root(&secret, "key:alice\0salt:s"));
        let j = g.rederive(forged.clone().claimed(claim("bob", None)), &secret).unwrap();
        assert_eq!((j.share, j.cache_root), (Share::of("bob", 1.0), zerolayer_common::scope_root(&secret, "shared")));
        let mut eos = forged.clone().claimed(claim("alice", None));
        eos.params.ignore_eos = true;
        assert!(g.rederive(eos.clone(), &secret).unwrap_err().contains("ignore_eos"));
        eos.claim.tenant = "bob".into();
        assert!(g.rederive(eos, &secret).is_ok(), "bob may");
        for (t, salt) in [("mallory", None), ("open", None), ("", None), ("alice", Some(""))] {
            assert!(g.rederive(forged.clone().claimed(claim(t, salt)), &secret).is_err(), "{t:?} {salt:?}");
        }
        let open = Guard::from_config(&ClusterConfig::default()).unwrap();
        assert!(open.rederive(forged.claimed(claim("open", None)), &secret).is_ok(), "an open node runs open jobs");
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
