//! chitchat 0.13's wire format, read (and, for tests and the fuzz target, written) by us, so
//! that a message can be screened before chitchat applies it. chitchat keeps its own codec
//! crate-private; this one follows `message_serialize.rs`, `digest.rs`, `delta.rs` and
//! `serialize.rs` of chitchat 0.13.0 field for field, and decodes with a budget: a stream's
//! blocks may inflate to at most [`MAX_STREAM_BYTES`] in all (chitchat's own decoder has no
//! such bound, so one 64 KiB datagram of tiny zstd blocks could make it allocate gigabytes).
//!
//! ```text
//! message  = magic:u16le(45139) version:u8(0|1) type:u8 body
//! Syn      = digest cluster_id:str        SynAck = digest delta        Ack = delta
//! digest   = v0: count:u16le (id node_digest)*   v1: stream of (id node_digest)
//! delta    = stream of op;  op = 0 id last_gc:u64 from_excluded:u64
//!                               | 1 key:str value:str version:u64 status:u8
//!                               | 2 max_version:u64
//! stream   = (1 len:u16 zstd-block | 2 len:u16 raw-block)* 0
//! id       = node:str generation:u64 ip(4 a.b.c.d | 6 16 bytes) port:u16le
//! str      = len:u16le utf-8
//! ```

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// chitchat's magic number.
pub const MAGIC: u16 = 45_139;
/// What a stream's blocks may inflate to in all. chitchat writes blocks of at most 16 KiB
/// while the compressed bytes of a message stay under 64 KiB, so real messages inflate to a
/// few hundred KiB at most.
pub const MAX_STREAM_BYTES: usize = 2 << 20;
/// The largest block chitchat decompresses (its buffer is `u16::MAX` bytes).
const MAX_BLOCK: usize = u16::MAX as usize;

/// A chitchat node id: name, generation and gossip address.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Id {
    pub node: String,
    pub generation: u64,
    pub addr: SocketAddr,
}

/// What a digest says of one node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeDigest {
    pub heartbeat: u64,
    pub last_gc_version: u64,
    pub max_version: u64,
}

/// One key-value mutation of a delta.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Kv {
    pub key: String,
    pub value: String,
    pub version: u64,
    /// 0 set, 1 delete, 2 delete after a TTL.
    pub status: u8,
}

/// One operation of a delta's stream, as it travels.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    Node { id: Id, last_gc_version: u64, from_version_excluded: u64 },
    Kv(Kv),
    SetMaxVersion(u64),
}

/// A chitchat message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    Syn { cluster_id: String, digest: Vec<(Id, NodeDigest)> },
    SynAck { digest: Vec<(Id, NodeDigest)>, delta: Vec<Op> },
    Ack { delta: Vec<Op> },
    BadCluster,
}

