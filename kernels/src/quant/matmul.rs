//! The matmul driver: activation quantization and weight-row tiles on the pool, the scalar
//! reference dot product, and the choice of kernel.

use super::activation::{quantize_row, ActBlock};
use super::format::{widen, Weight, WeightFormat, PANEL, QK};
#[cfg(target_arch = "x86_64")]
use super::simd as avx2;
#[cfg(target_arch = "x86_64")]
use super::simd512;
use crate::pool::ThreadPool;
use crate::SyncPtr;

/// The scalar reference: row `r` of `w` against one quantized activation row. Exactly the
/// arithmetic of candle's and ggml's `vec_dot` for these formats (per block: exact integer sum,
/// then `sumi * d_w * d_a (+ m_w * s_a)`, accumulated in block order).
pub(super) fn dot_block_row(w: &Weight, r: usize, a: &[ActBlock]) -> f32 {
    let mut acc = 0f32;
    for (j, ab) in a.iter().enumerate() {
        let b = w.block(r, j);
        let term = if w.format == WeightFormat::Q6K {
            // Two 16-element halves with their own scales: `(Σlo·d_lo + Σhi·d_hi) · d_a`.
            let half = |h: std::ops::Range<usize>| h.map(|k| b.q[k] * ab.qs[k] as i32).sum::<i32>() as f32;
            (half(0..QK / 2) * b.d + half(QK / 2..QK) * b.m) * ab.d
        } else {
            let mut sumi = 0i32;
            for (q, &x) in b.q.iter().zip(&ab.qs) {
                sumi += q * x as i32;
            }
            let mut term = sumi as f32 * b.d * ab.d;
            if w.format.has_min() {
                term += b.m * ab.s;
            }
            term
        };
        acc += term;
    }
    acc
}

/// f32 dot product with eight independent lanes, reduced in a fixed tree order.
#[inline(always)]
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

#[inline(always)]
pub(super) fn f32_row(bytes: &[u8]) -> &[f32] {
    // Weight data is built from f32 values in `Weight::from_f32` or loaded little-endian; on a
    // little-endian target reinterpretation is exact. Alignment is checked.
    crate::cast_f32(bytes)
}

/// Memory for a matmul to bring into the caches while it computes: for each of `bases`, runs
/// of `run_bytes` (a multiple of 64) at byte offsets `runs`. The lines are shared out over the
/// matmul's tiles and prefetched a few after each panel block, so the loads of a later
/// memory-bound pass (the next layer's attention reading its KV) overlap this compute-bound
/// one. A hint: no value anywhere depends on it, and any address may be named.
#[derive(Clone, Copy)]
pub struct Warm<'a> {
    pub bases: &'a [*const u8],
    pub runs: &'a [usize],
    pub run_bytes: usize,
    /// The share of all the lines this matmul takes, as a fraction range (`0.0..1.0`: all),
    /// so that consecutive matmuls can split one warming between them.
    pub share: (f32, f32),
}

// SAFETY: the pointers are only turned into prefetch addresses, never dereferenced.
unsafe impl Sync for Warm<'_> {}

impl Warm<'_> {
    fn lines(&self) -> usize {
        self.bases.len() * self.runs.len() * (self.run_bytes / 64)
    }

    /// The cursor of the task computing `panels` of `of`: its share of the lines in
    /// proportion, spread over `blocks` panel blocks.
    #[cfg(target_arch = "x86_64")]
    pub(super) fn cursor(&self, panels: &std::ops::Range<usize>, of: usize, blocks: usize) -> avx2::WarmCursor {
        let lpr = (self.run_bytes / 64).max(1);
        let all = self.lines();
        let (lo, hi) = ((all as f32 * self.share.0) as usize, ((all as f32 * self.share.1) as usize).min(all));
        let total = hi.saturating_sub(lo);
        let of = of.max(1);
        let (from, to) = (lo + panels.start * total / of, lo + panels.end * total / of);
        if self.runs.is_empty() || to == from {
            return avx2::WarmCursor::NONE;
        }
        avx2::WarmCursor {
            bases: self.bases.as_ptr(),
            n_bases: self.bases.len(),
            runs: self.runs.as_ptr(),
            n_runs: self.runs.len(),
            lines_per_run: lpr,
            per_block: (to - from).div_ceil(blocks.max(1)),
            base: from / (self.runs.len() * lpr),
            run: (from / lpr) % self.runs.len(),
            line: from % lpr,
            left: to - from,
        }
    }
}

/// Scratch space reused across calls so the decode loop does not allocate.
#[derive(Default)]
pub struct MatmulScratch {
    act: Vec<ActBlock>,
    x: Vec<f32>,
}

