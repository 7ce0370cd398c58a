//! One worker over a tensor-parallel group of ranks: rank 0 runs on the engine's thread, ranks
//! 1.. on threads of their own, each owning its shard of the model ([`ShardPlan`]) and of the KV
//! cache (its KV heads, for every block). A rank is any backend: a CPU shard summing through a
//! thread group, or (the `cuda` feature) a GPU shard summing through NCCL. A step is sent to every rank as an owned copy
//! of the batch; the ranks meet in the collective twice per layer; rank 0 returns the logits.
//!
//! Every rank validates the batch the same way before its first collective, so a refused batch
//! is refused by all of them and none waits for the others.

use std::ops::Range;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;

use zerolayer_common::config::KvDtype;
use zerolayer_kernels::collective::thread_group;

use super::cpu::Cpu;
use super::step::{Backend, KvGeometry, Shape};
use crate::error::{Result, WorkerError};
use crate::sampler::{Pick, Picked};
use crate::model::shard::ShardPlan;
use crate::model::{ForwardItem, KvCache, Model, ModelConfig};

/// A step's batch, owned, for the other ranks.
struct Batch {
    tokens: Vec<u32>,
    tables: Vec<u32>,
    /// Per item: its tokens and its block table (ranges of the two vectors), start, logits.
    items: Vec<(Range<usize>, Range<usize>, usize, usize)>,
}

impl Batch {
    fn of(items: &[ForwardItem<'_>]) -> Self {
        let mut b = Batch { tokens: Vec::new(), tables: Vec::new(), items: Vec::with_capacity(items.len()) };
        for it in items {
            let (t0, b0) = (b.tokens.len(), b.tables.len());
            b.tokens.extend_from_slice(it.tokens);
            b.tables.extend_from_slice(it.block_table);
            b.items.push((t0..b.tokens.len(), b0..b.tables.len(), it.start_pos, it.logits));
        }
        b
    }

    fn items(&self) -> Vec<ForwardItem<'_>> {
        self.items
            .iter()
            .map(|(t, tb, start, want)| ForwardItem { tokens: &self.tokens[t.clone()], start_pos: *start, block_table: &self.tables[tb.clone()], logits: *want })
            .collect()
    }
}

enum Command {
    Forward(Arc<Batch>),
    Read(u32, SyncSender<Result<Vec<u8>>>),
    Write(u32, Vec<u8>, SyncSender<Result<()>>),
}

struct Rank {
    commands: SyncSender<Command>,
    done: Receiver<Result<()>>,
    thread: Option<JoinHandle<()>>,
}

/// A worker's model over a group of CPU ranks (module docs).
pub struct TensorParallel {
    cfg: ModelConfig,
    lead: Box<dyn Backend>,
    others: Vec<Rank>,
    /// Bytes of one layer's K (or V) part of a block, per rank.
    part_bytes: Vec<usize>,
    geometry: KvGeometry,
    weight_bytes: usize,
    /// What runs each rank, in rank order (for `describe`).
    described: Vec<String>,
}

