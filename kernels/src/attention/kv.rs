//! The KV cache's element type and layout, and the views the attention kernels read.

/// An element type the KV cache can hold. K and V are computed in f32 and rounded to the
/// element once, when written; the kernels widen them back to f32 as they read, so every
/// product and sum runs in f32 whatever the element.
///
/// - `f32` (the default): exact, so logits match the reference implementation's.
/// - `half::f16` (llama.cpp's own default): half the memory and half the bytes attention reads
///   per step, at the price of rounding K and V to 11 significant bits, which moves logits
///   (and some greedy answers).
pub trait KvElement: Copy + Send + Sync + std::fmt::Debug + PartialEq + 'static {
    /// Whether the element is IEEE binary16 (the SIMD kernels widen it with F16C).
    const IS_F16: bool;
    /// The zero element.
    const ZERO: Self;
    /// `x` rounded to the element (round to nearest, ties to even).
    fn from_f32(x: f32) -> Self;
    /// The element as f32 (exact).
    fn to_f32(self) -> f32;
}

impl KvElement for f32 {
    const IS_F16: bool = false;
    const ZERO: Self = 0.0;
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

impl KvElement for half::f16 {
    const IS_F16: bool = true;
    const ZERO: Self = half::f16::ZERO;
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        half::f16::from_f32(x)
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
}

/// Views KV elements as their little-endian bytes (KV blocks in transit are copied this way).
pub fn kv_bytes<E: KvElement>(values: &[E]) -> &[u8] {
    assert!(cfg!(target_endian = "little"), "zerolayer kernels assume a little-endian target");
    // SAFETY: a u8 has no alignment requirement and every byte of an f32 or f16 is
    // initialized; the length is the same memory's size in bytes.
    unsafe { std::slice::from_raw_parts(values.as_ptr() as *const u8, std::mem::size_of_val(values)) }
}

/// Overwrites `dst` with elements from their little-endian bytes (`bytes` may be unaligned).
pub fn kv_from_bytes<E: KvElement>(dst: &mut [E], bytes: &[u8]) {
    assert!(cfg!(target_endian = "little"), "zerolayer kernels assume a little-endian target");
    assert_eq!(bytes.len(), std::mem::size_of_val(dst), "KV bytes for {} elements", dst.len());
    // SAFETY: the lengths are equal (checked); every bit pattern is a valid f32 or f16, and a
    // byte copy has no alignment requirement.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst.as_mut_ptr() as *mut u8, bytes.len()) }
}

/// Positions of one KV head that a sequence's consecutive blocks keep in one contiguous run
/// (see [`KvLayout::group`]): 16 KiB at head size 64 in f32. Runs of 64 positions against 16
/// (engine side by side, 16 sequences at 110-token prompts, 256 generated): 1.03–1.28, ahead
/// in 6 of 6; 128 and 256 gained a further 3–5%, but each group a sequence starts is a whole
/// free group, and larger groups run out sooner in a full cache (BENCHMARKS "KV runs of 64
/// positions").
pub const RUN_POSITIONS: usize = 64;

/// Geometry of one layer's cache.
///
/// Blocks are laid out in groups of `group` consecutive block ids, each group as
/// `[kv_head][block in group][slot][head_dim]`: within a group, one KV head's slots of all its
/// blocks are contiguous. A sequence that holds a whole group (the block pool hands out
/// consecutive ids within a group, [`run_group`]) has runs of `group * block_size` positions
/// per head for attention to stream, while blocks stay small for prefix sharing. With
/// `group == 1` this is `[block][kv_head][slot][head_dim]`, the layout the GPU backend keeps.
/// Where a block lives changes no value: attention reads K/V through the offsets.
#[derive(Clone, Copy, Debug)]
pub struct KvLayout {
    pub block_size: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Blocks per group (at least 1).
    pub group: usize,
}

/// Blocks per group for `block_size`: enough for runs of [`RUN_POSITIONS`] positions (16 at
/// the default block size of 4; 1 from 64 up). The block pool groups its free blocks by the same
/// count, so the two agree.
pub fn run_group(block_size: usize) -> usize {
    (RUN_POSITIONS / block_size.max(1)).max(1)
}

impl KvLayout {
    /// The CPU cache's layout: groups of [`run_group`] blocks.
    pub fn new(block_size: usize, n_kv_heads: usize, head_dim: usize) -> Self {
        KvLayout { block_size, n_kv_heads, head_dim, group: run_group(block_size) }
    }

    /// Elements of one block of one layer, for K (or V).
    pub fn block_elems(&self) -> usize {
        self.block_size * self.n_kv_heads * self.head_dim
    }

    /// Elements of a layer's K (or V) array that holds `blocks` blocks (whole groups).
    pub fn elems(&self, blocks: usize) -> usize {
        blocks.next_multiple_of(self.group.max(1)) * self.block_elems()
    }

