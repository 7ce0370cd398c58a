//! Kernel tests: every path against the scalar reference, bit for bit, and formats against GGUF.
use super::activation::*;
use super::format::*;
use super::matmul::*;
use crate::pool::ThreadPool;
use half::f16;
use rand::{Rng, SeedableRng};

fn rand_vec(rng: &mut impl Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// GGUF-layout bytes of `v` quantized to `format` (as llama.cpp's reference quantizers do).
fn quantize_gguf(format: WeightFormat, v: &[f32]) -> Vec<u8> {
    let mut data = Vec::new();
    for blk in v.chunks_exact(QK) {
        let amax = blk.iter().fold(0f32, |m, x| m.max(x.abs()));
        match format {
            WeightFormat::Q8_0 => {
                let d = amax / 127.0;
                data.extend_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
                for x in blk {
                    data.push(((x / d).round() as i8) as u8);
                }
            }
            WeightFormat::Q4_0 => {
                let d = amax / 8.0;
                data.extend_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
                for i in 0..16 {
                    let q = |x: f32| (((x / d) + 8.5) as i32).clamp(0, 15) as u8;
                    data.push(q(blk[i]) | (q(blk[i + 16]) << 4));
                }
            }
            WeightFormat::Q4_1 => {
                let mn = blk.iter().cloned().fold(f32::MAX, f32::min);
                let mx = blk.iter().cloned().fold(f32::MIN, f32::max);
                let d = (mx - mn) / 15.0;
                data.extend_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
                data.extend_from_slice(&f16::from_f32(mn).to_bits().to_le_bytes());
                for i in 0..16 {
                    let q = |x: f32| (((x - mn) / d + 0.5) as i32).clamp(0, 15) as u8;
                    data.push(q(blk[i]) | (q(blk[i + 16]) << 4));
                }
            }
            f => unreachable!("{f:?}"),
        }
    }
    data
}

fn quantize_weight(format: WeightFormat, rows: usize, cols: usize, v: &[f32]) -> Weight {
    Weight::new(format, rows, cols, quantize_gguf(format, v))
}

/// ggml's scalar `vec_dot` on one GGUF-layout row: independent of the panel layout.
fn gguf_dot(format: WeightFormat, row: &[u8], a: &[ActBlock]) -> f32 {
    let mut acc = 0f32;
    for (b, ab) in row.chunks_exact(format.block_bytes()).zip(a) {
        let mut sumi = 0i32;
        let term = match format {
            WeightFormat::Q8_0 => {
                for i in 0..QK {
                    sumi += (b[2 + i] as i8) as i32 * ab.qs[i] as i32;
                }
                sumi as f32 * f16_at(b, 0) * ab.d
            }
            WeightFormat::Q4_0 => {
                for i in 0..16 {
                    let q = b[2 + i];
                    sumi += ((q & 0xF) as i32 - 8) * ab.qs[i] as i32 + ((q >> 4) as i32 - 8) * ab.qs[i + 16] as i32;
                }
                sumi as f32 * f16_at(b, 0) * ab.d
            }
            _ => {
                for i in 0..16 {
                    let q = b[4 + i];
                    sumi += (q & 0xF) as i32 * ab.qs[i] as i32 + (q >> 4) as i32 * ab.qs[i + 16] as i32;
                }
                sumi as f32 * f16_at(b, 0) * ab.d + f16_at(b, 2) * ab.s
            }
        };
        acc += term;
    }
    acc
}

/// Reference: dequantize the weights, use the f32 activations, accumulate in f64.
fn reference(w: &Weight, x: &[f32], b: usize) -> Vec<f32> {
    let mut row = vec![0f32; w.cols];
    let mut y = vec![0f32; b * w.rows];
    for r in 0..w.rows {
        w.dequantize_row(r, &mut row);
        for i in 0..b {
            let xr = &x[i * w.cols..(i + 1) * w.cols];
            y[i * w.rows + r] = row.iter().zip(xr).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() as f32;
        }
    }
    y
}

#[test]
fn quantize_row_paths_agree_bit_for_bit() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    for n in [32usize, 64, 576, 1536] {
        let mut x = rand_vec(&mut rng, n);
        // Exact halves after scaling (ties round away from zero), zeros and a zero block.
        x[0] = 1.0;
        x[1] = 0.5 / 127.0 * 3.0;
        x[2] = -2.5 / 127.0;
        x[3] = 0.0;
        if n >= 64 {
            x[32..64].fill(0.0);
        }
        let mut a = vec![ActBlock::default(); n / QK];
        let mut b = a.clone();
        quantize_row_portable(&x, &mut a);
        // `quantize_row` dispatches to the AVX2 code where it can run.
        assert_eq!(crate::test_simd_paths("quantize_row"), crate::has_avx2());
        quantize_row(&x, &mut b);
        for (a, b) in a.iter().zip(&b) {
            assert_eq!((a.d.to_bits(), a.s.to_bits(), a.sum, a.qs), (b.d.to_bits(), b.s.to_bits(), b.sum, b.qs));
            assert_eq!(a.sum, a.qs.iter().map(|&q| q as i32).sum::<i32>());
        }
    }
}

