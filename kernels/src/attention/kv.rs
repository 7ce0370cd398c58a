//! The KV cache's element type and layout, and the views the attention kernels read.

/// The element type of the KV cache.
pub type KvElem = f32;

#[inline(always)]
pub(crate) fn to_kv(x: f32) -> KvElem {
    x
}
#[inline(always)]
pub(crate) fn from_kv(x: KvElem) -> f32 {
    x
}
/// A zero KV element.
pub const KV_ZERO: KvElem = 0.0;

/// Geometry of one layer's cache.
#[derive(Clone, Copy, Debug)]
pub struct KvLayout {
    pub block_size: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

impl KvLayout {
    /// Elements of one block of one layer, for K (or V).
    pub fn block_elems(&self) -> usize {
        self.block_size * self.n_kv_heads * self.head_dim
    }

    /// Offset of (block, head, slot) in a layer's K (or V) array.
    #[inline(always)]
    pub fn offset(&self, block: usize, head: usize, slot: usize) -> usize {
        ((block * self.n_kv_heads + head) * self.block_size + slot) * self.head_dim
    }
}

/// Writes one token's K and V rows (`n_kv_heads * head_dim` each) at `pos` through `table`.
pub fn write_kv(layout: &KvLayout, k_cache: &mut [KvElem], v_cache: &mut [KvElem], table: &[u32], pos: usize, k: &[f32], v: &[f32]) {
    let block = table[pos / layout.block_size] as usize;
    let slot = pos % layout.block_size;
    let hd = layout.head_dim;
    for h in 0..layout.n_kv_heads {
        let off = layout.offset(block, h, slot);
        for i in 0..hd {
            k_cache[off + i] = to_kv(k[h * hd + i]);
            v_cache[off + i] = to_kv(v[h * hd + i]);
        }
    }
}

/// One layer's K and V caches and their geometry.
#[derive(Clone, Copy, Debug)]
pub struct KvView<'a> {
    pub layout: &'a KvLayout,
    pub k: &'a [KvElem],
    pub v: &'a [KvElem],
}

/// The query heads of one row that read one KV head: their queries (`group * head_dim` values,
/// consecutive heads), the sequence's block table, the row's position, the KV head, and the
/// softmax scale.
#[derive(Clone, Copy, Debug)]
pub struct Query<'a> {
    pub table: &'a [u32],
    pub pos: usize,
    pub kv_head: usize,
    pub q: &'a [f32],
    pub scale: f32,
}

/// The most query heads per KV head (grouped-query attention) the kernels take.
pub const MAX_GROUP: usize = 64;

/// Scratch space for [`super::attend_group`], reused across calls.
#[derive(Default)]
pub struct Scratch {
    /// Scores (then softmax weights), `n` per head.
    pub(super) scores: Vec<f32>,
    /// Each position's offset in the layer's K and V arrays.
    pub(super) offsets: Vec<usize>,
}
