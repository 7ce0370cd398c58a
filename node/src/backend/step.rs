//! What one engine step asks of a backend ([`Backend`]), the shape of its KV cache, and the
//! host-side bookkeeping a device backend checks a step with before anything reaches the device.

use zerolayer_common::config::KvDtype;
use crate::error::{Result, WorkerError};
use crate::model::{ForwardItem, ModelConfig};
use crate::sampler::{Pick, Picked};

/// The shape of a backend's KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvGeometry {
    pub block_size: usize,
    pub num_blocks: usize,
    /// The element type of K and V (and of the blocks' bytes in transit).
    pub dtype: KvDtype,
    /// Bytes of one block across every layer, K and V (what a KV transfer moves per block).
    pub block_bytes: usize,
    /// Bytes of the whole cache.
    pub bytes: usize,
}

/// What a backend holds, as the engine sizes its work by it.
pub struct Shape<'a> {
    /// The model's architecture.
    pub config: &'a ModelConfig,
    /// Bytes of weights it holds (all ranks together).
    pub weight_bytes: usize,
    pub kv: KvGeometry,
}

/// A device (or group of devices) that runs forward steps for one engine.
pub trait Backend: Send {
    fn shape(&self) -> Shape<'_>;
    /// The model's architecture.
    fn config(&self) -> &ModelConfig {
        self.shape().config
    }
    /// Bytes of weights it holds (all ranks together).
    fn weight_bytes(&self) -> usize {
        self.shape().weight_bytes
    }
    fn kv(&self) -> KvGeometry {
        self.shape().kv
    }
    /// Runs one step: writes K/V for every token through the block tables, and writes the logits
    /// of the last `logits` tokens of every item into `logits` (rows × vocabulary),
    /// returning the number of rows.
    fn forward_into(&mut self, items: &[ForwardItem<'_>], logits: &mut Vec<f32>) -> Result<usize>;
    /// [`Backend::forward_into`], where a device may make part of each logits row's draw
    /// (`picks[i]`, one per row): a backend that can fills `picked` with the argmax of `Greedy`
    /// rows and the top-k candidates of `TopK` rows (see [`Picked`]), and fills `logits` only
    /// when some row is `Host`, sparing the logits' trip to the host otherwise. The default
    /// picks nothing and fills `logits`, and the host samples every row.
    fn forward_pick(&mut self, items: &[ForwardItem<'_>], picks: &[Pick], logits: &mut Vec<f32>, picked: &mut Picked) -> Result<usize> {
        let _ = picks;
        picked.clear();
        self.forward_into(items, logits)
    }
    /// Appends block `b` in the common layout (see [`crate::backend`]) to `out`. A block outside
    /// the cache, or a device or rank that cannot be reached, is an error (and `out` is then
    /// left as it was).
    fn read_block(&self, b: u32, out: &mut Vec<u8>) -> Result<()>;
    /// Overwrites block `b` with bytes in the common layout (exactly
    /// [`KvGeometry::block_bytes`] of them).
    fn write_block(&mut self, b: u32, bytes: &[u8]) -> Result<()>;
    /// A line for logs and status: what runs this worker.
    fn describe(&self) -> String;
    /// A device's own memory (used, total) in bytes, where the backend has one (a GPU).
    fn device_memory(&self) -> Option<(u64, u64)> {
        None
    }
}

#[cfg_attr(not(feature = "gpu"), allow(dead_code))]
/// Host-side bookkeeping of one step, checked before anything reaches the device (a kernel
/// indexes what it is given; nothing out of range may reach it).
#[derive(Default, Debug, PartialEq)]
pub(crate) struct StepRows {
    pub tokens: Vec<i32>,
    pub pos: Vec<i32>,
    pub blk: Vec<i32>,
    pub slot: Vec<i32>,
    pub tables: Vec<i32>,
    pub table_at: Vec<i32>,
    pub last: Vec<i32>,
    pub max_ctx: usize,
}

#[cfg_attr(not(feature = "gpu"), allow(dead_code))]
/// Flattens `items` into per-row arrays, refusing what the CPU forward refuses (too long, a
/// short block table, a token outside the vocabulary) and any block outside the cache.
pub(crate) fn step_rows(items: &[ForwardItem<'_>], max_pos: usize, block_size: usize, num_blocks: usize, vocab: usize) -> Result<StepRows> {
    let mut r = StepRows::default();
    for it in items {
        let end = it.start_pos + it.tokens.len();
        if end > max_pos {
            return Err(WorkerError::TooLong { needed: end, limit: max_pos });
        }
        let used = end.div_ceil(block_size);
        if it.block_table.len() < used {
            return Err(WorkerError::Invalid(format!("block table covers {} tokens, need {end}", it.block_table.len() * block_size)));
        }
        if let Some(b) = it.block_table[..used].iter().find(|&&b| b as usize >= num_blocks) {
            return Err(WorkerError::Invalid(format!("block {b} is outside the cache's {num_blocks}")));
        }
        let at = r.tables.len() as i32;
        r.tables.extend(it.block_table[..used].iter().map(|&b| b as i32));
        for (j, &tok) in it.tokens.iter().enumerate() {
            if tok as usize >= vocab {
                return Err(WorkerError::Invalid(format!("token id {tok} out of vocabulary")));
            }
            let p = it.start_pos + j;
            r.tokens.push(tok as i32);
            r.pos.push(p as i32);
            r.blk.push(it.block_table[p / block_size] as i32);
            r.slot.push((p % block_size) as i32);
            r.table_at.push(at);
        }
        r.max_ctx = r.max_ctx.max(end);
        let n = r.tokens.len() as i32;
        r.last.extend(n - it.logits.min(it.tokens.len()) as i32..n);
    }
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_rows_flatten_and_refuse_what_the_device_must_not_index() {
        let t1 = [3u32, 9];
        let t2 = [5u32];
        let items = [
            ForwardItem { tokens: &[1, 2, 3], start_pos: 0, block_table: &t1, logits: 1 },
            ForwardItem { tokens: &[7], start_pos: 4, block_table: &t2, logits: 0 },
        ];
        // Block size 4: the second item's position 4 is in its table's second block, which it lacks.
        assert!(step_rows(&items, 64, 4, 16, 100).unwrap_err().to_string().contains("block table covers"));
        let t2 = [5u32, 6];
        let items = [
            ForwardItem { tokens: &[1, 2, 3], start_pos: 0, block_table: &t1, logits: 1 },
            ForwardItem { tokens: &[7], start_pos: 4, block_table: &t2, logits: 0 },
        ];
        let r = step_rows(&items, 64, 4, 16, 100).unwrap();
        assert_eq!(r.tokens, [1, 2, 3, 7]);
        assert_eq!(r.pos, [0, 1, 2, 4]);
        assert_eq!((r.blk, r.slot), (vec![3, 3, 3, 6], vec![0, 1, 2, 0]));
        assert_eq!((r.tables, r.table_at), (vec![3, 5, 6], vec![0, 0, 0, 1]));
        assert_eq!((r.last, r.max_ctx), (vec![2], 5));
        assert!(step_rows(&items, 64, 4, 6, 100).unwrap_err().to_string().contains("outside the cache"));
        assert!(step_rows(&items, 64, 4, 16, 5).unwrap_err().to_string().contains("out of vocabulary"));
        assert!(matches!(step_rows(&items, 4, 4, 16, 100), Err(WorkerError::TooLong { .. })));
    }
}
