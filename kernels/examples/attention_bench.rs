//! Paged attention alone: 16 rows decoding at one position over SmolLM2-135M's geometry (9 query
//! heads on 3 KV heads of 64), `LAYERS` layers of KV, blocks scattered as concurrent decoding
//! leaves them or contiguous.
//!
//! `cargo run --release -p zerolayer-kernels --example attention_bench -- [THREADS] [LAYERS] [scatter|contig|groups] [REPS] [CONTEXT] [BLOCK_SIZE] [f32|f16] [GROUP]`
//!
//! The block size defaults to 16 (the engine's default is 4), the KV element to f32, the
//! blocks per layout group ([`KvLayout::group`]) to the cache's own (`run_group`; 1 is the
//! block-major layout). `scatter`: the rows took turns block by block; `groups`: they took
//! turns group by group, as the engine's block pool hands blocks out; `contig`: each row's
//! blocks are consecutive.
//!
//! One layer stays in the last-level cache; 30 layers (the model's) stream KV from memory
//! every step. Prints, per timed round, the time per step (all layers), the time per (query
//! head, position) pair, and the KV bytes read per second (each KV head's K and V once).
use std::time::Instant;

use zerolayer_kernels::attention::{paged_attention, AttnRow, KvKernels, KvLayout, KvView};
use zerolayer_kernels::pool::ThreadPool;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |i: usize, default: usize| args.get(i).map(|v| v.parse().expect("a number")).unwrap_or(default);
    let threads = arg(1, 2);
    let layers = arg(2, 30);
    let order = args.get(3).map(String::as_str).unwrap_or("scatter").to_string();
    let reps = arg(4, 1);
    let ctx = arg(5, 238);
    let bs = arg(6, 16);
    let group = arg(8, zerolayer_kernels::attention::run_group(bs));
    match args.get(7).map(String::as_str) {
        None | Some("f32") => run::<f32>(threads, layers, &order, reps, ctx, bs, group),
        Some("f16") => run::<half::f16>(threads, layers, &order, reps, ctx, bs, group),
        Some(other) => panic!("KV element {other:?}: f32 or f16"),
    }
}

fn run<E: KvKernels>(threads: usize, layers: usize, order: &str, reps: usize, ctx: usize, bs: usize, group: usize) {
    let (rows_n, n_heads, hd) = (16, 9, 64);
    let layout = KvLayout { group, ..KvLayout::new(bs, 3, hd) };
    let bps = ctx.div_ceil(bs).next_multiple_of(group);
    let nblocks = rows_n * bps;
    let pool = ThreadPool::new(threads);
    let kc: Vec<Vec<E>> = (0..layers).map(|l| (0..layout.elems(nblocks)).map(|i| E::from_f32(((i * 7 + l) % 13) as f32 * 0.01)).collect()).collect();
    let vc = kc.clone();
    let block = |r: usize, b: usize| match order {
        "scatter" => b * rows_n + r,
        "groups" => (b / group * rows_n + r) * group + b % group,
        "contig" => r * bps + b,
        other => panic!("block order {other:?}: scatter, groups or contig"),
    };
    let tables: Vec<Vec<u32>> = (0..rows_n).map(|r| (0..bps).map(|b| block(r, b) as u32).collect()).collect();
    let rows: Vec<AttnRow> = tables.iter().map(|t| AttnRow { table: t, pos: ctx - 1 }).collect();
    let qd = n_heads * hd;
    let q: Vec<f32> = (0..rows_n * qd).map(|i| (i % 17) as f32 * 0.01).collect();
    let mut out = vec![0f32; rows_n * qd];
    for round in 0..5 {
        let t = Instant::now();
        for l in (0..layers).cycle().take(layers * reps) {
            paged_attention(&pool, &KvView { layout: &layout, k: &kc[l], v: &vc[l], window: 0 }, &rows, &q, qd, n_heads, 0.125, &mut out);
        }
        let e = t.elapsed().as_secs_f64();
        let pairs = (rows_n * n_heads * ctx * layers * reps) as f64;
        let kv_bytes = (rows_n * 3 * ctx * layers * reps * 2 * hd * std::mem::size_of::<E>()) as f64;
        if round > 0 {
            println!("{:.2} ms per step; {:.1} ns per (head, pos); {:.1} GB/s KV", e * 1e3 / reps as f64, e * 1e9 / pairs, kv_bytes / e / 1e9);
        }
    }
}
