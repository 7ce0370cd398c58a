//! Paged attention on the CPU.
//!
//! K and V live in a block pool (f32 by default, so results match the reference implementation
//! exactly, or f16: see [`KvElement`]), laid out per layer in groups of consecutive blocks as
//! `[group][kv_head][block in group][slot][head_dim]` ([`KvLayout`]): one head's keys of a whole
//! group are contiguous. A sequence names its blocks in a block table; position `p` lives in block
//! `table[p / block_size]` at slot `p % block_size`. Attention reads K/V through the table in
//! place: nothing is gathered into a contiguous copy.
//!
//! For each query (a token at position `pos`) and head, scores over positions `0..=pos` are
//! computed in order, softmaxed with the max subtracted, and V is accumulated in order. The
//! arithmetic for one query depends only on its own q and the cached K/V, never on the other
//! queries in the batch or on how a prompt was chunked.

mod kv;
mod portable;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(test)]
mod tests;

pub use kv::{kv_bytes, kv_from_bytes, run_group, AttnRow, KvElement, KvLayout, KvView, Query, Scratch, MAX_GROUP, RUN_POSITIONS};
pub use portable::dot8_fma;

/// Attention for one row's query heads that share a KV head: `out` receives `group *
/// head_dim` values, each head's exactly as if it ran alone. Crate-private: other crates call
/// [`paged_attention`], so this generic body is compiled here only (see [`KvKernels`]).
pub(crate) fn attend_group<E: KvElement>(kv: &KvView<'_, E>, query: &Query<'_>, scratch: &mut Scratch, out: &mut [f32]) {
    let hd = kv.layout.head_dim;
    let group = query.q.len() / hd;
    assert!(query.q.len() % hd == 0 && out.len() == query.q.len() && group <= MAX_GROUP);
    #[cfg(target_arch = "x86_64")]
    if crate::has_avx2() && hd % 8 == 0 && hd <= 256 {
        if crate::has_avx512vl() {
            // SAFETY: AVX2, FMA, F16C, AVX-512F and VL were detected at run time; the head
            // size is checked.
            unsafe { avx2::attend_group_wide(kv, query, scratch, out) };
        } else {
            // SAFETY: AVX2, FMA and F16C were detected at run time; the head size is checked.
            unsafe { avx2::attend_group(kv, query, scratch, out) };
        }
        return;
    }
    for h in 0..group {
        let one = Query { q: &query.q[h * hd..(h + 1) * hd], ..*query };
        portable::attend_one(kv, &one, &mut scratch.scores, &mut out[h * hd..(h + 1) * hd]);
    }
}


thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

/// The KV element types whose kernels this crate compiles (f32 and f16), and the way other
/// crates call them.
///
/// Each impl is a plain, non-generic function of this crate, so the generic kernel bodies are
/// instantiated here, under this crate's build profile. Called generically from another crate,
/// they would be instantiated in that crate instead, under *its* profile: in a dev build (what
/// the tests and the benchmark scripts run) that put debug assertions and the standard
/// library's UB checks (one on every `ptr::add`) into the attention loops, with the spills they
/// cause, and cost about 30% of a 16-stream decode step (BENCHMARKS.md, "Kernels compiled where
/// they live").
pub trait KvKernels: KvElement {
    /// [`paged_attention`] over this element type.
    #[allow(clippy::too_many_arguments)]
    fn paged_attention(pool: &crate::pool::ThreadPool, kv: &KvView<'_, Self>, rows: &[AttnRow<'_>], q: &[f32], q_stride: usize, n_heads: usize, scale: f32, out: &mut [f32]);
    /// [`write_kv`] for this element type.
    #[allow(clippy::too_many_arguments)]
    fn write_kv(layout: &KvLayout, k_cache: &mut [Self], v_cache: &mut [Self], table: &[u32], pos: usize, k: &[f32], v: &[f32]);
    /// [`write_kv_rows`] for this element type.
    #[allow(clippy::too_many_arguments)]
    fn write_kv_rows(pool: &crate::pool::ThreadPool, layout: &KvLayout, k_cache: &mut [Self], v_cache: &mut [Self], rows: &[AttnRow<'_>], src: &mut [f32], stride: usize, at: (usize, usize), prep: &(dyn Fn(usize, &mut [f32]) + Sync));
}

macro_rules! kv_kernels {
    ($($t:ty),*) => {$(
        impl KvKernels for $t {
            #[inline(never)]
            fn paged_attention(pool: &crate::pool::ThreadPool, kv: &KvView<'_, Self>, rows: &[AttnRow<'_>], q: &[f32], q_stride: usize, n_heads: usize, scale: f32, out: &mut [f32]) {
                attend_rows::<$t>(pool, kv, rows, q, q_stride, n_heads, scale, out)
            }
            #[inline(never)]
            fn write_kv(layout: &KvLayout, k_cache: &mut [Self], v_cache: &mut [Self], table: &[u32], pos: usize, k: &[f32], v: &[f32]) {
                kv::write_token::<$t>(layout, k_cache, v_cache, table, pos, k, v)
            }
            #[inline(never)]
            fn write_kv_rows(pool: &crate::pool::ThreadPool, layout: &KvLayout, k_cache: &mut [Self], v_cache: &mut [Self], rows: &[AttnRow<'_>], src: &mut [f32], stride: usize, at: (usize, usize), prep: &(dyn Fn(usize, &mut [f32]) + Sync)) {
                kv::write_rows::<$t>(pool, layout, k_cache, v_cache, rows, src, stride, at, prep)
            }
        }
    )*};
}
kv_kernels!(f32, half::f16);

/// Attention for a batch of query rows, parallel over (row, head).
///
/// `q` holds row `t`'s query heads at `q[t * q_stride .. t * q_stride + n_heads * head_dim]`;
/// `out` receives `n_heads * head_dim` values per row. Query head `h` reads KV head
/// `h / (n_heads / n_kv_heads)` (grouped-query attention).
#[allow(clippy::too_many_arguments)]
pub fn paged_attention<E: KvKernels>(pool: &crate::pool::ThreadPool, kv: &KvView<'_, E>, rows: &[AttnRow<'_>], q: &[f32], q_stride: usize, n_heads: usize, scale: f32, out: &mut [f32]) {
    E::paged_attention(pool, kv, rows, q, q_stride, n_heads, scale, out)
}