/// `x`'s rows (of `cols`) quantized, as `matmul` does.
fn quantize_rows(x: &[f32], cols: usize) -> Vec<ActBlock> {
    let nb = cols / QK;
    let mut act = vec![ActBlock::default(); x.len() / cols * nb];
    for (xr, ar) in x.chunks_exact(cols).zip(act.chunks_exact_mut(nb)) {
        quantize_row(xr, ar);
    }
    act
}

/// Every kernel this CPU can run (portable, AVX2, VNNI) gives exactly `want` (output bits)
/// for `b` rows, the work split into two tiles (the first whole panels), as `matmul` does.
fn assert_every_kernel_gives(w: &Weight, x: &[f32], act: &[ActBlock], b: usize, want: &[u32], what: &str) {
    let mut kernels = vec![Kernel::Portable];
    #[cfg(target_arch = "x86_64")]
    {
        if crate::test_simd_paths(what) {
            kernels.push(Kernel::Avx2);
        }
        if crate::has_vnni() {
            kernels.push(Kernel::Vnni);
        }
        if crate::can_vnni512() {
            kernels.push(Kernel::Vnni512);
        }
    }
    let rows = w.rows;
    let split = rows.min(PANEL);
    for kernel in kernels {
        let mut y = vec![f32::NAN; b * rows];
        tile_run(kernel, w, x, act, &mut y, 0, split, b);
        tile_run(kernel, w, x, act, &mut y, split, rows, b);
        let got: Vec<u32> = y.iter().map(|v| v.to_bits()).collect();
        assert_eq!(got, want, "{kernel:?} {what}");
    }
}

const QFORMATS: [WeightFormat; 3] = [WeightFormat::Q8_0, WeightFormat::Q4_0, WeightFormat::Q4_1];

#[test]
fn panels_round_trip_to_gguf() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    for format in QFORMATS {
        for &(rows, cols) in &[(1usize, 32usize), (8, 64), (13, 96), (24, 576)] {
            let gguf = quantize_gguf(format, &rand_vec(&mut rng, rows * cols));
            let w = Weight::new(format, rows, cols, gguf.clone());
            assert_eq!(w.to_gguf(), gguf, "{format:?} {rows}x{cols}");
            assert_eq!(w.bytes(), rows.div_ceil(PANEL) * PANEL * cols / QK * format.block_bytes());
            // Dequantization through the panels equals dequantizing the GGUF bytes.
            let rb = cols / QK * format.block_bytes();
            let mut row = vec![0f32; cols];
            for r in 0..rows {
                w.dequantize_row(r, &mut row);
                for (j, b) in gguf[r * rb..(r + 1) * rb].chunks_exact(format.block_bytes()).enumerate() {
                    for k in 0..QK {
                        let want = match format {
                            WeightFormat::Q8_0 => f16_at(b, 0) * (b[2 + k] as i8) as f32,
                            WeightFormat::Q4_0 => f16_at(b, 0) * ((if k < 16 { b[2 + k] & 0xF } else { b[2 + k - 16] >> 4 }) as i32 - 8) as f32,
                            _ => f16_at(b, 0) * (if k < 16 { b[4 + k] & 0xF } else { b[4 + k - 16] >> 4 }) as f32 + f16_at(b, 2),
                        };
                        assert_eq!(row[j * QK + k].to_bits(), want.to_bits(), "{format:?} row {r} elem {}", j * QK + k);
                    }
                }
            }
            let cat = Weight::concat_rows(&[&w, &w]).unwrap();
            assert_eq!(cat.to_gguf(), [gguf.clone(), gguf].concat());
        }
    }
}

/// Every kernel (portable, AVX2, VNNI where present) equals ggml's scalar dot on the GGUF
/// bytes bit for bit: ragged batches, partial last panels, every chunk size.
#[test]
fn kernels_equal_scalar_bit_for_bit() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    for format in QFORMATS {
        for &(rows, cols) in &[(8usize, 32usize), (11, 96), (16, 160), (27, 576), (8, 1536)] {
            let nb = cols / QK;
            let gguf = quantize_gguf(format, &rand_vec(&mut rng, rows * cols));
            let w = Weight::new(format, rows, cols, gguf.clone());
            let rb = nb * format.block_bytes();
            for b in [1usize, 2, 3, 4, 5, 8, 9, 13, 17, 24, 33] {
                let x = rand_vec(&mut rng, b * cols);
                let act = quantize_rows(&x, cols);
                let want: Vec<u32> = (0..b * rows)
                    .map(|o| gguf_dot(format, &gguf[(o % rows) * rb..(o % rows + 1) * rb], &act[(o / rows) * nb..(o / rows + 1) * nb]).to_bits())
                    .collect();
                assert_every_kernel_gives(&w, &x, &act, b, &want, &format!("{format:?} {rows}x{cols} b {b}"));
            }
        }
    }
}