/// Rows of weights per task by size: about 32 KiB of weights, between 8 and 128 rows, whole
/// panels. Fewer, larger tasks than 16 KiB measured faster at batch 1 (task claiming costs a
/// shared atomic per task) and no slower batched.
pub(super) fn tile_rows(w: &Weight) -> usize {
    let rb = w.row_bytes().max(1);
    ((32768 / rb).clamp(8, 128) / PANEL) * PANEL
}

/// How one matmul's panels are split into pool tasks: `n_front` tiles of about [`tile_rows`]
/// (their count rounded up to a multiple of the pool's threads, so every thread gets as many:
/// wo at SmolLM2's shape is 6 tiles of 9–10 panels, not 5 of 11 and one thread idle for a
/// fifth of it), then a tail that halves: one task per thread of half a tile, one of a
/// quarter, … down to one panel. Tasks are claimed in order, so the threads end on small
/// tasks and finish nearly together: with equal tiles alone a thread waited about half a tile
/// at the end of every region (3–5 µs, 150 regions a step at 16 sequences). Where tasks fall
/// changes no value: each output is one dot product in a fixed order.
///
/// Sizes count `unit`s of panels: 2 for the 512-bit kernel, which takes panels in pairs (an
/// odd panel at a task's end runs at half its rate), so that every task but the matrix's last
/// holds whole pairs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Tasks {
    panels: usize,
    unit: usize,
    threads: usize,
    /// Units in the front tiles, and how many tiles they make.
    front: usize,
    n_front: usize,
    /// The tail's first size (half a tile), and its number of sizes (0: no tail).
    tail_first: usize,
    levels: usize,
}

impl Tasks {
    #[cfg(test)]
    pub(super) fn new(w: &Weight, threads: usize) -> Tasks {
        Tasks::new_in(w, threads, 1)
    }

    /// The tasks for `threads` threads, in units of `unit` panels.
    pub(super) fn new_in(w: &Weight, threads: usize, unit: usize) -> Tasks {
        let panels = w.rows.div_ceil(PANEL);
        let unit = unit.max(1);
        let units = panels.div_ceil(unit);
        let threads = threads.max(1);
        let per = (tile_rows(w) / PANEL / unit).max(1);
        let (tail_first, mut levels, mut tail) = (per / 2, 0, 0);
        // A tail only where the front keeps at least two tiles per thread.
        if threads > 1 && units >= 4 * threads * per {
            let mut s = tail_first;
            while s >= 1 {
                levels += 1;
                tail += threads * s;
                s /= 2;
            }
        }
        let front = units - tail;
        let n_front = front.div_ceil(per).next_multiple_of(threads).min(front);
        Tasks { panels, unit, threads, front, n_front, tail_first, levels }
    }

    /// How many tasks there are.
    pub(super) fn count(&self) -> usize {
        self.n_front + self.levels * self.threads
    }

    /// The panels of task `t` (`t < count()`).
    pub(super) fn panels(&self, t: usize) -> std::ops::Range<usize> {
        let units = self.units(t);
        (units.start * self.unit).min(self.panels)..(units.end * self.unit).min(self.panels)
    }

    /// The units of task `t`.
    fn units(&self, t: usize) -> std::ops::Range<usize> {
        if t < self.n_front {
            return t * self.front / self.n_front..(t + 1) * self.front / self.n_front;
        }
        let (level, i) = ((t - self.n_front) / self.threads, (t - self.n_front) % self.threads);
        let mut at = self.front;
        for l in 0..level {
            at += self.threads * (self.tail_first >> l);
        }
        let size = self.tail_first >> level;
        at + i * size..at + (i + 1) * size
    }

    /// All the panels.
    pub(super) fn total(&self) -> usize {
        self.panels
    }

    /// How many tasks are front tiles (the rest are the tail).
    #[cfg(test)]
    pub(super) fn front_tasks(&self) -> usize {
        self.n_front
    }
}

/// `y[b × rows] = x[b × cols] · Wᵀ` for `b = x.len() / cols` activation rows.
pub fn matmul(pool: &ThreadPool, w: &Weight, x: &[f32], y: &mut [f32], scratch: &mut MatmulScratch) {
    matmul_warming(pool, w, x, y, scratch, None)
}

