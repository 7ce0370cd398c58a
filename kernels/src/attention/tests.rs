use super::kv::*;
use super::portable::attend_one;
use super::*;

#[cfg(target_arch = "x86_64")]
#[test]
fn avx2_attention_equals_portable_bit_for_bit() {
    if !crate::test_simd_paths("attention") {
        return;
    }
    simd_equals_portable::<f32>();
    simd_equals_portable::<half::f16>();
}

/// Every SIMD path against the portable code, bit for bit, on caches of element `E`.
#[cfg(target_arch = "x86_64")]
fn simd_equals_portable<E: KvElement>() {
    let name = if E::IS_F16 { "f16" } else { "f32" };
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut rnd = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0
    };
    let mut wide_ran = false;
    // Each geometry in the GPU's layout (groups of 1 block) and in the CPU cache's groups.
    let geometries = [(16usize, 64usize), (4, 8), (8, 32), (16, 128), (5, 16)];
    for (bs, hd, group) in geometries.into_iter().flat_map(|(bs, hd)| [(bs, hd, 1), (bs, hd, run_group(bs))]) {
        let layout = KvLayout { block_size: bs, n_kv_heads: 3, head_dim: hd, group };
        let n_blocks = 12;
        let kc: Vec<E> = (0..layout.elems(n_blocks)).map(|_| E::from_f32(rnd())).collect();
        let vc: Vec<E> = (0..layout.elems(n_blocks)).map(|_| E::from_f32(rnd())).collect();
        let table: Vec<u32> = (0..n_blocks as u32).rev().collect(); // scattered
        let q: Vec<f32> = (0..7 * hd).map(|_| rnd()).collect();
        for pos in [0usize, 6, 7, 8, 15, 16, 17, 23, 24, 33, n_blocks * bs - 1] {
            // Whole contexts, and sliding windows that start inside a block, on a block
            // boundary, or before position 0.
            for (head, window) in (0..3).flat_map(|h| [(h, 0usize), (h, 1), (h, 5), (h, bs), (h, 19)]) {
                for group in [1usize, 2, 3, 4, 7] {
                    // `group` query heads read this KV head; each alone through the
                    // portable code, then all together through the AVX2 kernel.
                    let kv = KvView { layout: &layout, k: &kc, v: &vc, window };
                    let query = Query { table: &table, pos, kv_head: head, q: &q[..group * hd], scale: 0.125 };
                    let mut want = vec![0f32; group * hd];
                    let mut s1 = vec![];
                    for h in 0..group {
                        let one = Query { q: &q[h * hd..(h + 1) * hd], ..query };
                        attend_one(&kv, &one, &mut s1, &mut want[h * hd..(h + 1) * hd]);
                    }
                    let (mut s2, mut got) = (Scratch::default(), vec![f32::NAN; group * hd]);
                    // SAFETY: AVX2, FMA and F16C detected above; head sizes are multiples of 8.
                    unsafe { avx2::attend_group(&kv, &query, &mut s2, &mut got) };
                    let b1: Vec<u32> = want.iter().map(|x| x.to_bits()).collect();
                    let b2: Vec<u32> = got.iter().map(|x| x.to_bits()).collect();
                    assert_eq!(b1, b2, "{name}: bs {bs} hd {hd} ({} blocks a group) pos {pos} head {head} group {group} window {window}", layout.group);
                    if crate::has_avx512vl() {
                        // Several heads per pass (groups of 2 and 7 leave partial passes).
                        got.fill(f32::NAN);
                        // SAFETY: AVX-512F and VL detected as well.
                        unsafe { avx2::attend_group_wide(&kv, &query, &mut s2, &mut got) };
                        let b3: Vec<u32> = got.iter().map(|x| x.to_bits()).collect();
                        assert_eq!(b1, b3, "{name}, wide: bs {bs} hd {hd} pos {pos} head {head} group {group}");
                        wide_ran = true;
                    }
                }
            }
        }
    }
    if !wide_ran {
        eprintln!("attention: the AVX-512VL path was NOT exercised (not on this CPU, or ZEROLAYER_NO_AVX512 is set)");
    }
}

#[test]
fn paged_attention_matches_contiguous_reference() {
    matches_contiguous_reference::<f32>();
    matches_contiguous_reference::<half::f16>();
}

/// Paged attention over a scattered block table against an f64 computation over contiguous
/// copies of the same (rounded) K and V.
fn matches_contiguous_reference<E: KvKernels>() {
    for group in [1, 2, 4] {
        contiguous_reference::<E>(KvLayout { block_size: 4, n_kv_heads: 2, head_dim: 8, group });
    }
}