/// Random GGUF K-quant super-blocks (any bytes are valid quants and sub-scales; the f16
/// super-scales are set to sane values).
fn random_k(rng: &mut impl Rng, format: WeightFormat, rows: usize, cols: usize) -> Weight {
    let (bb, d_at) = k_layout(format);
    let mut bytes: Vec<u8> = (0..rows * cols / QK_K * bb).map(|_| rng.random()).collect();
    for b in bytes.chunks_exact_mut(bb) {
        for &at in d_at {
            let d = f16::from_f32(rng.random_range(0.001f32..0.01));
            b[at..at + 2].copy_from_slice(&d.to_bits().to_le_bytes());
        }
    }
    from_k(format, rows, cols, &bytes)
}

/// A GGUF K-quant's super-block bytes and where its f16 super-scales sit.
fn k_layout(format: WeightFormat) -> (usize, &'static [usize]) {
    match format {
        WeightFormat::Q4K => (144, &[0, 2]),
        WeightFormat::Q5K => (176, &[0, 2]),
        _ => (210, &[208]),
    }
}

fn from_k(format: WeightFormat, rows: usize, cols: usize, bytes: &[u8]) -> Weight {
    match format {
        WeightFormat::Q4K => Weight::from_q4_k(rows, cols, bytes),
        WeightFormat::Q5K => Weight::from_q5_k(rows, cols, bytes),
        _ => Weight::from_q6_k(rows, cols, bytes),
    }
}

const KFORMATS: [WeightFormat; 3] = [WeightFormat::Q4K, WeightFormat::Q5K, WeightFormat::Q6K];

/// The repacked K-quants: every kernel equals the scalar code bit for bit, and the matmul is
/// batch invariant and close to the dequantized reference.
#[test]
fn k_quant_kernels_agree() {
    let pool = ThreadPool::new(2);
    let mut rng = rand::rngs::StdRng::seed_from_u64(13);
    for format in KFORMATS {
        for &(rows, cols) in &[(8usize, 256usize), (13, 512), (27, 256)] {
            let w = random_k(&mut rng, format, rows, cols);
            let nb = cols / QK;
            for b in [1usize, 2, 3, 5, 8, 9, 17, 33] {
                let x = rand_vec(&mut rng, b * cols);
                let act = quantize_rows(&x, cols);
                let want: Vec<u32> = (0..b * rows).map(|o| dot_block_row(&w, o % rows, &act[(o / rows) * nb..(o / rows + 1) * nb]).to_bits()).collect();
                assert_every_kernel_gives(&w, &x, &act, b, &want, &format!("{format:?} {rows}x{cols} b {b}"));
                let mut y = vec![0f32; b * rows];
                matmul(&pool, &w, &x, &mut y, &mut MatmulScratch::default());
                let reference = reference(&w, &x, b);
                let scale = reference.iter().fold(0f32, |m, v| m.max(v.abs()));
                for (i, (a, r)) in y.iter().zip(&reference).enumerate() {
                    assert!((a - r).abs() <= 0.02 * scale, "{format:?} b {b} out {i}: {a} vs {r}");
                }
                // Each row alone gives the same bits.
                for row in 0..b {
                    let mut y1 = vec![0f32; rows];
                    matmul(&pool, &w, &x[row * cols..(row + 1) * cols], &mut y1, &mut MatmulScratch::default());
                    assert_eq!(&y1[..], &y[row * rows..(row + 1) * rows]);
                }
            }
        }
        // Stacking whole panels keeps every value.
        let w = random_k(&mut rng, format, 16, 256);
        let cat = Weight::concat_rows(&[&w, &w]).unwrap();
        let (mut a, mut b) = (vec![0f32; 256], vec![0f32; 256]);
        for r in 0..32 {
            w.dequantize_row(r % 16, &mut a);
            cat.dequantize_row(r, &mut b);
            assert_eq!(a, b);
        }
    }
}

