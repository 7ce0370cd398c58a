//! A worker's disk tier: KV blocks that RAM evicts are kept in a file, and a later request
//! whose prefix they hold reads them back instead of recomputing them.
//!
//! - **Spill.** The engine records the blocks its pool evicts (`block_pool::Evicted`) and,
//!   before a forward or an import writes over them, copies each one not already on disk into
//!   a [`Spill`] and offers it here ([`DiskTier::offer`]). A bounded channel
//!   ([`QUEUE_BYTES`] of blocks) takes it to the writer thread, which claims a slot
//!   ([`index`]: CLOCK, live pins skipped) and writes the record ([`format`]: name, pin,
//!   checksum, tokens, KV). A full queue drops the spill, counted: the engine never waits for
//!   the disk.
//! - **Restore.** The worker actor asks [`DiskTier::plan`] for a submitted prompt's blocks that
//!   are on disk and not in RAM; if there are any, it reads them ([`DiskTier::read`], on a
//!   blocking thread, in chunks of [`RESTORE_CHUNK_BLOCKS`]) and imports them into the prefix
//!   cache before it hands the job to the engine, which then finds them as cache hits. A
//!   record whose checksum, name or tokens do not hold is a miss (the import stops there and
//!   the rest is recomputed), so a torn write or a slot overwritten mid-read never yields KV.
//! - **Restart.** The file's header names the format version, the cache's geometry and the
//!   model ([`model_identity`]). Opening a file whose header matches reloads the index from the
//!   records' heads; anything else starts the file afresh (logged, with the reason). A worker
//!   that stops copies its RAM cache to disk first ([`crate::Engine::spill_all`]), so a rolling
//!   restart finds its prefixes on disk.
//!
//! - **Index.** Blocks that come onto the disk or leave it are KV events under their disk
//!   names ([`zerolayer_common::disk_name`]), which the engine passes on with its own: the
//!   cluster's prefix index knows which blocks each worker holds on disk, and placement prices
//!   them between a RAM hit and a miss.
//!
//! Bounded throughout: the file has `kv_disk_mb` of slots, the queue a fixed byte budget, and
//! at most [`RESTORES_AT_ONCE`] restores read at once.

pub mod format;
pub mod index;

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use format::{Header, RecordHead, HEADER_BYTES, RECORD_HEAD, VERSION};
use index::Index;

use zerolayer_common::{disk_name, KvEvent};

use crate::backend::KvGeometry;
use crate::error::{Result, WorkerError};
use crate::migrate::KvImport;

/// Bytes of spills the writer's queue holds at most.
pub const QUEUE_BYTES: usize = 64 << 20;
/// Blocks one restore reads and imports at a time (the memory a restore holds).
pub const RESTORE_CHUNK_BLOCKS: usize = 128;
/// Restores reading at once, per worker.
pub const RESTORES_AT_ONCE: usize = 2;
/// Hashes of tier events waiting for the engine to take them; past this they are dropped (the
/// cluster's index misses those disk blocks until its next resync, and placement prices them as
/// misses meanwhile).
pub const MAX_PENDING_EVENT_HASHES: usize = 1 << 16;

/// A block on its way to disk.
pub struct Spill {
    pub hash: u64,
    pub parent: u64,
    pub tokens: Vec<u32>,
    pub kv: Vec<u8>,
    /// Its pin's expiry, Unix milliseconds (0: none).
    pub pin_until_unix_ms: u64,
    /// Still in RAM (a stopping worker's copy): not read back while it is.
    pub resident: bool,
}

/// What the tier holds and has done.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DiskStats {
    pub blocks: usize,
    pub capacity: usize,
    pub written: u64,
    /// Spills dropped: the queue was full, every slot pinned, or the write failed.
    pub dropped: u64,
    /// Blocks read back into RAM.
    pub restored: u64,
    /// Records found torn, stale or unreadable on a restore.
    pub bad_reads: u64,
}

/// A prompt's blocks to read back: the chain's hashes from `root`, and which positions are on
/// disk (and in which slot).
#[derive(Clone, Debug)]
pub struct Plan {
    pub root: u64,
    pub hashes: Vec<u64>,
    pub tokens: Vec<u32>,
    pub on_disk: Vec<(usize, u32)>,
}

impl Plan {
    /// The chain positions a restore covers: up to the last block on disk.
    pub fn blocks(&self) -> usize {
        self.on_disk.last().map_or(0, |&(p, _)| p + 1)
    }
}

struct Shared {
    file: File,
    header: Header,
    index: Mutex<Index>,
    /// Blocks that came onto or left the disk, as KV events under their disk names, for the
    /// worker's prefix index (bounded: see [`MAX_PENDING_EVENT_HASHES`]).
    events: Mutex<(Vec<KvEvent>, usize)>,
    written: AtomicU64,
    dropped: AtomicU64,
    restored: AtomicU64,
    bad_reads: AtomicU64,
    /// Spills offered and not yet written (or dropped).
    pending: AtomicUsize,
}