/// [`matmul`], bringing `warm` into the caches as it computes.
pub fn matmul_warming(pool: &ThreadPool, w: &Weight, x: &[f32], y: &mut [f32], scratch: &mut MatmulScratch, warm: Option<&Warm<'_>>) {
    let k = w.cols;
    assert_eq!(x.len() % k, 0);
    let b = x.len() / k;
    if w.format.is_float() {
        return multiply(pool, w, x, b, y, &[], warm);
    }
    let nb = k / QK;
    scratch.act.resize(b * nb, ActBlock::default());
    let ap = ActPtr(scratch.act.as_mut_ptr());
    pool.run(row_tasks(pool, b), |t| {
        for i in row_range(pool, b, t) {
            // SAFETY: task t writes only the blocks of its own rows, disjoint across tasks;
            // `scratch.act` holds b * nb blocks and outlives `pool.run`.
            let a = unsafe { std::slice::from_raw_parts_mut(ap.get().add(i * nb), nb) };
            quantize_row(&x[i * k..(i + 1) * k], a);
        }
    });
    multiply(pool, w, x, b, y, &scratch.act, warm);
}

/// `y = X · Wᵀ` where row `i` of the `b × cols` matrix `X` is written by `row(i, out)`: the rows
/// are produced (and quantized, for quantized weights) in parallel on the pool, then
/// multiplied. This fuses per-row work that feeds a projection (RMSNorm, SiLU·mul) into the
/// projection's activation quantization, in parallel instead of on the calling thread.
pub fn matmul_rows<R: Fn(usize, &mut [f32]) + Sync>(pool: &ThreadPool, w: &Weight, b: usize, y: &mut [f32], scratch: &mut MatmulScratch, row: R) {
    matmul_rows_warming(pool, w, b, y, scratch, None, row)
}

/// [`matmul_rows`], bringing `warm` into the caches as it computes.
pub fn matmul_rows_warming<R: Fn(usize, &mut [f32]) + Sync>(pool: &ThreadPool, w: &Weight, b: usize, y: &mut [f32], scratch: &mut MatmulScratch, warm: Option<&Warm<'_>>, row: R) {
    matmul_rows_state(pool, w, b, y, scratch, warm, &mut [], |i, _, out| row(i, out))
}

/// [`matmul_rows_warming`] where `row(i, state_i, out)` also gets row `i`'s share of `state`
/// (`state.len() / b` values, empty if `state` is), mutably: per-row state the same parallel
/// pass updates before the row is produced (the residual stream: `x += proj`, then RMSNorm
/// into `out`), instead of a serial pass over every row before the projection.
#[allow(clippy::too_many_arguments)]
pub fn matmul_rows_state<R: Fn(usize, &mut [f32], &mut [f32]) + Sync>(pool: &ThreadPool, w: &Weight, b: usize, y: &mut [f32], scratch: &mut MatmulScratch, warm: Option<&Warm<'_>>, state: &mut [f32], row: R) {
    let k = w.cols;
    let nb = k / QK;
    let quantized = !w.format.is_float();
    assert!(b > 0 || state.is_empty());
    let sw = if b == 0 { 0 } else { state.len() / b };
    assert_eq!(sw * b, state.len(), "state of {} values for {b} rows", state.len());
    scratch.x.resize(b * k, 0.0);
    if quantized {
        scratch.act.resize(b * nb, ActBlock::default());
    }
    let (xp, ap, sp) = (SyncPtr(scratch.x.as_mut_ptr()), ActPtr(scratch.act.as_mut_ptr()), SyncPtr(state.as_mut_ptr()));
    pool.run(row_tasks(pool, b), |t| {
        for i in row_range(pool, b, t) {
            // SAFETY: task t writes only row i's slices of `x`, `act` and `state` for its own
            // rows, disjoint across tasks; each holds b rows and outlives `pool.run`.
            let xr = unsafe { std::slice::from_raw_parts_mut(xp.get().add(i * k), k) };
            let st = unsafe { std::slice::from_raw_parts_mut(sp.get().add(i * sw), sw) };
            row(i, st, xr);
            if quantized {
                let a = unsafe { std::slice::from_raw_parts_mut(ap.get().add(i * nb), nb) };
                quantize_row(xr, a);
            }
        }
    });
    let act: &[ActBlock] = if quantized { &scratch.act } else { &[] };
    multiply(pool, w, &scratch.x, b, y, act, warm);
}

/// Pool tasks for `b` rows of per-row work: a few per thread (rows are cheap, regions are not).
pub(super) fn row_tasks(pool: &ThreadPool, b: usize) -> usize {
    b.min(2 * pool.n_threads())
}

/// The rows of task `t` of [`row_tasks`]: contiguous, sizes differing by at most one.
pub(super) fn row_range(pool: &ThreadPool, b: usize, t: usize) -> std::ops::Range<usize> {
    let n = row_tasks(pool, b);
    (t * b / n)..((t + 1) * b / n)
}