fn contiguous_reference<E: KvKernels>(layout: KvLayout) {
    let n_blocks = 6;
    let mut kc = vec![E::ZERO; layout.elems(n_blocks)];
    let mut vc = vec![E::ZERO; layout.elems(n_blocks)];
    // A scattered block table.
    let table = [4u32, 1, 5, 0];
    let len = 13;
    let kv = |p: usize, i: usize, s: f32| ((p * 31 + i * 7) as f32 * s).sin();
    let mut ks = vec![];
    let mut vs = vec![];
    for p in 0..len {
        let k: Vec<f32> = (0..16).map(|i| kv(p, i, 0.13)).collect();
        let v: Vec<f32> = (0..16).map(|i| kv(p, i, 0.29)).collect();
        write_kv(&layout, &mut kc, &mut vc, &table, p, &k, &v);
        ks.push(k);
        vs.push(v);
    }
    let q: Vec<f32> = (0..8).map(|i| (i as f32 * 0.7).cos()).collect();
    // The whole context, and sliding windows of the last 3 and 6 positions.
    for (head, window) in [(0, 0), (1, 0), (0, 3), (1, 6)] {
        let pos = len - 1;
        let first = if window == 0 { 0 } else { pos + 1 - window };
        let mut out = vec![0f32; 8];
        let mut scratch = Scratch::default();
        attend_group(&KvView { layout: &layout, k: &kc, v: &vc, window }, &Query { table: &table, pos, kv_head: head, q: &q, scale: 0.35 }, &mut scratch, &mut out);
        // Reference over contiguous copies (rounded to the cache element type), in f64.
        let r = |x: f32| E::from_f32(x).to_f32() as f64;
        let sc: Vec<f64> = (first..=pos).map(|p| (0..8).map(|i| q[i] as f64 * r(ks[p][head * 8 + i])).sum::<f64>() * 0.35).collect();
        let m = sc.iter().cloned().fold(f64::MIN, f64::max);
        let e: Vec<f64> = sc.iter().map(|s| (s - m).exp()).collect();
        let z: f64 = e.iter().sum();
        for i in 0..8 {
            let want: f64 = (first..=pos).zip(&e).map(|(p, e)| e / z * r(vs[p][head * 8 + i])).sum();
            assert!((out[i] as f64 - want).abs() < 1e-5, "{layout:?}: head {head} window {window} dim {i}");
        }
    }
}

#[test]
fn grouped_layout_keeps_a_heads_run_contiguous_and_places_every_element_once() {
    for (bs, n_kv, hd) in [(4usize, 3usize, 64usize), (4, 2, 8), (8, 1, 16), (16, 3, 64), (5, 2, 8), (1, 2, 8)] {
        let layout = KvLayout::new(bs, n_kv, hd);
        let g = layout.group;
        assert_eq!(g, run_group(bs));
        // The most blocks whose positions fit in a run of RUN_POSITIONS (one from there up).
        assert!(g == 1 || (g * bs <= RUN_POSITIONS && (g + 1) * bs > RUN_POSITIONS), "{layout:?}");
        // Blocks 0..g hold, per head, g * bs consecutive positions in one run.
        for h in 0..n_kv {
            let start = layout.offset(0, h, 0);
            for p in 0..g * bs {
                assert_eq!(layout.offset(p / bs, h, p % bs), start + p * hd, "{layout:?} head {h} position {p}");
            }
        }
        // Every (block, head, slot) row has its own place inside the array (7 blocks: a
        // partial last group).
        let n_blocks = 7;
        let mut seen = vec![false; layout.elems(n_blocks) / hd];
        for b in 0..n_blocks {
            for h in 0..n_kv {
                for s in 0..bs {
                    let o = layout.offset(b, h, s);
                    assert_eq!(o % hd, 0);
                    assert!(!std::mem::replace(&mut seen[o / hd], true), "{layout:?}: ({b}, {h}, {s}) reuses a row");
                }
            }
        }
    }
    // One block a group is the GPU backend's block-major layout.
    let flat = KvLayout { block_size: 4, n_kv_heads: 3, head_dim: 8, group: 1 };
    assert_eq!(flat.offset(5, 2, 3), ((5 * 3 + 2) * 4 + 3) * 8);
}

/// `write_kv_rows` writes what `write_kv` writes row by row, after each row's `prep`, whether
/// the rows' slots are distinct (written in parallel) or not (two sequences recomputing one
/// cached slot: written in row order, the later row's values last).
#[test]
fn writing_rows_in_parallel_equals_writing_them_one_by_one() {
    let pool = crate::pool::ThreadPool::new(3);
    let layout = KvLayout::new(4, 3, 8);
    let (kvd, stride) = (3 * 8, 9 * 8 + 2 * 3 * 8);
    let n_blocks = 16;
    let tables: Vec<Vec<u32>> = vec![(0..4).collect(), (4..8).rev().collect(), vec![8, 2, 9, 10], (11..16).collect()];
    for rows_at in [vec![(0usize, 5usize), (1, 0), (1, 13), (2, 3), (3, 19), (0, 6), (2, 2)], vec![(0, 5), (2, 5), (0, 5), (3, 1)]] {
        let rows: Vec<AttnRow<'_>> = rows_at.iter().map(|&(s, pos)| AttnRow { table: &tables[s], pos }).collect();
        let src: Vec<f32> = (0..rows.len() * stride).map(|i| (i as f32 * 0.37).sin()).collect();
        let prep = |t: usize, row: &mut [f32]| {
            for (j, v) in row.iter_mut().enumerate() {
                *v = *v * 2.0 + (t * 1000 + j) as f32;
            }
        };
        let (mut k1, mut v1) = (vec![0f32; layout.elems(n_blocks)], vec![0f32; layout.elems(n_blocks)]);
        let mut s1 = src.clone();
        write_kv_rows(&pool, &layout, &mut k1, &mut v1, &rows, &mut s1, stride, (9 * 8, 9 * 8 + kvd), &prep);
        let (mut k2, mut v2) = (vec![0f32; layout.elems(n_blocks)], vec![0f32; layout.elems(n_blocks)]);
        let mut s2 = src.clone();
        for (t, r) in rows.iter().enumerate() {
            let row = &mut s2[t * stride..(t + 1) * stride];
            prep(t, row);
            write_kv(&layout, &mut k2, &mut v2, r.table, r.pos, &row[9 * 8..9 * 8 + kvd], &row[9 * 8 + kvd..9 * 8 + 2 * kvd]);
        }
        assert_eq!(s1, s2, "prep ran once per row");
        assert_eq!((k1, v1), (k2, v2), "rows {rows_at:?}");
    }
}