pub struct DiskTier {
    shared: Arc<Shared>,
    tx: SyncSender<Spill>,
    path: PathBuf,
    /// Restores reading now (bounded by [`RESTORES_AT_ONCE`]).
    pub restores: Arc<tokio::sync::Semaphore>,
}

fn now_unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// The model's identity for the file header: BLAKE3 of the model file's length, its first
/// 8 MiB (the GGUF header, metadata and tensor table) and its last MiB (weights), with the KV
/// cache's element type, block size and block bytes.
pub fn model_identity(model: &Path, kv: &KvGeometry) -> std::io::Result<[u8; 32]> {
    let f = File::open(model)?;
    let len = f.metadata()?.len();
    let mut h = blake3::Hasher::new();
    h.update(b"zerolayer kv disk identity\0");
    h.update(&len.to_le_bytes());
    let head = len.min(8 << 20);
    let mut buf = vec![0u8; head as usize];
    f.read_exact_at(&mut buf, 0)?;
    h.update(&buf);
    let tail = len.saturating_sub(head).min(1 << 20);
    buf.resize(tail as usize, 0);
    f.read_exact_at(&mut buf, len - tail)?;
    h.update(&buf);
    h.update(format!("{} {} {}", kv.dtype, kv.block_size, kv.block_bytes).as_bytes());
    Ok(*h.finalize().as_bytes())
}

impl DiskTier {
    /// Opens (or creates) `dir/<name>.kv` with `mb` MiB of slots for blocks of `kv`'s
    /// geometry, reloading its index when the header matches, and starts the writer thread.
    pub fn open(dir: &Path, name: &str, mb: usize, identity: [u8; 32], kv: &KvGeometry) -> Result<Arc<DiskTier>> {
        std::fs::create_dir_all(dir).map_err(WorkerError::Io)?;
        let path = dir.join(format!("{name}.kv"));
        let mut header = Header { version: VERSION, block_size: kv.block_size as u32, block_bytes: kv.block_bytes as u64, slots: 0, identity };
        header.slots = ((mb as u64) << 20) / header.record_bytes();
        if header.slots == 0 {
            return Err(WorkerError::Invalid(format!("kv_disk_mb = {mb} holds no {}-byte block", header.record_bytes())));
        }
        let file = OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path).map_err(WorkerError::Io)?;
        let index = match reload(&file, &header) {
            Ok(ix) => {
                tracing::info!(path = %path.display(), blocks = ix.len(), "KV disk tier reloaded");
                ix
            }
            Err(why) => {
                tracing::info!(path = %path.display(), reason = why, "KV disk tier starts empty");
                file.set_len(0).map_err(WorkerError::Io)?;
                file.write_all_at(&header.encode(), 0).map_err(WorkerError::Io)?;
                file.set_len(header.file_bytes()).map_err(WorkerError::Io)?;
                Index::new(header.slots as usize)
            }
        };
        let reloaded: Vec<u64> = index.hashes().map(disk_name).collect();
        let shared = Arc::new(Shared {
            file,
            header,
            index: Mutex::new(index),
            events: Mutex::new((Vec::new(), 0)),
            written: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            restored: AtomicU64::new(0),
            bad_reads: AtomicU64::new(0),
            pending: AtomicUsize::new(0),
        });
        shared.tier_event(true, reloaded);
        let (tx, rx) = sync_channel((QUEUE_BYTES / kv.block_bytes.max(1)).max(4));
        let s = shared.clone();
        std::thread::Builder::new().name(format!("zl-kv-disk-{name}")).spawn(move || writer(s, rx)).map_err(WorkerError::Io)?;
        Ok(Arc::new(DiskTier { shared, tx, path, restores: Arc::new(tokio::sync::Semaphore::new(RESTORES_AT_ONCE)) }))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn index(&self) -> std::sync::MutexGuard<'_, Index> {
        self.shared.index.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A block left RAM: whether it must be written (it is not on disk yet). One that is keeps
    /// its slot, now marked as not in RAM, and takes its pin along.
    pub fn evicted(&self, hash: u64, pin_until_unix_ms: u64) -> bool {
        let mut ix = self.index();
        if !ix.contains(hash) {
            return true;
        }
        ix.set_resident(hash, false);
        ix.pin(hash, pin_until_unix_ms);
        false
    }

    /// Whether `hash` is on disk.
    pub fn holds(&self, hash: u64) -> bool {
        self.index().contains(hash)
    }