/// At the integer bounds (every weight code at its maximum, every activation ±127) the kernels'
/// 16-bit partial sums are at their largest: still exact, equal to the scalar code.
#[test]
fn kernels_are_exact_at_the_integer_bounds() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(17);
    let (rows, cols) = (16usize, 256usize);
    let mut weights = vec![];
    for format in QFORMATS {
        let mut gguf = quantize_gguf(format, &rand_vec(&mut rng, rows * cols));
        let (bb, qoff) = (format.block_bytes(), if format == WeightFormat::Q4_1 { 4 } else { 2 });
        for b in gguf.chunks_exact_mut(bb) {
            // Largest codes: 15 (4-bit) or -128 (Q8_0, the sign trick's extreme).
            b[qoff..].fill(if format == WeightFormat::Q8_0 { 0x80 } else { 0xFF });
        }
        weights.push(Weight::new(format, rows, cols, gguf));
    }
    for format in KFORMATS {
        // Every quant byte 0xFF: Q4K codes 15, Q5K codes 31, Q6K codes 63; sane super-scales.
        let (bb, d_at) = k_layout(format);
        let mut bytes = vec![0xFFu8; rows * cols / QK_K * bb];
        for b in bytes.chunks_exact_mut(bb) {
            for &at in d_at {
                b[at..at + 2].copy_from_slice(&f16::from_f32(0.004).to_bits().to_le_bytes());
            }
        }
        weights.push(from_k(format, rows, cols, &bytes));
    }
    let nb = cols / QK;
    for w in &weights {
        for sign in [1.0f32, -1.0] {
            // Rows all +127 / all -127, then mixed signs (each row's own max gives ±127).
            let b = 5;
            let x: Vec<f32> = (0..b * cols).map(|i| if i / cols < 2 { sign } else if rng.random() { sign } else { -sign }).collect();
            let act = quantize_rows(&x, cols);
            assert!(act.iter().all(|a| a.qs.iter().all(|q| q.unsigned_abs() == 127)));
            let want: Vec<u32> = (0..b * w.rows).map(|o| dot_block_row(w, o % w.rows, &act[(o / w.rows) * nb..(o / w.rows + 1) * nb]).to_bits()).collect();
            assert_every_kernel_gives(w, &x, &act, b, &want, &format!("{:?} at the bounds, sign {sign}", w.format));
        }
    }
}

#[test]
fn matmul_rows_equals_matmul_on_the_same_rows() {
    let pool = ThreadPool::new(2);
    let mut rng = rand::rngs::StdRng::seed_from_u64(9);
    for format in [WeightFormat::F32, WeightFormat::Q4_1, WeightFormat::Q8_0] {
        let (rows, cols) = (40, 96);
        let wv = rand_vec(&mut rng, rows * cols);
        let w = if format == WeightFormat::F32 { Weight::from_f32(rows, cols, &wv) } else { quantize_weight(format, rows, cols, &wv) };
        for b in [1usize, 5, 16] {
            let src = rand_vec(&mut rng, b * cols);
            // The rows as produced: each source row doubled.
            let x: Vec<f32> = src.iter().map(|v| v * 2.0).collect();
            let (mut y0, mut y1) = (vec![0f32; b * rows], vec![0f32; b * rows]);
            let mut scratch = MatmulScratch::default();
            matmul(&pool, &w, &x, &mut y0, &mut scratch);
            matmul_rows(&pool, &w, b, &mut y1, &mut scratch, |i, out| {
                for (o, v) in out.iter_mut().zip(&src[i * cols..(i + 1) * cols]) {
                    *o = v * 2.0;
                }
            });
            assert_eq!(y0, y1, "{format:?} b {b}");
        }
    }
}

#[test]
fn matmul_matches_reference_and_is_batch_invariant() {
    let pool = ThreadPool::new(2);
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    for format in [WeightFormat::F32, WeightFormat::Q8_0, WeightFormat::Q4_0, WeightFormat::Q4_1] {
        for &(rows, cols) in &[(1usize, 32usize), (7, 64), (130, 96), (576, 576)] {
            let wv = rand_vec(&mut rng, rows * cols);
            let w = if format == WeightFormat::F32 {
                Weight::from_f32(rows, cols, &wv)
            } else {
                quantize_weight(format, rows, cols, &wv)
            };
            for &b in &[1usize, 3, 8, 11] {
                let x = rand_vec(&mut rng, b * cols);
                let mut y = vec![0f32; b * rows];
                let mut scratch = MatmulScratch::default();
                matmul(&pool, &w, &x, &mut y, &mut scratch);
                let want = reference(&w, &x, b);
                // Activation quantization to int8 bounds the error relative to the row norm.
                for i in 0..b * rows {
                    let tol = if format == WeightFormat::F32 { 1e-4 } else { 0.02 * (cols as f32).sqrt() };
                    assert!((y[i] - want[i]).abs() <= tol, "{format:?} {rows}x{cols} b={b} i={i}: {} vs {}", y[i], want[i]);
                }
                // Each row alone gives bit-identical results (ragged batches included).
                for i in 0..b {
                    let mut y1 = vec![0f32; rows];
                    matmul(&pool, &w, &x[i * cols..(i + 1) * cols], &mut y1, &mut scratch);
                    assert_eq!(&y[i * rows..(i + 1) * rows], &y1[..], "{format:?} row {i} of {b}");
                }
            }
        }
    }
}

