//! The disk tier's file format (pure: bytes in, values out).
//!
//! One file per worker: a [`HEADER_BYTES`] header, then `slots` fixed-size records.
//!
//! - Header: magic `ZLKVDISK`, format [`VERSION`], block size, block bytes, slot count, and the
//!   model's identity (32 bytes: a BLAKE3 of the model file's length and its first and last
//!   bytes, with the KV element type). A file whose header differs in anything is not
//!   reloaded: its blocks were computed by another model, or laid out for another cache.
//! - Record: magic `ZLKB`, the block's chained hash, its parent's, its pin's expiry (Unix
//!   milliseconds, 0: none), a checksum of everything after it, then the block's tokens
//!   (`block_size` × u32) and its KV bytes (`block_bytes`, the migration layout). All
//!   little-endian. A record is trusted only when its magic, name and checksum all hold: a torn
//!   write (a crash mid-record) or a slot overwritten while it was read is a miss, never KV.

use zerolayer_common::checksum;

pub const MAGIC: &[u8; 8] = b"ZLKVDISK";
pub const VERSION: u32 = 1;
pub const HEADER_BYTES: u64 = 4096;
const RECORD_MAGIC: u32 = u32::from_le_bytes(*b"ZLKB");
/// Bytes before a record's tokens: magic, pad, hash, parent, pin, checksum.
pub const RECORD_HEAD: usize = 40;

/// What a file must say to be reloaded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub version: u32,
    pub block_size: u32,
    pub block_bytes: u64,
    pub slots: u64,
    pub identity: [u8; 32],
}

impl Header {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(HEADER_BYTES as usize);
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&self.version.to_le_bytes());
        b.extend_from_slice(&self.block_size.to_le_bytes());
        b.extend_from_slice(&self.block_bytes.to_le_bytes());
        b.extend_from_slice(&self.slots.to_le_bytes());
        b.extend_from_slice(&self.identity);
        b.resize(HEADER_BYTES as usize, 0);
        b
    }

    pub fn decode(b: &[u8]) -> Option<Header> {
        if b.len() < 64 || &b[..8] != MAGIC {
            return None;
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap());
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
        Some(Header { version: u32_at(8), block_size: u32_at(12), block_bytes: u64_at(16), slots: u64_at(24), identity: b[32..64].try_into().unwrap() })
    }

    /// Bytes of one record, rounded up to 64.
    pub fn record_bytes(&self) -> u64 {
        (RECORD_HEAD as u64 + 4 * self.block_size as u64 + self.block_bytes).div_ceil(64) * 64
    }

    /// Where slot `s`'s record starts.
    pub fn offset(&self, slot: u32) -> u64 {
        HEADER_BYTES + slot as u64 * self.record_bytes()
    }

    /// The whole file's length.
    pub fn file_bytes(&self) -> u64 {
        HEADER_BYTES + self.slots * self.record_bytes()
    }
}

/// A block's name on disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecordHead {
    pub hash: u64,
    pub parent: u64,
    pub pin_until_unix_ms: u64,
}

/// Reads a record's head, if it has a record's magic and a hash (not its checksum: that needs
/// the whole record).
pub fn decode_head(b: &[u8]) -> Option<RecordHead> {
    if b.len() < RECORD_HEAD || u32::from_le_bytes(b[..4].try_into().unwrap()) != RECORD_MAGIC {
        return None;
    }
    let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
    let head = RecordHead { hash: u64_at(8), parent: u64_at(16), pin_until_unix_ms: u64_at(24) };
    (head.hash != 0).then_some(head)
}

/// The record of one block, `record_bytes` long (padded with zeros).
pub fn encode_record(head: RecordHead, tokens: &[u32], kv: &[u8], record_bytes: usize) -> Vec<u8> {
    let mut b = Vec::with_capacity(record_bytes);
    b.extend_from_slice(&RECORD_MAGIC.to_le_bytes());
    b.extend_from_slice(&[0; 4]);
    b.extend_from_slice(&head.hash.to_le_bytes());
    b.extend_from_slice(&head.parent.to_le_bytes());
    b.extend_from_slice(&head.pin_until_unix_ms.to_le_bytes());
    b.extend_from_slice(&[0; 8]);
    for t in tokens {
        b.extend_from_slice(&t.to_le_bytes());
    }
    b.extend_from_slice(kv);
    let sum = checksum(&b[RECORD_HEAD..]);
    b[32..40].copy_from_slice(&sum.to_le_bytes());
    b.resize(record_bytes, 0);
    b
}

/// A whole record's block, if its magic, checksum and name hold: the name must be `hash` after
/// `parent`, spelling `tokens`. Returns the KV bytes' range in `b`.
pub fn check_record(b: &[u8], hash: u64, parent: u64, tokens: &[u32], block_bytes: usize) -> Result<std::ops::Range<usize>, &'static str> {
    let head = decode_head(b).ok_or("no record")?;
    if head.hash != hash || head.parent != parent {
        return Err("another block's record");
    }
    let end = RECORD_HEAD + 4 * tokens.len() + block_bytes;
    if b.len() < end {
        return Err("short record");
    }
    if checksum(&b[RECORD_HEAD..end]) != u64::from_le_bytes(b[32..40].try_into().unwrap()) {
        return Err("checksum mismatch");
    }
    let same = b[RECORD_HEAD..RECORD_HEAD + 4 * tokens.len()].chunks_exact(4).zip(tokens).all(|(c, &t)| u32::from_le_bytes(c.try_into().unwrap()) == t);
    if !same {
        return Err("other tokens");
    }
    Ok(RECORD_HEAD + 4 * tokens.len()..end)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> Header {
        Header { version: VERSION, block_size: 4, block_bytes: 100, slots: 3, identity: [7; 32] }
    }

    #[test]
    fn header_round_trips_and_sizes_records() {
        let h = header();
        let b = h.encode();
        assert_eq!(b.len(), HEADER_BYTES as usize);
        assert_eq!(Header::decode(&b), Some(h));
        assert_eq!(h.record_bytes(), 192, "40 + 16 + 100 rounded up to 64");
        assert_eq!(h.file_bytes(), 4096 + 3 * 192);
        assert_eq!(Header::decode(&b[..10]), None);
        let mut bad = b.clone();
        bad[0] = b'X';
        assert_eq!(Header::decode(&bad), None);
    }

    #[test]
    fn records_check_name_tokens_and_checksum() {
        let kv: Vec<u8> = (0..100u8).collect();
        let head = RecordHead { hash: 9, parent: 5, pin_until_unix_ms: 77 };
        let r = encode_record(head, &[1, 2, 3, 4], &kv, 192);
        assert_eq!(r.len(), 192);
        assert_eq!(decode_head(&r), Some(head));
        let range = check_record(&r, 9, 5, &[1, 2, 3, 4], 100).unwrap();
        assert_eq!(&r[range], &kv[..]);
        assert_eq!(check_record(&r, 9, 6, &[1, 2, 3, 4], 100), Err("another block's record"));
        assert_eq!(check_record(&r, 9, 5, &[1, 2, 3, 5], 100), Err("other tokens"));
        let mut torn = r.clone();
        torn[150] ^= 1;
        assert_eq!(check_record(&torn, 9, 5, &[1, 2, 3, 4], 100), Err("checksum mismatch"));
        assert_eq!(decode_head(&[0; 64]), None, "an empty slot holds no record");
    }
}