    /// Hands a spill to the writer, or drops it (counted) when the queue is full.
    pub fn offer(&self, spill: Spill) -> bool {
        self.shared.pending.fetch_add(1, Ordering::AcqRel);
        match self.tx.try_send(spill) {
            Ok(()) => true,
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.shared.pending.fetch_sub(1, Ordering::AcqRel);
                self.shared.dropped.fetch_add(1, Ordering::Relaxed);
                false
            }
        }
    }

    /// As [`Self::offer`], waiting for queue room until `deadline` (a stopping worker's copy).
    pub fn offer_until(&self, mut spill: Spill, deadline: Instant) -> bool {
        self.shared.pending.fetch_add(1, Ordering::AcqRel);
        loop {
            match self.tx.try_send(spill) {
                Ok(()) => return true,
                Err(TrySendError::Full(s)) if Instant::now() < deadline => {
                    spill = s;
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(_) => {
                    self.shared.pending.fetch_sub(1, Ordering::AcqRel);
                    self.shared.dropped.fetch_add(1, Ordering::Relaxed);
                    return false;
                }
            }
        }
    }

    /// Waits until every spill offered so far is written (or `deadline`); whether it was.
    pub fn flush(&self, deadline: Instant) -> bool {
        while self.shared.pending.load(Ordering::Acquire) > 0 {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        true
    }

    /// These blocks are in RAM (computed or imported): a restore need not read them.
    pub fn mark_resident(&self, hashes: &[u64]) {
        let mut ix = self.index();
        if ix.is_empty() {
            return;
        }
        for &h in hashes {
            ix.set_resident(h, true);
        }
    }

    /// The blocks of the chain `tokens` spell from `root` that a restore would read: `None`
    /// when none is on disk (or only in RAM too).
    pub fn plan(&self, root: u64, tokens: &[u32]) -> Option<Plan> {
        let bs = self.shared.header.block_size as usize;
        if self.index().is_empty() || tokens.len() < bs {
            return None;
        }
        let hashes = zerolayer_common::block_hashes_from(root, tokens, bs);
        let mut ix = self.index();
        let mut on_disk: Vec<(usize, u32)> = Vec::new();
        for (i, &h) in hashes.iter().enumerate() {
            if ix.restorable(h) {
                on_disk.extend(ix.get(h).map(|s| (i, s)));
            }
        }
        drop(ix);
        if on_disk.is_empty() {
            return None;
        }
        let n = on_disk.last().unwrap().0 + 1;
        Some(Plan { root, hashes: hashes[..n].to_vec(), tokens: tokens[..n * bs].to_vec(), on_disk })
    }

    /// Reads chain positions `range` of `plan` as an import: the bytes of each block on disk
    /// whose record holds, none for the others (in RAM, the importer believes). Blocking.
    pub fn read(&self, plan: &Plan, range: std::ops::Range<usize>) -> KvImport {
        let h = &self.shared.header;
        let (bs, block_bytes) = (h.block_size as usize, h.block_bytes as usize);
        let mut buf = vec![0u8; h.record_bytes() as usize];
        let mut blocks: Vec<(u64, Option<Vec<u8>>)> = plan.hashes[range.clone()].iter().map(|&h| (h, None)).collect();
        for &(pos, slot) in plan.on_disk.iter().filter(|(p, _)| range.contains(p)) {
            let parent = if pos == 0 { plan.root } else { plan.hashes[pos - 1] };
            let tokens = &plan.tokens[pos * bs..(pos + 1) * bs];
            let got = self.shared.file.read_exact_at(&mut buf, h.offset(slot)).map_err(|_| "unreadable").and_then(|()| format::check_record(&buf, plan.hashes[pos], parent, tokens, block_bytes));
            match got {
                Ok(kv) => blocks[pos - range.start].1 = Some(buf[kv].to_vec()),
                Err(why) => {
                    tracing::debug!(slot, reason = why, "a KV disk record is not the block it should be; it is recomputed");
                    self.shared.bad_reads.fetch_add(1, Ordering::Relaxed);
                    let mut ix = self.index();
                    if ix.get(plan.hashes[pos]) == Some(slot) {
                        let gone = ix.forget(slot);
                        drop(ix);
                        self.shared.tier_event(false, gone.into_iter().map(disk_name).collect());
                    }
                    break;
                }
            }
        }
        let root = if range.start == 0 { plan.root } else { plan.hashes[range.start - 1] };
        KvImport { block_size: bs, block_bytes, cache_root: root, tokens: plan.tokens[range.start * bs..range.end * bs].to_vec(), blocks }
    }

    /// The tier's KV events since the last call: blocks that came onto the disk (`Stored`) or
    /// left it (`Evicted`), under their disk names ([`disk_name`]).
    pub fn take_events(&self) -> Vec<KvEvent> {
        let mut ev = self.shared.events.lock().unwrap_or_else(|p| p.into_inner());
        ev.1 = 0;
        std::mem::take(&mut ev.0)
    }

    /// Every block on disk, by its disk name (a resync's snapshot).
    pub fn disk_names(&self) -> Vec<u64> {
        self.index().hashes().map(disk_name).collect()
    }

    /// Counts blocks a restore imported.
    pub fn restored(&self, blocks: usize) {
        self.shared.restored.fetch_add(blocks as u64, Ordering::Relaxed);
    }

    pub fn stats(&self) -> DiskStats {
        let s = &self.shared;
        let ix = self.index();
        DiskStats {
            blocks: ix.len(),
            capacity: ix.capacity(),
            written: s.written.load(Ordering::Relaxed),
            dropped: s.dropped.load(Ordering::Relaxed),
            restored: s.restored.load(Ordering::Relaxed),
            bad_reads: s.bad_reads.load(Ordering::Relaxed),
        }
    }
}

impl Shared {
    /// Records that `hashes` (disk names) came onto the disk, or left it.
    fn tier_event(&self, stored: bool, hashes: Vec<u64>) {
        if hashes.is_empty() {
            return;
        }
        let mut ev = self.events.lock().unwrap_or_else(|p| p.into_inner());
        if ev.1 + hashes.len() > MAX_PENDING_EVENT_HASHES {
            return;
        }
        ev.1 += hashes.len();
        match (ev.0.last_mut(), stored) {
            (Some(KvEvent::Stored { hashes: h }), true) | (Some(KvEvent::Evicted { hashes: h }), false) => h.extend(hashes),
            (_, true) => ev.0.push(KvEvent::Stored { hashes }),
            (_, false) => ev.0.push(KvEvent::Evicted { hashes }),
        }
    }
}

/// The index of a file whose header is `want`'s, from its records' heads; why not otherwise.
fn reload(file: &File, want: &Header) -> std::result::Result<Index, &'static str> {
    let mut head = vec![0u8; HEADER_BYTES as usize];
    file.read_exact_at(&mut head, 0).map_err(|_| "no header (a new file)")?;
    let got = Header::decode(&head).ok_or("not a KV disk file")?;
    if got.version != want.version {
        return Err("another format version");
    }
    if got.identity != want.identity {
        return Err("another model (or KV element type)");
    }
    if got != *want {
        return Err("another geometry or size");
    }
    if file.metadata().map_err(|_| "unreadable")?.len() < want.file_bytes() {
        return Err("truncated");
    }
    let mut ix = Index::new(want.slots as usize);
    let mut rec = [0u8; RECORD_HEAD];
    for s in 0..want.slots as u32 {
        file.read_exact_at(&mut rec, want.offset(s)).map_err(|_| "unreadable record")?;
        if let Some(h) = format::decode_head(&rec) {
            ix.fill(s, h.hash, h.pin_until_unix_ms, false);
        }
    }
    Ok(ix)
}