/// Writes one token's K and V rows (`n_kv_heads * head_dim` each) at `pos` through `table`.
pub fn write_kv<E: KvKernels>(layout: &KvLayout, k_cache: &mut [E], v_cache: &mut [E], table: &[u32], pos: usize, k: &[f32], v: &[f32]) {
    E::write_kv(layout, k_cache, v_cache, table, pos, k, v)
}

/// Writes the K and V of every row in `rows` (row `t` at its position, through its block
/// table), in parallel over rows. Row `t`'s values are `src[t * stride..][..stride]`, its K at
/// offset `at.0` and its V at `at.1` (`n_kv_heads * head_dim` each); `prep(t, row)` runs on
/// them first, in the same task (the caller's bias and rotary embedding, so those run in
/// parallel too). Rows that name one slot (sequences recomputing the last token of one
/// cached block) are written in row order on the calling thread instead. Panics, before
/// anything is written, if a row's block lies outside the cache.
#[allow(clippy::too_many_arguments)]
pub fn write_kv_rows<E: KvKernels>(pool: &crate::pool::ThreadPool, layout: &KvLayout, k_cache: &mut [E], v_cache: &mut [E], rows: &[AttnRow<'_>], src: &mut [f32], stride: usize, at: (usize, usize), prep: &(dyn Fn(usize, &mut [f32]) + Sync)) {
    E::write_kv_rows(pool, layout, k_cache, v_cache, rows, src, stride, at, prep)
}

/// [`paged_attention`]'s body (instantiated in this crate only, through [`KvKernels`]).
#[allow(clippy::too_many_arguments)]
fn attend_rows<E: KvElement>(pool: &crate::pool::ThreadPool, kv: &KvView<'_, E>, rows: &[AttnRow<'_>], q: &[f32], q_stride: usize, n_heads: usize, scale: f32, out: &mut [f32]) {
    let layout = kv.layout;
    let hd = layout.head_dim;
    let group = n_heads / layout.n_kv_heads;
    assert!(group >= 1 && n_heads % layout.n_kv_heads == 0);
    let od = n_heads * hd;
    assert_eq!(out.len(), rows.len() * od);
    assert!(q.len() >= (rows.len().saturating_sub(1)) * q_stride + od);
    let op = crate::SyncPtr(out.as_mut_ptr());
    let n_out = out.len();
    // One task per (row, KV head): the `group` query heads that read the same K/V run together
    // (one pass over K and V for all of them). Tasks are claimed longest context first, so
    // the threads end on the short ones and finish nearly together (which row a task serves
    // changes no value).
    let n_kv = layout.n_kv_heads;
    let mut order: Vec<usize> = (0..rows.len()).collect();
    order.sort_by_key(|&t| std::cmp::Reverse(rows[t].pos));
    pool.run(rows.len() * n_kv, |task| {
        let (t, kvh) = (order[task / n_kv], task % n_kv);
        let row = rows[t];
        // SAFETY: task (t, kvh) writes only out[t*od + h*hd .. + hd] for its own query heads h,
        // disjoint across tasks; `out` outlives `pool.run`.
        let out_all = unsafe { std::slice::from_raw_parts_mut(op.get(), n_out) };
        let heads = kvh * group * hd..(kvh + 1) * group * hd;
        let qg = &q[t * q_stride + heads.start..t * q_stride + heads.end];
        let o = &mut out_all[t * od + heads.start..t * od + heads.end];
        SCRATCH.with(|s| attend_group(kv, &Query { table: row.table, pos: row.pos, kv_head: kvh, q: qg, scale }, &mut s.borrow_mut(), o));
    });
}