impl TensorParallel {
    /// Shards `model` over `size` ranks that share `threads` kernel threads (0: all cores), with
    /// as many KV blocks as the whole model's cache would have in `kv_budget_bytes`.
    pub fn new(model: Model, size: usize, threads: usize, block_size: usize, dtype: KvDtype, kv_budget_bytes: usize) -> Result<Self> {
        let cfg = model.cfg.clone();
        let plans = ShardPlan::for_group(&cfg, size)?;
        let total = if threads == 0 { std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) } else { threads };
        let threads_per_rank = (total / size).max(1);
        let num_blocks = KvCache::blocks_for(&cfg, block_size, dtype, kv_budget_bytes)?;
        let mut shards: Vec<Box<dyn Backend>> = Vec::with_capacity(size);
        for (plan, group) in plans.iter().zip(thread_group(size)) {
            let mut shard = model.shard(plan, threads_per_rank)?;
            shard.join(Box::new(group))?;
            shards.push(Box::new(Cpu::with_blocks(shard, block_size, dtype, num_blocks)));
        }
        drop(model);
        Self::from_shards(cfg, &plans, shards)
    }

    /// A group of ready shards, one per plan in rank order, each with the same blocks (and rank
    /// 0's logits): rank 0 stays here, the others get a thread each.
    pub fn from_shards(cfg: ModelConfig, plans: &[ShardPlan], shards: Vec<Box<dyn Backend>>) -> Result<Self> {
        let size = plans.len();
        assert_eq!(shards.len(), size, "a shard per plan");
        let first = shards[0].kv();
        if shards.iter().any(|s| s.kv().num_blocks != first.num_blocks || s.kv().block_size != first.block_size || s.kv().dtype != first.dtype) {
            return Err(WorkerError::Invalid("the ranks of a group must hold the same KV blocks".into()));
        }
        let (block_size, num_blocks, dtype) = (first.block_size, first.num_blocks, first.dtype);
        let part_bytes: Vec<usize> = plans.iter().map(|p| block_size * p.kv_heads.len() * cfg.head_dim * dtype.bytes()).collect();
        let weight_bytes = shards.iter().map(|s| s.weight_bytes()).sum();
        let described = shards.iter().map(|s| s.describe()).collect();
        let mut shards = shards.into_iter();
        let lead = shards.next().expect("a group has rank 0");
        let mut others = Vec::with_capacity(size - 1);
        for (i, shard) in shards.enumerate() {
            let (commands, inbox) = sync_channel::<Command>(2);
            let (report, done) = sync_channel::<Result<()>>(2);
            let thread = std::thread::Builder::new()
                .name(format!("zl-tp-rank-{}", i + 1))
                .spawn(move || serve(shard, inbox, report))
                .map_err(|e| WorkerError::Invalid(format!("starting a tensor-parallel rank: {e}")))?;
            others.push(Rank { commands, done, thread: Some(thread) });
        }
        let geometry = KvGeometry {
            block_size,
            num_blocks,
            dtype,
            block_bytes: cfg.kv_bytes_per_token(dtype) * block_size,
            bytes: cfg.kv_bytes_per_token(dtype) * block_size * num_blocks,
        };
        Ok(TensorParallel { cfg, lead, others, part_bytes, geometry, weight_bytes, described })
    }
}

/// A rank's loop: commands in order until the group is dropped.
fn serve(mut shard: Box<dyn Backend>, inbox: Receiver<Command>, report: SyncSender<Result<()>>) {
    let mut logits = Vec::new();
    while let Ok(cmd) = inbox.recv() {
        match cmd {
            Command::Forward(batch) => {
                let r = shard.forward_into(&batch.items(), &mut logits).map(|_| ());
                if report.send(r).is_err() {
                    return;
                }
            }
            Command::Read(b, reply) => {
                let mut out = Vec::new();
                let _ = reply.send(shard.read_block(b, &mut out).map(|_| out));
            }
            Command::Write(b, bytes, reply) => {
                let _ = reply.send(shard.write_block(b, &bytes));
            }
        }
    }
}

/// The common block layout from each rank's own (`[K₀ V₀ K₁ V₁ …]` over its heads): per layer,
/// K is every rank's K part in rank order (heads are contiguous per rank), then V likewise.
fn gather(parts: &[Vec<u8>], part_bytes: &[usize], n_layers: usize, out: &mut Vec<u8>) {
    for l in 0..n_layers {
        for kv in 0..2 {
            for (p, &pb) in parts.iter().zip(part_bytes) {
                let at = (2 * l + kv) * pb;
                out.extend_from_slice(&p[at..at + pb]);
            }
        }
    }
}

/// Each rank's own layout from the common one ([`gather`]'s inverse).
fn scatter(bytes: &[u8], part_bytes: &[usize], n_layers: usize) -> Vec<Vec<u8>> {
    let mut parts: Vec<Vec<u8>> = part_bytes.iter().map(|pb| Vec::with_capacity(2 * n_layers * pb)).collect();
    let mut at = 0;
    for _ in 0..n_layers {
        for _ in 0..2 {
            for (p, &pb) in parts.iter_mut().zip(part_bytes) {
                p.extend_from_slice(&bytes[at..at + pb]);
                at += pb;
            }
        }
    }
    parts
}

fn rank_gone() -> WorkerError {
    WorkerError::Unavailable("a tensor-parallel rank has stopped".into())
}