/// The tasks of a matmul cover every panel once, in order: front tiles in multiples of the
/// thread count and within a panel of each other, then (on big enough matrices, with threads
/// to balance) a tail that halves down to one panel; where they fall changes no value (1, 2
/// and 3 threads give the same bits).
#[test]
fn tiles_split_evenly_and_change_no_value() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let pools = [ThreadPool::new(1), ThreadPool::new(2), ThreadPool::new(3)];
    for &(rows, cols) in &[(576usize, 576usize), (960, 576), (3072, 576), (576, 1536), (130, 96), (8, 32)] {
        let w = quantize_weight(WeightFormat::Q4_1, rows, cols, &rand_vec(&mut rng, rows * cols));
        let panels = rows.div_ceil(PANEL);
        for threads in 1..=4 {
            let tasks = Tasks::new(&w, threads);
            let ranges: Vec<std::ops::Range<usize>> = (0..tasks.count()).map(|t| tasks.panels(t)).collect();
            assert!(ranges.iter().all(|r| r.end > r.start), "{rows}x{cols}, {threads} threads: an empty task in {ranges:?}");
            assert!(ranges.windows(2).all(|p| p[0].end == p[1].start) && ranges[0].start == 0, "{rows}x{cols}: {ranges:?}");
            assert_eq!(ranges.last().unwrap().end, panels, "{rows}x{cols}: {ranges:?}");
            let sizes: Vec<usize> = ranges.iter().map(|r| r.len()).collect();
            let per = (tile_rows(&w) / PANEL).max(1);
            let (head, tail) = sizes.split_at(tasks.front_tasks());
            assert!(*head.iter().max().unwrap() <= per, "{rows}x{cols}: a front tile over {per} panels: {sizes:?}");
            assert!(head.iter().max().unwrap() - head.iter().min().unwrap() <= 1, "{rows}x{cols}: {sizes:?}");
            assert!(head.len() % threads == 0 || head.len() == panels || !tail.is_empty(), "{rows}x{cols}, {threads} threads: {sizes:?}");
            assert!(tail.windows(2).all(|p| p[0] >= p[1]), "{rows}x{cols}: the tail grows: {sizes:?}");
            if threads > 1 && panels >= 4 * threads * per && per > 1 {
                assert_eq!(tail.last(), Some(&1), "{rows}x{cols}, {threads} threads: no tail down to one panel: {sizes:?}");
                assert_eq!(tail.len() % threads, 0, "{sizes:?}");
            }
            // In pairs of panels (the 512-bit kernel's unit): every task starts on a pair and
            // all but the last hold whole pairs, covering every panel once.
            let pairs = Tasks::new_in(&w, threads, 2);
            let ranges: Vec<std::ops::Range<usize>> = (0..pairs.count()).map(|t| pairs.panels(t)).collect();
            assert!(ranges.iter().all(|r| r.end > r.start && r.start % 2 == 0), "{rows}x{cols}, {threads} threads, pairs: {ranges:?}");
            assert!(ranges.windows(2).all(|p| p[0].end == p[1].start && p[0].len() % 2 == 0), "{rows}x{cols}, pairs: {ranges:?}");
            assert_eq!((ranges[0].start, ranges.last().unwrap().end), (0, panels), "{rows}x{cols}, pairs: {ranges:?}");
        }
        let b = 16;
        let x = rand_vec(&mut rng, b * cols);
        let outs: Vec<Vec<u32>> = pools
            .iter()
            .map(|pool| {
                let mut y = vec![0f32; b * rows];
                matmul(pool, &w, &x, &mut y, &mut MatmulScratch::default());
                y.iter().map(|v| v.to_bits()).collect()
            })
            .collect();
        assert!(outs.windows(2).all(|p| p[0] == p[1]), "{rows}x{cols}: thread counts disagree");
    }
}