/// Why bytes are not a chitchat message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("truncated ({0})")]
    Truncated(&'static str),
    #[error("malformed: {0}")]
    Malformed(&'static str),
    #[error("a stream inflates past {MAX_STREAM_BYTES} bytes")]
    Inflated,
}

type R<T> = Result<T, WireError>;

struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &'static str) -> R<&'a [u8]> {
        if self.buf.len() < n {
            return Err(WireError::Truncated(what));
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }
    fn u8(&mut self) -> R<u8> {
        Ok(self.take(1, "u8")?[0])
    }
    fn u16(&mut self) -> R<u16> {
        Ok(u16::from_le_bytes(self.take(2, "u16")?.try_into().unwrap_or_default()))
    }
    fn u64(&mut self) -> R<u64> {
        Ok(u64::from_le_bytes(self.take(8, "u64")?.try_into().unwrap_or_default()))
    }
    fn str(&mut self) -> R<String> {
        let n = self.u16()? as usize;
        let b = self.take(n, "string")?;
        std::str::from_utf8(b).map(str::to_string).map_err(|_| WireError::Malformed("a string is not UTF-8"))
    }
    fn addr(&mut self) -> R<SocketAddr> {
        let ip = match self.u8()? {
            4 => IpAddr::V4(Ipv4Addr::from(<[u8; 4]>::try_from(self.take(4, "ipv4")?).unwrap_or_default())),
            6 => IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(self.take(16, "ipv6")?).unwrap_or_default())),
            _ => return Err(WireError::Malformed("IP version")),
        };
        Ok(SocketAddr::new(ip, self.u16()?))
    }
    fn id(&mut self) -> R<Id> {
        Ok(Id { node: self.str()?, generation: self.u64()?, addr: self.addr()? })
    }
    fn node_digest(&mut self) -> R<NodeDigest> {
        Ok(NodeDigest { heartbeat: self.u64()?, last_gc_version: self.u64()?, max_version: self.u64()? })
    }
    fn op(&mut self) -> R<Op> {
        match self.u8()? {
            0 => Ok(Op::Node { id: self.id()?, last_gc_version: self.u64()?, from_version_excluded: self.u64()? }),
            1 => {
                let (key, value, version) = (self.str()?, self.str()?, self.u64()?);
                let status = self.u8()?;
                if status > 2 {
                    return Err(WireError::Malformed("deletion status"));
                }
                Ok(Op::Kv(Kv { key, value, version, status }))
            }
            2 => Ok(Op::SetMaxVersion(self.u64()?)),
            _ => Err(WireError::Malformed("delta op tag")),
        }
    }

    /// A compressed stream's inflated bytes, within [`MAX_STREAM_BYTES`].
    fn stream(&mut self) -> R<Vec<u8>> {
        let mut out = Vec::new();
        loop {
            let kind = self.u8()?;
            if kind == 0 {
                return Ok(out);
            }
            let n = self.u16()? as usize;
            let block = self.take(n, "stream block")?;
            let start = out.len();
            match kind {
                1 => {
                    if start + MAX_BLOCK > MAX_STREAM_BYTES {
                        return Err(WireError::Inflated);
                    }
                    out.resize(start + MAX_BLOCK, 0);
                    let got = zstd::bulk::decompress_to_buffer(block, &mut out[start..]).map_err(|_| WireError::Malformed("a zstd block"))?;
                    out.truncate(start + got);
                }
                2 => {
                    if start + n > MAX_STREAM_BYTES {
                        return Err(WireError::Inflated);
                    }
                    out.extend_from_slice(block);
                }
                _ => return Err(WireError::Malformed("stream block type")),
            }
        }
    }

    fn digest(&mut self, version: u8) -> R<Vec<(Id, NodeDigest)>> {
        if version == 0 {
            let n = self.u16()?;
            return (0..n).map(|_| Ok((self.id()?, self.node_digest()?))).collect();
        }
        let inflated = self.stream()?;
        let mut r = Reader { buf: &inflated };
        let mut out = Vec::new();
        while !r.buf.is_empty() {
            out.push((r.id()?, r.node_digest()?));
        }
        Ok(out)
    }

    fn delta(&mut self) -> R<Vec<Op>> {
        let inflated = self.stream()?;
        let mut r = Reader { buf: &inflated };
        let mut out = Vec::new();
        while !r.buf.is_empty() {
            out.push(r.op()?);
        }
        Ok(out)
    }
}

/// Reads one gossip message as chitchat would, within the inflation budget.
pub fn decode(bytes: &[u8]) -> R<Message> {
    let mut r = Reader { buf: bytes };
    if r.u16()? != MAGIC {
        return Err(WireError::Malformed("magic number"));
    }
    let version = r.u8()?;
    if version > 1 {
        return Err(WireError::Malformed("protocol version"));
    }
    match r.u8()? {
        0 => {
            let digest = r.digest(version)?;
            Ok(Message::Syn { digest, cluster_id: r.str()? })
        }
        1 => Ok(Message::SynAck { digest: r.digest(version)?, delta: r.delta()? }),
        2 => Ok(Message::Ack { delta: r.delta()? }),
        3 => Ok(Message::BadCluster),
        _ => Err(WireError::Malformed("message type")),
    }
}