/// A raw pointer to activation blocks handed to pool tasks that write disjoint rows.
#[derive(Clone, Copy)]
pub(super) struct ActPtr(*mut ActBlock);
// SAFETY: only used to give pool tasks disjoint rows of a buffer that outlives the region.
unsafe impl Send for ActPtr {}
unsafe impl Sync for ActPtr {}
impl ActPtr {
    pub(super) fn get(self) -> *mut ActBlock {
        self.0
    }
}

/// The weight-tile region: `act` holds `b` quantized rows (quantized weights) and `x` the f32
/// rows (F32 weights).
pub(super) fn multiply(pool: &ThreadPool, w: &Weight, x: &[f32], b: usize, y: &mut [f32], act: &[ActBlock], warm: Option<&Warm<'_>>) {
    let n = w.rows;
    assert_eq!(y.len(), b * n);
    if b == 0 {
        return;
    }
    let kernel = Kernel::detect(b);
    let tasks = Tasks::new_in(w, pool.n_threads(), kernel.panel_unit());
    let yp = SyncPtr(y.as_mut_ptr());
    pool.run(tasks.count(), |t| {
        let p = tasks.panels(t);
        let (r0, r1) = (p.start * PANEL, (p.end * PANEL).min(n));
        // SAFETY: each task writes only columns r0..r1 of every output row, disjoint across
        // tasks, and `y` outlives `pool.run`.
        let y = unsafe { std::slice::from_raw_parts_mut(yp.get(), b * n) };
        #[cfg(target_arch = "x86_64")]
        let mut cursor = match (warm, kernel) {
            (Some(warm), Kernel::Avx2 | Kernel::Vnni | Kernel::Vnni512) => {
                let max = match kernel {
                    Kernel::Avx2 => avx2::AVX2_ROWS,
                    Kernel::Vnni512 => simd512::VNNI512_ROWS,
                    _ => avx2::VNNI_ROWS,
                };
                let blocks = (r1 - r0).div_ceil(PANEL) * (w.cols / QK) * avx2::chunks(b, max);
                warm.cursor(&p, tasks.total(), blocks)
            }
            _ => avx2::WarmCursor::NONE,
        };
        #[cfg(target_arch = "x86_64")]
        tile_run_body(kernel, w, x, act, y, r0, r1, b, &mut cursor);
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = warm; // the portable kernel takes no hints
            tile_run_body(kernel, w, x, act, y, r0, r1, b);
        }
    });
}

/// Which implementation runs (detected once per call; tests pick each explicitly).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kernel {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Vnni,
    /// The VNNI kernel on 512-bit vectors (two panels per vector).
    #[cfg(target_arch = "x86_64")]
    Vnni512,
}

impl Kernel {
    /// Panels the kernel takes at a time (see [`Tasks`]).
    pub(super) fn panel_unit(self) -> usize {
        #[cfg(target_arch = "x86_64")]
        if self == Kernel::Vnni512 {
            return 2;
        }
        1
    }

    /// The kernel for a product with `b` activation rows on this CPU.
    pub(super) fn detect(b: usize) -> Kernel {
        #[cfg(target_arch = "x86_64")]
        {
            if crate::has_vnni512() && b >= crate::vnni512_min_rows() {
                return Kernel::Vnni512;
            }
            if crate::has_vnni() {
                return Kernel::Vnni;
            }
            if crate::has_avx2() {
                return Kernel::Avx2;
            }
        }
        Kernel::Portable
    }
}

/// Rows `r0..r1` (whole panels, except at the end) of all `b` outputs.
#[cfg(test)]
#[allow(clippy::too_many_arguments)]
pub(super) fn tile_run(kernel: Kernel, w: &Weight, x: &[f32], act: &[ActBlock], y: &mut [f32], r0: usize, r1: usize, b: usize) {
    #[cfg(target_arch = "x86_64")]
    tile_run_body(kernel, w, x, act, y, r0, r1, b, &mut { avx2::WarmCursor::NONE });
    #[cfg(not(target_arch = "x86_64"))]
    tile_run_body(kernel, w, x, act, y, r0, r1, b);
}