/// The writer thread: one spill at a time, until the tier is dropped.
fn writer(s: Arc<Shared>, rx: Receiver<Spill>) {
    let record_bytes = s.header.record_bytes() as usize;
    for spill in rx {
        write_one(&s, spill, record_bytes);
        s.pending.fetch_sub(1, Ordering::AcqRel);
    }
}

fn write_one(s: &Shared, spill: Spill, record_bytes: usize) {
    let lock = || s.index.lock().unwrap_or_else(|p| p.into_inner());
    let slot = {
        let mut ix = lock();
        if ix.contains(spill.hash) {
            return;
        }
        ix.claim(now_unix_ms())
    };
    let Some((slot, old)) = slot else {
        s.dropped.fetch_add(1, Ordering::Relaxed);
        return;
    };
    s.tier_event(false, old.into_iter().map(disk_name).collect());
    let head = RecordHead { hash: spill.hash, parent: spill.parent, pin_until_unix_ms: spill.pin_until_unix_ms };
    let rec = format::encode_record(head, &spill.tokens, &spill.kv, record_bytes);
    if let Err(e) = s.file.write_all_at(&rec, s.header.offset(slot)) {
        tracing::warn!(error = %e, "a KV block could not be written to the disk tier; it is dropped");
        s.dropped.fetch_add(1, Ordering::Relaxed);
        return;
    }
    lock().fill(slot, spill.hash, spill.pin_until_unix_ms, spill.resident);
    s.tier_event(true, vec![disk_name(spill.hash)]);
    s.written.fetch_add(1, Ordering::Relaxed);
}

/// Converts a pin's expiry on the engine's clock (`now_ms` is that clock now) to Unix time.
pub fn pin_to_unix(pin_until_ms: u64, now_ms: u64) -> u64 {
    if pin_until_ms == 0 {
        0
    } else {
        now_unix_ms() + pin_until_ms.saturating_sub(now_ms)
    }
}

#[cfg(test)]
mod tests;
