//! The quantized matmul alone, at SmolLM2-135M's shapes (Q4_1 projections, the Q8_0 output
//! head), for `ROWS` activation rows: the minimum over rounds of each shape's time, and a
//! decode step's worth (30 layers of QKV, O, gate/up and down, then the head). Weights are
//! random codes with small scales; timing does not depend on the values.
//!
//! `cargo run --release -p zerolayer-kernels --example matmul_bench -- [THREADS] [ROWS] [ROUNDS]`
use std::time::Instant;

use zerolayer_kernels::pool::ThreadPool;
use zerolayer_kernels::quant::{matmul, MatmulScratch, Weight, WeightFormat};

/// GGUF bytes for `rows × cols` of `format` with pseudo-random codes and scales near 0.01.
fn weight(format: WeightFormat, rows: usize, cols: usize, seed: u64) -> Weight {
    let mut s = seed | 1;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s as u8
    };
    let scale = half::f16::from_f32(0.01).to_bits().to_le_bytes();
    let mut data = Vec::new();
    for _ in 0..rows * cols / 32 {
        data.extend_from_slice(&scale);
        let codes = match format {
            WeightFormat::Q4_1 => {
                data.extend_from_slice(&half::f16::from_f32(-0.05).to_bits().to_le_bytes());
                16
            }
            WeightFormat::Q8_0 => 32,
            f => panic!("{f:?} not benchmarked"),
        };
        data.extend((0..codes).map(|_| next()));
    }
    Weight::new(format, rows, cols, data)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |i: usize, default: usize| args.get(i).map(|v| v.parse().expect("a number")).unwrap_or(default);
    let (threads, b, rounds) = (arg(1, 2), arg(2, 16), arg(3, 20));
    let pool = ThreadPool::new(threads);
    let shapes = [
        ("qkv", WeightFormat::Q4_1, 960, 576, 30),
        ("o", WeightFormat::Q4_1, 576, 576, 30),
        ("gate_up", WeightFormat::Q4_1, 3072, 576, 30),
        ("down", WeightFormat::Q4_1, 576, 1536, 30),
        ("head", WeightFormat::Q8_0, 49152, 576, 1),
    ];
    let mut step = 0.0;
    for (i, &(name, format, rows, cols, per_step)) in shapes.iter().enumerate() {
        // One weight per layer, so a step streams every layer's weights from memory as decoding does.
        let ws: Vec<Weight> = (0..per_step).map(|l| weight(format, rows, cols, (i * 100 + l) as u64 + 7)).collect();
        let x: Vec<f32> = (0..b * cols).map(|k| ((k * 37 % 101) as f32 - 50.0) * 0.02).collect();
        let mut y = vec![0f32; b * rows];
        let mut scratch = MatmulScratch::default();
        let mut best = f64::INFINITY;
        for _ in 0..rounds {
            let t = Instant::now();
            for w in &ws {
                matmul(&pool, w, &x, &mut y, &mut scratch);
            }
            best = best.min(t.elapsed().as_secs_f64() / per_step as f64);
        }
        step += best * per_step as f64;
        let gops = 2.0 * (b * rows * cols) as f64 / best / 1e9;
        println!("{name:8} {rows:>5}x{cols:<5} x{b}: {:8.1} µs ({gops:.1} GOP/s)", best * 1e6);
    }
    println!("step (30 layers + head) x{b}: {:.2} ms", step * 1e3);
}