    /// Offset of (block, head, slot) in a layer's K (or V) array.
    #[inline(always)]
    pub fn offset(&self, block: usize, head: usize, slot: usize) -> usize {
        let g = self.group;
        (((block / g * self.n_kv_heads + head) * g + block % g) * self.block_size + slot) * self.head_dim
    }
}

/// [`super::write_kv`]'s body (instantiated in this crate only, through [`super::KvKernels`]).
pub(super) fn write_token<E: KvElement>(layout: &KvLayout, k_cache: &mut [E], v_cache: &mut [E], table: &[u32], pos: usize, k: &[f32], v: &[f32]) {
    let block = table[pos / layout.block_size] as usize;
    let slot = pos % layout.block_size;
    let hd = layout.head_dim;
    for h in 0..layout.n_kv_heads {
        let off = layout.offset(block, h, slot);
        for i in 0..hd {
            k_cache[off + i] = E::from_f32(k[h * hd + i]);
            v_cache[off + i] = E::from_f32(v[h * hd + i]);
        }
    }
}

/// [`super::write_kv_rows`]'s body (instantiated in this crate only, through [`super::KvKernels`]).
#[allow(clippy::too_many_arguments)]
pub(super) fn write_rows<E: KvElement>(
    pool: &crate::pool::ThreadPool,
    layout: &KvLayout,
    k_cache: &mut [E],
    v_cache: &mut [E],
    rows: &[AttnRow<'_>],
    src: &mut [f32],
    stride: usize,
    (k_at, v_at): (usize, usize),
    prep: &(dyn Fn(usize, &mut [f32]) + Sync),
) {
    let (hd, heads, bs) = (layout.head_dim, layout.n_kv_heads, layout.block_size);
    let kvd = heads * hd;
    assert!(k_at + kvd <= stride && v_at + kvd <= stride && src.len() >= rows.len() * stride, "K/V outside the rows");
    assert_eq!(k_cache.len(), v_cache.len());
    // Every row's (block, slot), checked here, on the calling thread (a panic inside a task
    // would take a pool thread down): inside the cache.
    let mut at: Vec<(usize, usize)> = Vec::with_capacity(rows.len());
    for r in rows {
        let block = *r.table.get(r.pos / bs).expect("block table too short") as usize;
        let slot = r.pos % bs;
        assert!(layout.offset(block, heads - 1, slot) + hd <= k_cache.len(), "block {block} outside the cache");
        at.push((block, slot));
    }
    let (kp, vp, sp) = (crate::SyncPtr(k_cache.as_mut_ptr()), crate::SyncPtr(v_cache.as_mut_ptr()), crate::SyncPtr(src.as_mut_ptr()));
    // Row `t`: `prep`, then its K and V to its slot.
    let write = |t: usize, (block, slot): (usize, usize)| {
        // SAFETY: the caller gives each row index to one thread at a time (below), so row
        // `t`'s `stride` values of `src` (in bounds: checked above) have one writer; `src`
        // outlives every call.
        let row = unsafe { std::slice::from_raw_parts_mut(sp.get().add(t * stride), stride) };
        prep(t, row);
        for h in 0..heads {
            let off = layout.offset(block, h, slot);
            for i in 0..hd {
                // SAFETY: `off + hd` is within both caches (checked above for the last head,
                // the largest offset); the caller writes each slot from one thread at a time
                // (below); the caches outlive every call.
                unsafe {
                    kp.get().add(off + i).write(E::from_f32(row[k_at + h * hd + i]));
                    vp.get().add(off + i).write(E::from_f32(row[v_at + h * hd + i]));
                }
            }
        }
    };
    let mut seen: Vec<(usize, usize)> = at.clone();
    seen.sort_unstable();
    if seen.windows(2).any(|w| w[0] == w[1]) {
        // Two rows on one slot (sequences that both recompute the last token of one cached
        // block write the same values there): in row order on this thread, as one writer.
        for (t, &a) in at.iter().enumerate() {
            write(t, a);
        }
        return;
    }
    let n = rows.len();
    let tasks = n.min(2 * pool.n_threads());
    // Distinct slots: each task writes its own rows, in parallel.
    pool.run(tasks, |task| {
        let (lo, hi) = (task * n / tasks, (task + 1) * n / tasks);
        for (t, &a) in at.iter().enumerate().take(hi).skip(lo) {
            write(t, a);
        }
    });
}

/// One query row of a batched attention call: its sequence's block table and its position.
#[derive(Clone, Copy, Debug)]
pub struct AttnRow<'a> {
    pub table: &'a [u32],
    pub pos: usize,
}

/// One layer's K and V caches, their geometry, and how far back the layer's queries look.
#[derive(Clone, Copy, Debug)]
pub struct KvView<'a, E: KvElement> {
    pub layout: &'a KvLayout,
    pub k: &'a [E],
    pub v: &'a [E],
    /// A sliding-window layer's span: a query at position `p` reads positions
    /// `p + 1 - window ..= p` (the last `window`, itself included; llama.cpp's standard SWA).
    /// 0: every position `0..=p`.
    pub window: usize,
}

impl<E: KvElement> KvView<'_, E> {
    /// The first position a query at `pos` reads.
    #[inline(always)]
    pub fn first_visible(&self, pos: usize) -> usize {
        if self.window == 0 {
            0
        } else {
            (pos + 1).saturating_sub(self.window)
        }
    }
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