/// A warming's lines, shared over matmuls and their tasks, cover every line of every run once;
/// and a matmul that warms gives the same bits as one that does not.
#[cfg(target_arch = "x86_64")]
#[test]
fn warming_covers_every_line_once_and_changes_no_value() {
    let buf = vec![0u8; 1 << 16];
    let bases = [buf.as_ptr(), buf.as_ptr().wrapping_add(32768)];
    let runs = [0usize, 1024, 4096, 192];
    let warm = |share| Warm { bases: &bases, runs: &runs, run_bytes: 128, share };
    let mut seen = vec![];
    for share in [(0.0, 0.3), (0.3, 0.75), (0.75, 1.0)] {
        // Tasks of unequal sizes (panels 0..1, 1..5 and 5..7 of 7) share in proportion.
        for panels in [0..1, 1..5, 5..7] {
            let mut c = warm(share).cursor(&panels, 7, 5);
            while let Some(p) = c.next_line() {
                seen.push(p as usize - buf.as_ptr() as usize);
            }
        }
    }
    let mut want: Vec<usize> = [0usize, 32768].iter().flat_map(|b| runs.iter().flat_map(move |r| [b + r, b + r + 64])).collect();
    want.sort();
    seen.sort();
    assert_eq!(seen, want);

    let pool = ThreadPool::new(2);
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    for format in [WeightFormat::Q4_1, WeightFormat::Q8_0] {
        let (rows, cols, b) = (200, 96, 11);
        let w = quantize_weight(format, rows, cols, &rand_vec(&mut rng, rows * cols));
        let x = rand_vec(&mut rng, b * cols);
        let (mut y0, mut y1) = (vec![0f32; b * rows], vec![f32::NAN; b * rows]);
        matmul(&pool, &w, &x, &mut y0, &mut MatmulScratch::default());
        matmul_warming(&pool, &w, &x, &mut y1, &mut MatmulScratch::default(), Some(&warm((0.0, 1.0))));
        assert_eq!(y0.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), y1.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "{format:?}");
    }
}

/// GGUF `Q5_0` loads as `Q8_0` with the same scales: every value is ggml's
/// `dequantize_row_q5_0` bit for bit, so every Q8_0 kernel computes ggml's `q5_0 × q8_0` dot.
#[test]
fn q5_0_loads_exactly_as_q8_0() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(17);
    let (rows, cols) = (11usize, 96usize);
    let mut bytes: Vec<u8> = (0..rows * cols / QK * 22).map(|_| rng.random()).collect();
    for b in bytes.chunks_exact_mut(22) {
        let d = f16::from_f32(rng.random_range(-0.01f32..0.01));
        b[..2].copy_from_slice(&d.to_bits().to_le_bytes());
    }
    let w = Weight::from_q5_0(rows, cols, &bytes);
    assert_eq!(w.format, WeightFormat::Q8_0);
    let mut row = vec![0f32; cols];
    for r in 0..rows {
        w.dequantize_row(r, &mut row);
        for j in 0..cols / QK {
            let b = &bytes[(r * cols / QK + j) * 22..][..22];
            let (d, qh, qs) = (f16_at(b, 0), u32::from_le_bytes([b[2], b[3], b[4], b[5]]), &b[6..22]);
            // ggml's dequantize_row_q5_0, as written there.
            for l in 0..16 {
                let xh0 = ((qh >> l) << 4) & 0x10;
                let xh1 = (qh >> (l + 12)) & 0x10;
                let x0 = ((qs[l] as u32 & 0x0F) | xh0) as i32 - 16;
                let x1 = ((qs[l] as u32 >> 4) | xh1) as i32 - 16;
                assert_eq!(row[j * QK + l].to_bits(), (x0 as f32 * d).to_bits(), "row {r} block {j} elem {l}");
                assert_eq!(row[j * QK + l + 16].to_bits(), (x1 as f32 * d).to_bits(), "row {r} block {j} elem {}", l + 16);
            }
        }
    }
    // And the kernels agree with the scalar Q8_0 dot on those values.
    let gguf = w.to_gguf();
    let nb = cols / QK;
    let rb = nb * WeightFormat::Q8_0.block_bytes();
    for b in [1usize, 3, 9] {
        let x = rand_vec(&mut rng, b * cols);
        let act = quantize_rows(&x, cols);
        let want: Vec<u32> = (0..b * rows)
            .map(|o| gguf_dot(WeightFormat::Q8_0, &gguf[(o % rows) * rb..(o % rows + 1) * rb], &act[(o / rows) * nb..(o / rows + 1) * nb]).to_bits())
            .collect();
        assert_every_kernel_gives(&w, &x, &act, b, &want, &format!("Q5_0 {rows}x{cols} b {b}"));
    }
}