/// Writing: the screen's filtered messages, and any message for tests and the fuzz target,
/// well-formed or not for chitchat's rules (a delta's ops are written as given), with
/// version-0 digests.
pub mod write {
    use std::net::IpAddr;

    use crate::cluster::screen::wire::{Id, Message, NodeDigest, Op, MAGIC};

    fn str(out: &mut Vec<u8>, s: &str) {
        out.extend((s.len() as u16).to_le_bytes());
        out.extend(s.as_bytes());
    }

    fn id(out: &mut Vec<u8>, id: &Id) {
        str(out, &id.node);
        out.extend(id.generation.to_le_bytes());
        match id.addr.ip() {
            IpAddr::V4(ip) => {
                out.push(4);
                out.extend(ip.octets());
            }
            IpAddr::V6(ip) => {
                out.push(6);
                out.extend(ip.octets());
            }
        }
        out.extend(id.addr.port().to_le_bytes());
    }

    /// `bytes` as a stream of blocks of at most 16 KiB, each zstd-compressed where that is
    /// shorter (as chitchat writes them).
    pub fn stream(out: &mut Vec<u8>, bytes: &[u8]) {
        for block in bytes.chunks(16 * 1024) {
            match zstd::bulk::compress(block, 0) {
                Ok(z) if z.len() < block.len() => {
                    out.push(1);
                    out.extend((z.len() as u16).to_le_bytes());
                    out.extend(z);
                }
                _ => {
                    out.push(2);
                    out.extend((block.len() as u16).to_le_bytes());
                    out.extend(block);
                }
            }
        }
        out.push(0);
    }

    fn ops(out: &mut Vec<u8>, ops: &[Op]) {
        let mut raw = Vec::new();
        for op in ops {
            match op {
                Op::Node { id: i, last_gc_version, from_version_excluded } => {
                    raw.push(0);
                    id(&mut raw, i);
                    raw.extend(last_gc_version.to_le_bytes());
                    raw.extend(from_version_excluded.to_le_bytes());
                }
                Op::Kv(kv) => {
                    raw.push(1);
                    str(&mut raw, &kv.key);
                    str(&mut raw, &kv.value);
                    raw.extend(kv.version.to_le_bytes());
                    raw.push(kv.status);
                }
                Op::SetMaxVersion(v) => {
                    raw.push(2);
                    raw.extend(v.to_le_bytes());
                }
            }
        }
        stream(out, &raw);
    }

    fn digest(out: &mut Vec<u8>, d: &[(Id, NodeDigest)]) {
        out.extend((d.len() as u16).to_le_bytes());
        for (i, nd) in d {
            id(out, i);
            for v in [nd.heartbeat, nd.last_gc_version, nd.max_version] {
                out.extend(v.to_le_bytes());
            }
        }
    }

    /// An Ack of `len` bytes whose delta stream is zstd blocks that each inflate to 60 KB of
    /// the same byte: a decompression bomb.
    pub fn bomb(len: usize) -> Vec<u8> {
        let block = zstd::bulk::compress(&vec![b'x'; 60_000], 19).unwrap_or_default();
        let mut m = MAGIC.to_le_bytes().to_vec();
        m.extend([0, 2]);
        while m.len() + block.len() + 4 < len {
            m.push(1);
            m.extend((block.len() as u16).to_le_bytes());
            m.extend(&block);
        }
        m.push(0);
        m
    }

