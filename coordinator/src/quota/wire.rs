//! A node's usage of one tenant as gossiped: key `q:<tenant>`, value seven decimal numbers
//! `requests,input,output,inflight,recent_requests,recent_input,recent_output`. The first three
//! are the node's totals since it started (a reader charges their growth); the last three are
//! what of them fell in the last minute (a reader that sees the node for the first time charges
//! those); `inflight` is the tenant's requests open there now.
//!
//! Validated like a client's data: only ASCII digits, bounded numbers, recent within totals.

pub const KEY_PREFIX: &str = "q:";
/// Totals are refused above this (a node would need centuries to reach it).
pub const MAX_TOTAL: u64 = 1 << 50;
/// In-flight counts are refused above this.
pub const MAX_INFLIGHT: u32 = 1 << 20;
const MAX_VALUE_BYTES: usize = 160;

/// Usage counted in the three units limits speak of.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Counts {
    pub requests: u64,
    pub input: u64,
    pub output: u64,
}

impl Counts {
    /// Whether every count is at most `other`'s.
    pub fn within(&self, other: &Counts) -> bool {
        self.requests <= other.requests && self.input <= other.input && self.output <= other.output
    }

    pub(super) fn minus(&self, o: &Counts) -> Counts {
        Counts { requests: self.requests - o.requests, input: self.input - o.input, output: self.output - o.output }
    }

    pub(super) fn add(&mut self, o: &Counts) {
        self.requests += o.requests;
        self.input += o.input;
        self.output += o.output;
    }

    pub(super) fn is_zero(&self) -> bool {
        *self == Counts::default()
    }
}

/// One node's usage of one tenant.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PeerUsage {
    pub totals: Counts,
    pub inflight: u32,
    pub recent: Counts,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("malformed usage value: {0}")]
    Malformed(String),
    #[error("usage out of range: {0}")]
    OutOfRange(String),
}

pub fn key(tenant: &str) -> String {
    format!("{KEY_PREFIX}{tenant}")
}

/// The tenant a `q:` key names, if the key is one and the name is acceptable (1..=64 ASCII
/// letters, digits, `-`, `_`, `.` or `#`).
pub fn tenant_of_key(k: &str) -> Option<&str> {
    let t = k.strip_prefix(KEY_PREFIX)?;
    let ok = !t.is_empty() && t.len() <= 64 && t.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'#'));
    ok.then_some(t)
}

pub fn encode(u: &PeerUsage) -> String {
    let (t, r) = (u.totals, u.recent);
    format!("{},{},{},{},{},{},{}", t.requests, t.input, t.output, u.inflight, r.requests, r.input, r.output)
}

pub fn decode(v: &str) -> Result<PeerUsage, WireError> {
    if v.len() > MAX_VALUE_BYTES {
        return Err(WireError::Malformed(format!("{} bytes", v.len())));
    }
    let mut n = [0u64; 7];
    let mut parts = v.split(',');
    for slot in n.iter_mut() {
        let p = parts.next().ok_or_else(|| WireError::Malformed("fewer than 7 fields".into()))?;
        if p.is_empty() || p.len() > 16 || !p.bytes().all(|b| b.is_ascii_digit()) {
            return Err(WireError::Malformed(format!("field {:?}", p.chars().take(20).collect::<String>())));
        }
        *slot = p.parse().map_err(|_| WireError::Malformed(p.to_string()))?;
        if *slot > MAX_TOTAL {
            return Err(WireError::OutOfRange(format!("{slot}")));
        }
    }
    if parts.next().is_some() {
        return Err(WireError::Malformed("more than 7 fields".into()));
    }
    let totals = Counts { requests: n[0], input: n[1], output: n[2] };
    let recent = Counts { requests: n[4], input: n[5], output: n[6] };
    if n[3] > MAX_INFLIGHT as u64 {
        return Err(WireError::OutOfRange(format!("inflight {}", n[3])));
    }
    if !recent.within(&totals) {
        return Err(WireError::OutOfRange("recent usage above the totals".into()));
    }
    Ok(PeerUsage { totals, inflight: n[3] as u32, recent })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_refuses_garbage_without_panic() {
        let u = PeerUsage { totals: Counts { requests: 7, input: 1200, output: 40 }, inflight: 2, recent: Counts { requests: 3, input: 100, output: 40 } };
        assert_eq!(decode(&encode(&u)), Ok(u));
        for bad in ["", "1,2,3", "1,2,3,4,5,6,7,8", "1,2,3,4,5,6,x", "1,2,3,4,5,6,-7", "1,2,3,4,5,6, 7", "9,9,9,99999999,1,1,1", "1,1,1,0,2,1,1", "99999999999999999,0,0,0,0,0,0", "١,2,3,4,5,6,7"] {
            assert!(decode(bad).is_err(), "{bad:?}");
        }
        assert!(decode(&"1,".repeat(200)).is_err());
        assert_eq!(tenant_of_key("q:key#3"), Some("key#3"));
        assert_eq!(tenant_of_key("q:team-a.prod"), Some("team-a.prod"));
        assert_eq!(tenant_of_key("q:"), None);
        assert_eq!(tenant_of_key("q:a b"), None);
        assert_eq!(tenant_of_key("sig:w0"), None);
        assert_eq!(tenant_of_key(&format!("q:{}", "a".repeat(65))), None);
    }
}