/// GGUF `Q5_1` loads as [`WeightFormat::Q5K`] with the same scales: every value is ggml's
/// `dequantize_row_q5_1` bit for bit, and every kernel equals the scalar dot on it.
#[test]
fn q5_1_loads_exactly_as_q5k() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(19);
    let (rows, cols) = (11usize, 96usize);
    let mut bytes: Vec<u8> = (0..rows * cols / QK * 24).map(|_| rng.random()).collect();
    for b in bytes.chunks_exact_mut(24) {
        b[..2].copy_from_slice(&f16::from_f32(rng.random_range(0.001f32..0.01)).to_bits().to_le_bytes());
        b[2..4].copy_from_slice(&f16::from_f32(rng.random_range(-0.1f32..0.1)).to_bits().to_le_bytes());
    }
    let w = Weight::from_q5_1(rows, cols, &bytes);
    assert_eq!(w.format, WeightFormat::Q5K);
    let mut row = vec![0f32; cols];
    for r in 0..rows {
        w.dequantize_row(r, &mut row);
        for j in 0..cols / QK {
            let b = &bytes[(r * cols / QK + j) * 24..][..24];
            let (d, m, qh, qs) = (f16_at(b, 0), f16_at(b, 2), u32::from_le_bytes([b[4], b[5], b[6], b[7]]), &b[8..24]);
            // ggml's dequantize_row_q5_1, as written there.
            for l in 0..16 {
                let xh0 = ((qh >> l) << 4) & 0x10;
                let xh1 = (qh >> (l + 12)) & 0x10;
                let x0 = (qs[l] as u32 & 0x0F) | xh0;
                let x1 = (qs[l] as u32 >> 4) | xh1;
                assert_eq!(row[j * QK + l].to_bits(), (x0 as f32 * d + m).to_bits(), "row {r} block {j} elem {l}");
                assert_eq!(row[j * QK + l + 16].to_bits(), (x1 as f32 * d + m).to_bits(), "row {r} block {j} elem {}", l + 16);
            }
        }
    }
    let nb = cols / QK;
    for b in [1usize, 3, 9, 17] {
        let x = rand_vec(&mut rng, b * cols);
        let act = quantize_rows(&x, cols);
        let want: Vec<u32> = (0..b * rows).map(|o| dot_block_row(&w, o % rows, &act[(o / rows) * nb..(o / rows + 1) * nb]).to_bits()).collect();
        assert_every_kernel_gives(&w, &x, &act, b, &want, &format!("Q5_1 {rows}x{cols} b {b}"));
    }
}

/// F16 and BF16 weights multiply as the same weight widened to F32 does, bit for bit, through
/// every matmul entry, and slice and stack as F32 rows do.
#[test]
fn half_precision_weights_multiply_as_their_f32_widening() {
    let pool = ThreadPool::new(2);
    let mut rng = rand::rngs::StdRng::seed_from_u64(23);
    let (rows, cols) = (19usize, 80usize);
    let v = rand_vec(&mut rng, rows * cols);
    for format in [WeightFormat::F16, WeightFormat::BF16] {
        let bytes: Vec<u8> = match format {
            WeightFormat::F16 => v.iter().flat_map(|x| f16::from_f32(*x).to_bits().to_le_bytes()).collect(),
            _ => v.iter().flat_map(|x| ((x.to_bits() >> 16) as u16).to_le_bytes()).collect(),
        };
        let w = Weight::new(format, rows, cols, bytes);
        assert_eq!(w.bytes(), rows * cols * 2, "{format:?} holds two bytes a value");
        let wide = w.f32_values().unwrap();
        assert!(wide.iter().zip(&v).all(|(a, b)| (a - b).abs() <= 0.01 * b.abs().max(1e-3)), "{format:?} widens to about the values");
        let f = Weight::from_f32(rows, cols, &wide);
        for b in [1usize, 3, 9] {
            let x = rand_vec(&mut rng, b * cols);
            let (mut y, mut want) = (vec![0f32; b * rows], vec![0f32; b * rows]);
            matmul(&pool, &w, &x, &mut y, &mut MatmulScratch::default());
            matmul(&pool, &f, &x, &mut want, &mut MatmulScratch::default());
            assert_eq!(y.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "{format:?} b {b}");
        }
        let (mut a, mut c) = (vec![0f32; 40], vec![0f32; 40]);
        let s = w.slice(3..11, 16..56);
        let cat = Weight::concat_rows(&[&s, &s]).unwrap();
        for r in 0..16 {
            cat.dequantize_row(r, &mut a);
            c.copy_from_slice(&wide[(3 + r % 8) * cols + 16..(3 + r % 8) * cols + 56]);
            assert_eq!(a, c, "{format:?} slice row {r}");
        }
    }
}