    /// The message's bytes (protocol version 0).
    pub fn encode(m: &Message) -> Vec<u8> {
        let mut out = MAGIC.to_le_bytes().to_vec();
        out.push(0);
        match m {
            Message::Syn { cluster_id, digest: d } => {
                out.push(0);
                digest(&mut out, d);
                str(&mut out, cluster_id);
            }
            Message::SynAck { digest: d, delta } => {
                out.push(1);
                digest(&mut out, d);
                ops(&mut out, delta);
            }
            Message::Ack { delta } => {
                out.push(2);
                ops(&mut out, delta);
            }
            Message::BadCluster => out.push(3),
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(node: &str) -> Id {
        Id { node: node.into(), generation: 7, addr: "127.0.0.1:4000".parse().unwrap() }
    }

    fn sample() -> Vec<Message> {
        let kv = |k: &str, v: u64| Op::Kv(Kv { key: k.into(), value: format!("value of {k}"), version: v, status: 0 });
        let d = NodeDigest { heartbeat: 3, last_gc_version: 1, max_version: 9 };
        let v6 = Id { node: "b".into(), generation: u64::MAX, addr: "[::1]:9".parse().unwrap() };
        vec![
            Message::Syn { cluster_id: "zl".into(), digest: vec![(id("a"), d), (v6.clone(), d)] },
            Message::SynAck { digest: vec![(id("a"), d)], delta: vec![Op::Node { id: v6, last_gc_version: 0, from_version_excluded: 2 }, kv("state", 3), kv("http", 4), Op::SetMaxVersion(4)] },
            Message::Ack { delta: vec![Op::Node { id: id("a"), last_gc_version: 0, from_version_excluded: 0 }, Op::SetMaxVersion(12)] },
            Message::BadCluster,
        ]
    }

    #[test]
    fn messages_read_back_as_written() {
        for m in sample() {
            assert_eq!(decode(&write::encode(&m)), Ok(m));
        }
    }

    /// What chitchat's own decoder makes of our bytes: the same message (its `Debug` names
    /// each field), so the screen reads what chitchat will apply.
    #[tokio::test]
    async fn chitchat_reads_our_bytes_as_we_do() {
        use chitchat::transport::Socket as _;
        let mut theirs = chitchat::transport::UdpSocket::open("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let to = theirs.local_addr().unwrap();
        let tx = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        for m in sample() {
            tx.send_to(&write::encode(&m), to).unwrap();
            let got = format!("{:?}", theirs.recv().await.unwrap().envelope.message);
            match &m {
                Message::SynAck { delta, .. } | Message::Ack { delta } => {
                    for op in delta {
                        if let Op::Kv(kv) = op {
                            assert!(got.contains(&format!("key: {:?}, value: {:?}, version: {}", kv.key, kv.value, kv.version)), "{got}");
                        }
                    }
                    assert!(got.contains("max_version: 4") || got.contains("max_version: 12"), "{got}");
                }
                Message::Syn { cluster_id, .. } => assert!(got.contains(&format!("cluster_id: {cluster_id:?}")), "{got}"),
                Message::BadCluster => assert_eq!(got, "BadCluster"),
            }
        }
    }

    #[test]
    fn any_truncation_or_junk_is_an_error_not_a_panic() {
        for m in sample() {
            let b = write::encode(&m);
            for n in 0..b.len() {
                let _ = decode(&b[..n]);
            }
            for i in 0..b.len() {
                let mut c = b.clone();
                c[i] ^= 0xa5;
                let _ = decode(&c);
            }
        }
        assert_eq!(decode(&[0x53, 0xb0, 0, 9]), Err(WireError::Malformed("message type")));
    }

    /// A zstd bomb: one datagram of small blocks that each inflate to 60 KB. chitchat would
    /// allocate all of them (a few hundred MB); the reader stops at its budget.
    #[test]
    fn a_stream_that_inflates_past_the_budget_is_refused() {
        let b = write::bomb(65_000);
        let blocks = b.len() / 20;
        assert!(blocks * 60_000 > 16 * MAX_STREAM_BYTES, "{} bytes", b.len());
        assert_eq!(decode(&b), Err(WireError::Inflated));
    }
}