impl TensorParallel {
    /// Sends the step to ranks 1.., runs rank 0 here with `lead`, and waits for every rank.
    fn step(&mut self, items: &[ForwardItem<'_>], lead: impl FnOnce(&mut dyn Backend) -> Result<usize>) -> Result<usize> {
        let batch = Arc::new(Batch::of(items));
        for r in &self.others {
            r.commands.send(Command::Forward(batch.clone())).map_err(|_| rank_gone())?;
        }
        let lead = lead(&mut *self.lead);
        // Every rank's report is taken, so none is left over for the next step.
        let others: Vec<Result<()>> = self.others.iter().map(|r| r.done.recv().map_err(|_| rank_gone()).and_then(|r| r)).collect();
        let rows = lead?;
        others.into_iter().collect::<Result<()>>()?;
        Ok(rows)
    }
}

impl Backend for TensorParallel {
    fn shape(&self) -> Shape<'_> {
        Shape { config: &self.cfg, weight_bytes: self.weight_bytes, kv: self.geometry }
    }
    fn forward_into(&mut self, items: &[ForwardItem<'_>], logits: &mut Vec<f32>) -> Result<usize> {
        self.step(items, |lead| lead.forward_into(items, logits))
    }
    fn forward_pick(&mut self, items: &[ForwardItem<'_>], picks: &[Pick], logits: &mut Vec<f32>, picked: &mut Picked) -> Result<usize> {
        // Rank 0 computes the logits, so it picks too.
        self.step(items, |lead| lead.forward_pick(items, picks, logits, picked))
    }
    fn read_block(&self, b: u32, out: &mut Vec<u8>) -> Result<()> {
        let mut parts = vec![Vec::new()];
        self.lead.read_block(b, &mut parts[0])?;
        for r in &self.others {
            let (tx, rx) = sync_channel(1);
            r.commands.send(Command::Read(b, tx)).map_err(|_| rank_gone())?;
            parts.push(rx.recv().map_err(|_| rank_gone())??);
        }
        // A rank's part of another size (a remote rank's answer) would cut the block wrongly.
        if parts.iter().zip(&self.part_bytes).any(|(p, pb)| p.len() != 2 * self.cfg.n_layers * pb) {
            return Err(WorkerError::Invalid(format!("a rank's part of KV block {b} has the wrong size")));
        }
        gather(&parts, &self.part_bytes, self.cfg.n_layers, out);
        Ok(())
    }
    fn write_block(&mut self, b: u32, bytes: &[u8]) -> Result<()> {
        if bytes.len() != self.geometry.block_bytes {
            return Err(WorkerError::Invalid(format!("KV block of {} bytes, not {}", bytes.len(), self.geometry.block_bytes)));
        }
        let mut parts = scatter(bytes, &self.part_bytes, self.cfg.n_layers).into_iter();
        self.lead.write_block(b, &parts.next().expect("rank 0"))?;
        let mut replies = Vec::with_capacity(self.others.len());
        for (r, p) in self.others.iter().zip(parts) {
            let (tx, rx) = sync_channel(1);
            r.commands.send(Command::Write(b, p, tx)).map_err(|_| rank_gone())?;
            replies.push(rx);
        }
        replies.into_iter().try_for_each(|rx| rx.recv().map_err(|_| rank_gone())?)
    }
    fn describe(&self) -> String {
        let ranks: Vec<String> = self.described.iter().enumerate().map(|(i, d)| format!("rank {i} on {d}")).collect();
        format!("tensor parallel over {} ranks: {}", self.described.len(), ranks.join("; "))
    }
}

impl Drop for TensorParallel {
    fn drop(&mut self) {
        let threads: Vec<_> = self.others.iter_mut().filter_map(|r| r.thread.take()).collect();
        // Closing the command channels ends each rank's loop.
        self.others.clear();
        for t in threads {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gather_and_scatter_are_inverse() {
        let part_bytes = [8usize, 4];
        let n_layers = 3;
        let parts: Vec<Vec<u8>> = part_bytes.iter().enumerate().map(|(r, &pb)| (0..2 * n_layers * pb).map(|i| (r * 100 + i) as u8).collect()).collect();
        let mut whole = Vec::new();
        gather(&parts, &part_bytes, n_layers, &mut whole);
        assert_eq!(whole.len(), 2 * n_layers * 12);
        // Layer 1's K: rank 0's bytes 16..24, then rank 1's 8..12.
        assert_eq!(&whole[24..36], &[16, 17, 18, 19, 20, 21, 22, 23, 108, 109, 110, 111]);
        assert_eq!(scatter(&whole, &part_bytes, n_layers), parts);
    }
}