/// [`tile_run`]; the SIMD kernels prefetch `warm`'s lines as they go.
#[allow(clippy::too_many_arguments)]
fn tile_run_body(kernel: Kernel, w: &Weight, x: &[f32], act: &[ActBlock], y: &mut [f32], r0: usize, r1: usize, b: usize, #[cfg(target_arch = "x86_64")] warm: &mut avx2::WarmCursor) {
    let k = w.cols;
    let n = w.rows;
    if w.format.is_float() {
        let rb = w.row_bytes();
        // F16 and BF16 rows widen (exactly) once per tile row, then multiply as F32 rows do:
        // the same products, bit for bit, as the weight widened at load would give.
        let mut wide = if w.format == WeightFormat::F32 { Vec::new() } else { vec![0f32; k] };
        for r in r0..r1 {
            let bytes = &w.data[r * rb..(r + 1) * rb];
            let wf = if w.format == WeightFormat::F32 {
                f32_row(bytes)
            } else {
                widen(w.format, bytes, &mut wide);
                &wide
            };
            for i in 0..b {
                y[i * n + r] = dot_f32(wf, &x[i * k..(i + 1) * k]);
            }
        }
        return;
    }
    let nb = k / QK;
    assert!(act.len() >= b * nb && y.len() >= b * n && r0.is_multiple_of(PANEL) && r1 <= n);
    match kernel {
        Kernel::Portable => {
            for r in r0..r1 {
                for i in 0..b {
                    y[i * n + r] = dot_block_row(w, r, &act[i * nb..(i + 1) * nb]);
                }
            }
        }
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 | Kernel::Vnni | Kernel::Vnni512 => {
            let p0 = r0 / PANEL;
            let p1 = r1.div_ceil(PANEL);
            let pb = nb * PANEL * w.format.block_bytes();
            // SAFETY: panels p0..p1 exist (r1 <= rows); `act` holds b rows of nb blocks and `y`
            // b rows of n (asserted above); each panel writes lanes r < n only; the CPU
            // features of the chosen kernel were detected at run time (`Kernel::detect`).
            unsafe {
                let panels = avx2::Panels { ptr: w.data.as_ptr().add(p0 * pb), pb, np: p1 - p0, lanes_last: r1 - (p1 - 1) * PANEL };
                let rows = avx2::Rows { acts: act.as_ptr(), nb, b, out: y.as_mut_ptr().add(p0 * PANEL), stride: n };
                if kernel == Kernel::Vnni512 {
                    return match w.format {
                        WeightFormat::Q4_1 => simd512::tile_vnni512::<avx2::Q41>(panels, rows, warm),
                        WeightFormat::Q4_0 => simd512::tile_vnni512::<avx2::Q40>(panels, rows, warm),
                        WeightFormat::Q8_0 => simd512::tile_vnni512::<avx2::Q80>(panels, rows, warm),
                        WeightFormat::Q4K => simd512::tile_vnni512::<avx2::Q4K>(panels, rows, warm),
                        WeightFormat::Q6K => simd512::tile_vnni512::<avx2::Q6K>(panels, rows, warm),
                        WeightFormat::Q5K => simd512::tile_vnni512::<avx2::Q5K>(panels, rows, warm),
                        WeightFormat::F32 | WeightFormat::F16 | WeightFormat::BF16 => unreachable!(),
                    };
                }
                match (w.format, kernel == Kernel::Vnni) {
                    (WeightFormat::Q4_1, true) => avx2::tile_vnni::<avx2::Q41>(panels, rows, warm),
                    (WeightFormat::Q4_0, true) => avx2::tile_vnni::<avx2::Q40>(panels, rows, warm),
                    (WeightFormat::Q8_0, true) => avx2::tile_vnni::<avx2::Q80>(panels, rows, warm),
                    (WeightFormat::Q4K, true) => avx2::tile_vnni::<avx2::Q4K>(panels, rows, warm),
                    (WeightFormat::Q6K, true) => avx2::tile_vnni::<avx2::Q6K>(panels, rows, warm),
                    (WeightFormat::Q5K, true) => avx2::tile_vnni::<avx2::Q5K>(panels, rows, warm),
                    (WeightFormat::Q4K, false) => avx2::tile_avx2::<avx2::Q4K>(panels, rows, warm),
                    (WeightFormat::Q6K, false) => avx2::tile_avx2::<avx2::Q6K>(panels, rows, warm),
                    (WeightFormat::Q5K, false) => avx2::tile_avx2::<avx2::Q5K>(panels, rows, warm),
                    (WeightFormat::Q4_1, false) => avx2::tile_avx2::<avx2::Q41>(panels, rows, warm),
                    (WeightFormat::Q4_0, false) => avx2::tile_avx2::<avx2::Q40>(panels, rows, warm),
                    (WeightFormat::Q8_0, false) => avx2::tile_avx2::<avx2::Q80>(panels, rows, warm),
                    (WeightFormat::F32 | WeightFormat::F16 | WeightFormat::BF16, _) => unreachable!(),
                }
            }
        }
    }
}
