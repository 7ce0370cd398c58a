//! Stored responses (the Responses API's `store: true`, its default): what
//! `previous_response_id`, `GET /v1/responses/{id}` and `DELETE` find.
//!
//! Each node keeps the responses it made, bounded in count ([`MAX_ENTRIES`]), bytes
//! ([`MAX_BYTES`], [`MAX_ENTRY_BYTES`] each) and age ([`MAX_AGE`]); the oldest go first. An
//! entry belongs to the tenant that made it: any other tenant finds nothing, as if it did not
//! exist. A response id names the node that holds it ([`ResponseId`]), so any node of the
//! cluster can ask that node for it over the cluster link (`Open::Lookup`).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Most stored responses per node.
pub const MAX_ENTRIES: usize = 4096;
/// Most bytes of stored responses per node.
pub const MAX_BYTES: usize = 256 << 20;
/// The largest response stored (its JSON with the whole conversation); a larger one is answered
/// but not kept. Below the cluster link's frame limit, so any entry can travel.
pub const MAX_ENTRY_BYTES: usize = 3 << 20;
/// How long a stored response is kept.
pub const MAX_AGE: Duration = Duration::from_secs(24 * 3600);

/// A response id: `resp_`, 32 random hex digits, then the id of the node that stores it, in hex.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResponseId {
    pub id: String,
    pub node: String,
}

impl ResponseId {
    /// A fresh id for a response stored on `node`.
    pub fn new(node: &str) -> ResponseId {
        let hex: String = node.bytes().map(|b| format!("{b:02x}")).collect();
        ResponseId { id: format!("resp_{}{hex}", uuid::Uuid::new_v4().simple()), node: node.to_string() }
    }

    /// Reads an id a client sent; `None` when it is not one of ours.
    pub fn parse(id: &str) -> Option<ResponseId> {
        let rest = id.strip_prefix("resp_")?;
        if rest.len() <= 32 || rest.len() > 32 + 128 || !rest.bytes().all(|b| b.is_ascii_hexdigit()) || rest.len() % 2 != 0 {
            return None;
        }
        let bytes: Vec<u8> = (32..rest.len()).step_by(2).map(|i| u8::from_str_radix(&rest[i..i + 2], 16)).collect::<Result<_, _>>().ok()?;
        let node = String::from_utf8(bytes).ok()?;
        Some(ResponseId { id: id.to_string(), node })
    }
}

struct Entry {
    /// Its place in `Inner::order` (an id stored again gets a new one).
    seq: u64,
    tenant: String,
    at: Instant,
    body: Arc<Vec<u8>>,
}

#[derive(Default)]
struct Inner {
    map: HashMap<String, Entry>,
    /// Ids in the order they were stored, with their `Entry::seq` (a deleted or replaced entry's
    /// place stays until it reaches the front).
    order: VecDeque<(u64, String)>,
    bytes: usize,
    next: u64,
}

impl Inner {
    fn remove(&mut self, id: &str) -> Option<Entry> {
        let e = self.map.remove(id)?;
        self.bytes -= e.body.len();
        Some(e)
    }

    /// Drops the oldest entries until every bound holds, and the expired ones.
    fn evict(&mut self, now: Instant) {
        while let Some((seq, id)) = self.order.front() {
            let live = self.map.get(id).filter(|e| e.seq == *seq);
            let over = self.map.len() > MAX_ENTRIES || self.bytes > MAX_BYTES || self.order.len() > 2 * MAX_ENTRIES;
            let stale = live.is_none_or(|e| now.duration_since(e.at) > MAX_AGE);
            if !over && !stale {
                break;
            }
            let is_live = live.is_some();
            let (_, id) = self.order.pop_front().expect("front exists");
            if is_live {
                self.remove(&id);
            }
        }
    }
}

/// This node's stored responses (module docs).
#[derive(Default)]
pub struct ResponseStore {
    inner: Mutex<Inner>,
}

impl ResponseStore {
    /// Keeps `body` as `tenant`'s response `id`. Returns false (and keeps nothing) when it is
    /// larger than [`MAX_ENTRY_BYTES`].
    pub fn put(&self, id: &str, tenant: &str, body: Vec<u8>) -> bool {
        if body.len() > MAX_ENTRY_BYTES {
            return false;
        }
        let now = Instant::now();
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        g.remove(id);
        g.bytes += body.len();
        g.next += 1;
        let seq = g.next;
        g.map.insert(id.to_string(), Entry { seq, tenant: tenant.to_string(), at: now, body: Arc::new(body) });
        g.order.push_back((seq, id.to_string()));
        g.evict(now);
        true
    }

    /// `tenant`'s response `id`, if it is still kept.
    pub fn get(&self, id: &str, tenant: &str) -> Option<Arc<Vec<u8>>> {
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        g.evict(Instant::now());
        g.map.get(id).filter(|e| e.tenant == tenant).map(|e| e.body.clone())
    }

    /// Forgets `tenant`'s response `id`; whether there was one.
    pub fn delete(&self, id: &str, tenant: &str) -> bool {
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if g.map.get(id).is_some_and(|e| e.tenant == tenant) {
            g.remove(id);
            return true;
        }
        false
    }

    /// How many responses are kept, and their bytes.
    pub fn usage(&self) -> (usize, usize) {
        let g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        (g.map.len(), g.bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_name_their_node() {
        let id = ResponseId::new("node-b");
        assert!(id.id.starts_with("resp_"));
        assert_eq!(ResponseId::parse(&id.id), Some(id.clone()));
        assert_eq!(ResponseId::parse("resp_123"), None);
        assert_eq!(ResponseId::parse("msg_0123456789abcdef0123456789abcdef61"), None);
        assert_eq!(ResponseId::parse(&format!("{}zz", id.id)), None);
    }

    #[test]
    fn entries_belong_to_their_tenant_and_stay_bounded() {
        let s = ResponseStore::default();
        assert!(s.put("r1", "alice", b"one".to_vec()));
        assert_eq!(s.get("r1", "alice").as_deref().map(Vec::as_slice), Some(&b"one"[..]));
        assert_eq!(s.get("r1", "bob"), None, "another tenant sees nothing");
        assert!(!s.delete("r1", "bob"));
        assert!(s.delete("r1", "alice"));
        assert_eq!(s.get("r1", "alice"), None);
        assert!(!s.put("big", "alice", vec![0; MAX_ENTRY_BYTES + 1]), "too large to keep");
        for i in 0..MAX_ENTRIES + 10 {
            s.put(&format!("r{i}"), "alice", vec![1; 10]);
        }
        assert_eq!(s.usage(), (MAX_ENTRIES, MAX_ENTRIES * 10), "the oldest went first");
        assert_eq!(s.get("r0", "alice"), None);
        assert!(s.get(&format!("r{}", MAX_ENTRIES + 9), "alice").is_some());
        for _ in 0..3 * MAX_ENTRIES {
            s.put("same", "alice", vec![1; 10]);
        }
        assert!(s.inner.lock().unwrap().order.len() <= 2 * MAX_ENTRIES, "the order queue is bounded too");
        assert!(s.get("same", "alice").is_some(), "an id stored again keeps its latest entry");
    }
}