/// A slice holds exactly the blocks it names (every format, partial panels, K-quants too), and
/// rows stacked from slices of unaligned heights come back the same: what tensor-parallel
/// shards are cut with. A row-split matmul is the full one's rows bit for bit.
#[test]
fn slices_keep_their_blocks_exactly() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(21);
    let pool = ThreadPool::new(2);
    let (rows, cols) = (27usize, 256usize);
    let mut weights: Vec<Weight> = QFORMATS.iter().map(|&f| quantize_weight(f, rows, cols, &rand_vec(&mut rng, rows * cols))).collect();
    weights.push(random_k(&mut rng, WeightFormat::Q4K, rows, cols));
    weights.push(random_k(&mut rng, WeightFormat::Q6K, rows, cols));
    weights.push(random_k(&mut rng, WeightFormat::Q5K, rows, cols));
    weights.push(Weight::from_f32(rows, cols, &rand_vec(&mut rng, rows * cols)));
    for w in &weights {
        let (r0, r1, c0, c1) = (3, 20, 64, 192);
        let s = w.slice(r0..r1, c0..c1);
        assert_eq!((s.rows, s.cols, s.format), (r1 - r0, c1 - c0, w.format));
        let (mut full, mut part) = (vec![0f32; cols], vec![0f32; c1 - c0]);
        for r in 0..s.rows {
            w.dequantize_row(r0 + r, &mut full);
            s.dequantize_row(r, &mut part);
            assert_eq!(part, full[c0..c1], "{:?} row {r}", w.format);
        }
        // Uneven row pieces stacked again are the whole.
        let cat = Weight::concat_rows(&[&w.slice(0..5, 0..cols), &w.slice(5..19, 0..cols), &w.slice(19..rows, 0..cols)]).unwrap();
        for r in 0..rows {
            w.dequantize_row(r, &mut full);
            let mut back = vec![0f32; cols];
            cat.dequantize_row(r, &mut back);
            assert_eq!(back, full, "{:?} stacked row {r}", w.format);
        }
        // Output rows split across two matmuls give the same bits as one.
        let x = rand_vec(&mut rng, 3 * cols);
        let mut whole = vec![0f32; 3 * rows];
        matmul(&pool, w, &x, &mut whole, &mut MatmulScratch::default());
        let (top, bottom) = (w.slice(0..11, 0..cols), w.slice(11..rows, 0..cols));
        let (mut yt, mut yb) = (vec![0f32; 3 * 11], vec![0f32; 3 * (rows - 11)]);
        matmul(&pool, &top, &x, &mut yt, &mut MatmulScratch::default());
        matmul(&pool, &bottom, &x, &mut yb, &mut MatmulScratch::default());
        for b in 0..3 {
            assert_eq!(yt[b * 11..(b + 1) * 11], whole[b * rows..b * rows + 11], "{:?}", w.format);
            assert_eq!(yb[b * (rows - 11)..(b + 1) * (rows - 11)], whole[b * rows + 11..(b + 1) * rows], "{:?}", w.format);
        }
    }
}

/// Flat blocks (the device layout) decode to the panels' values exactly, every format.
#[test]
fn flat_blocks_hold_every_value() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(23);
    let (rows, cols) = (11usize, 256usize);
    let mut weights: Vec<Weight> = QFORMATS.iter().map(|&f| quantize_weight(f, rows, cols, &rand_vec(&mut rng, rows * cols))).collect();
    weights.push(random_k(&mut rng, WeightFormat::Q4K, rows, cols));
    weights.push(random_k(&mut rng, WeightFormat::Q6K, rows, cols));
    weights.push(random_k(&mut rng, WeightFormat::Q5K, rows, cols));
    for w in &weights {
        let f = w.flat_blocks().unwrap();
        assert_eq!((f.rows, f.cols, f.scales.len(), f.codes.len()), (rows, cols, rows * cols / QK * 2, rows * cols / QK * f.code_bytes()));
        let mut row = vec![0f32; cols];
        for r in 0..rows {
            w.dequantize_row(r, &mut row);
            for (i, v) in row.iter().enumerate() {
                assert_eq!(f.value(r, i).to_bits(), v.to_bits(), "{:?} row {r} elem {i}", w.format);
            }
        }
    }
    let dense = Weight::from_f32(2, 32, &rand_vec(&mut rng, 64));
    assert!(dense.flat_blocks().is_none());
    assert_eq!(dense.f32_values().unwrap().len(), 64);
}

/// The matmul takes the 512-bit kernel from `vnni512_min_rows` rows on (8 on Zen 4 and Zen 5,
/// 1 on Intel), where it may run at all; fewer rows keep the 256-bit kernel.
#[cfg(target_arch = "x86_64")]
#[test]
fn the_512_bit_kernel_runs_from_its_row_threshold() {
    let min = crate::vnni512_min_rows();
    if std::env::var_os("ZEROLAYER_VNNI512_ROWS").is_none() {
        assert_eq!(min, if crate::amd_zen4_or_zen5() { 8 } else { 1 });
    }
    for b in [1usize, 2, 7, 8, 16, 512] {
        let wide = crate::has_vnni512() && b >= min;
        assert_eq!(Kernel::detect(b) == Kernel::Vnni512, wide, "{b} rows");
        if !wide && crate::has_vnni() {
            assert_eq!(Kernel::detect(b), Kernel::Vnni, "{b} rows");
        }
    }
}
