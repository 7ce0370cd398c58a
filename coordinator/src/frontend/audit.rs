//! Policy audit records: what a rule matched, for whom, and when. Each node keeps the records
//! of the requests it served, bounded in count ([`MAX_RECORDS`]) and age ([`MAX_AGE`]); the
//! oldest go first. A record's id names its node (as a stored response's does), so any node can
//! ask that node for it over the cluster link.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Most records a node keeps.
pub const MAX_RECORDS: usize = 10_000;
/// How long a record is kept.
pub const MAX_AGE: Duration = Duration::from_secs(7 * 24 * 3600);
/// Most records one `since` read returns.
pub const MAX_PAGE: usize = 1000;

/// One match.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Record {
    /// `pa_`, 32 random hex digits, then the node's id in hex.
    pub id: String,
    /// Milliseconds since the Unix epoch, and the same as RFC 3339.
    pub time_ms: u64,
    pub time: String,
    /// The key's name (`[[auth.keys]]`, `key#n`, `open`).
    pub key: String,
    pub rule: String,
    /// `input` or `output`.
    pub direction: String,
    /// The matched text, redacted: its first and last character and its length.
    pub span: String,
    pub request_id: String,
    pub model: String,
}

/// An audit id for a record kept on `node`, and the node an id names.
pub fn new_id(node: &str) -> String {
    let hex: String = node.bytes().map(|b| format!("{b:02x}")).collect();
    format!("pa_{}{hex}", uuid::Uuid::new_v4().simple())
}

pub fn node_of(id: &str) -> Option<String> {
    let rest = id.strip_prefix("pa_")?;
    if rest.len() <= 32 || rest.len() > 32 + 128 || rest.len() % 2 != 0 || !rest.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let bytes: Vec<u8> = (32..rest.len()).step_by(2).map(|i| u8::from_str_radix(&rest[i..i + 2], 16)).collect::<Result<_, _>>().ok()?;
    String::from_utf8(bytes).ok()
}

/// The records this node keeps, oldest first.
#[derive(Default)]
pub struct AuditLog {
    records: Mutex<VecDeque<Record>>,
}

impl AuditLog {
    pub fn push(&self, r: Record, now_ms: u64) {
        let mut q = self.records.lock().unwrap_or_else(|e| e.into_inner());
        expire(&mut q, now_ms);
        if q.len() >= MAX_RECORDS {
            q.pop_front();
        }
        q.push_back(r);
    }

    pub fn get(&self, id: &str, now_ms: u64) -> Option<Record> {
        let mut q = self.records.lock().unwrap_or_else(|e| e.into_inner());
        expire(&mut q, now_ms);
        q.iter().find(|r| r.id == id).cloned()
    }

    /// Records at or after `since_ms`, oldest first, at most [`MAX_PAGE`].
    pub fn since(&self, since_ms: u64, now_ms: u64) -> Vec<Record> {
        let mut q = self.records.lock().unwrap_or_else(|e| e.into_inner());
        expire(&mut q, now_ms);
        q.iter().filter(|r| r.time_ms >= since_ms).take(MAX_PAGE).cloned().collect()
    }
}

fn expire(q: &mut VecDeque<Record>, now_ms: u64) {
    let oldest = now_ms.saturating_sub(MAX_AGE.as_millis() as u64);
    while q.front().is_some_and(|r| r.time_ms < oldest) {
        q.pop_front();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(id: &str, t: u64) -> Record {
        Record { id: id.into(), time_ms: t, time: String::new(), key: "k".into(), rule: "r".into(), direction: "input".into(), span: "*".into(), request_id: "req".into(), model: "m".into() }
    }

    #[test]
    fn ids_name_their_node_and_the_log_is_bounded() {
        let id = new_id("node-7");
        assert_eq!(node_of(&id).as_deref(), Some("node-7"));
        assert!(node_of("pa_xyz").is_none() && node_of("resp_00").is_none());
        let log = AuditLog::default();
        for i in 0..MAX_RECORDS as u64 + 5 {
            log.push(rec(&format!("a{i}"), 1_000 + i), 1_000 + i);
        }
        assert!(log.get("a0", 20_000).is_none(), "the oldest went first");
        assert!(log.get("a10", 20_000).is_some());
        assert_eq!(log.since(1_000 + MAX_RECORDS as u64, 20_000).len(), 5);
        assert_eq!(log.since(0, 20_000).len(), MAX_PAGE);
        let later = 1_000 + MAX_AGE.as_millis() as u64 + 20_000;
        assert!(log.since(0, later).is_empty(), "old records expire");
    }
}
