//! Engine throughput on the real model, measured directly on the engine (no HTTP).
//!
//! `cargo run -p zerolayer-tests --bin engine_bench -- [--threads N] [--tensor-parallel N] [--json PATH] [--repeat N] [--only FIGURE] [--kv-dtype f32|f16] [--block-size N]`
//!
//! Reports batch-1 decode tokens/s, prefill tokens/s, and aggregate decode tokens/s with 8 and
//! 16 concurrent sequences (and 16 with the HTTP benchmark's longer contexts): each the median of `--repeat` runs (default 3; every run's figure goes to stderr). `--only b1|prefill|
//! agg8|agg16|agg16ctx` measures one figure (for profiling). `--block-size` overrides the KV block size (default the engine's). Run it on an idle machine.

use std::time::Instant;

use zerolayer_common::config::KvDtype;
use zerolayer_common::{Job, SamplingParams, SeqEvent};
use zerolayer_common::WorkerConfig;
use zerolayer_worker::engine::Engine;
use zerolayer_worker::loader::load;
use zerolayer_tests::{engine_cfg, model_path, LOREM};

fn prompt(engine: &Engine, n: usize, salt: usize) -> Vec<u32> {
    let mut t = engine.tokenizer.encode(&format!("Note {salt}: {}", LOREM.repeat(1 + n / 150))).unwrap();
    t.truncate(n);
    t
}

/// Runs `n` sequences of `prompt_len` + `gen` tokens concurrently; returns (prefill seconds,
/// decode seconds, generated tokens). Decode time runs from the step after the last prompt
/// finished prefilling to the end.
fn run(engine: &mut Engine, n: usize, prompt_len: usize, gen: u32, salt: usize) -> (f64, f64, usize) {
    for i in 0..n {
        let p = prompt(engine, prompt_len, salt * 100 + i);
        engine.add((salt * 100 + i) as u64, Job::new(p, SamplingParams { max_tokens: gen, ignore_eos: true, ..SamplingParams::greedy(gen) })).unwrap();
    }
    let t0 = Instant::now();
    let mut started = std::collections::HashSet::new();
    let mut t_decode = None;
    let mut generated = 0;
    while engine.has_work() {
        let out = engine.step().unwrap();
        for (id, ev) in out.events {
            if let SeqEvent::Delta { tokens, .. } = ev {
                if !tokens.is_empty() {
                    if t_decode.is_some() {
                        generated += tokens.len();
                    } else {
                        started.insert(id);
                    }
                }
            }
        }
        if t_decode.is_none() && started.len() == n {
            t_decode = Some(Instant::now());
        }
    }
    let end = Instant::now();
    let td = t_decode.unwrap_or(end);
    (td.duration_since(t0).as_secs_f64(), end.duration_since(td).as_secs_f64(), generated)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let get = |k: &str| args.iter().position(|a| a == k).and_then(|i| args.get(i + 1)).cloned();
    let threads: usize = get("--threads").map(|v| v.parse().unwrap()).unwrap_or(2);
    let json_path = get("--json");
    let tp: usize = get("--tensor-parallel").map(|v| v.parse().unwrap()).unwrap_or(1);
    let l = load(&model_path(), None, threads, |_, _| {}).unwrap();
    let kv_dtype = match get("--kv-dtype").as_deref() {
        None | Some("f32") => KvDtype::F32,
        Some("f16") => KvDtype::F16,
        Some(other) => panic!("--kv-dtype {other:?}: f32 or f16"),
    };
    let defaults = engine_cfg();
    let block_size: usize = get("--block-size").map(|v| v.parse().unwrap()).unwrap_or(defaults.block_size);
    let ecfg = WorkerConfig { max_batch_tokens: 512, kv_cache_mb: 1024, kv_dtype, block_size, ..defaults };
    let backend = zerolayer_worker::backend::cpu(l.model, tp, threads, ecfg.block_size, ecfg.kv_dtype, ecfg.kv_cache_mb << 20).unwrap();
    eprintln!("backend: {}", backend.describe());
    let mut engine = Engine::with_backend(backend, l.tokenizer, &ecfg).unwrap();
    let repeat: usize = get("--repeat").map(|v| v.parse().unwrap()).unwrap_or(3).max(1);
    let only = get("--only");
    let want = |name: &str| only.as_deref().is_none_or(|o| o == name);
    // Warm-up.
    run(&mut engine, 1, 32, 8, 1);
    let mut salt = 2;
    let mut median = |name: &str, f: &mut dyn FnMut(&mut Engine, usize) -> f64| -> f64 {
        if !want(name) {
            return f64::NAN;
        }
        let mut v: Vec<f64> = (0..repeat)
            .map(|_| {
                salt += 1;
                f(&mut engine, salt)
            })
            .collect();
        eprintln!("{name}: {}", v.iter().map(|x| format!("{x:.1}")).collect::<Vec<_>>().join(" "));
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let b1 = median("b1", &mut |e, s| {
        let (_, d, g) = run(e, 1, 32, 128, s);
        g as f64 / d
    });
    let prefill = median("prefill", &mut |e, s| 512.0 / run(e, 1, 512, 1, s).0);
    let a8 = median("agg8", &mut |e, s| {
        let (_, d, g) = run(e, 8, 32, 64, s);
        g as f64 / d
    });
    let a16 = median("agg16", &mut |e, s| {
        let (_, d, g) = run(e, 16, 32, 64, s);
        g as f64 / d
    });
    // The HTTP benchmark's short-stream shape (`scripts/bench`: 110-token prompts, 256 output
    // tokens): longer contexts, so attention weighs more than in `agg16`.
    let a16ctx = median("agg16ctx", &mut |e, s| {
        let (_, d, g) = run(e, 16, 110, 256, s);
        g as f64 / d
    });
    // A figure left out by `--only` reads "not run" (and `null` in the JSON).
    let fig = |x: f64| if x.is_nan() { "not run".to_string() } else { format!("{x:.1}") };
    println!("| figure | tokens/s |\n|---|---|");
    println!("| batch-1 decode (32-token prompt, 128 generated) | {} |", fig(b1));
    println!("| prefill, one 512-token prompt | {} |", fig(prefill));
    println!("| aggregate decode, 8 concurrent sequences | {} |", fig(a8));
    println!("| aggregate decode, 16 concurrent sequences | {} |", fig(a16));
    println!("| aggregate decode, 16 sequences, 110-token prompts, 256 generated | {} |", fig(a16ctx));
    if let Some(p) = json_path {
        let j = serde_json::json!({"threads": threads, "batch1_decode_tps": b1, "prefill_tps": prefill, "agg8_decode_tps": a8, "agg16_decode_tps": a16, "agg16ctx_decode_tps": a16ctx});
        std::fs::write(p, serde_json::to_string_pretty(&j).unwrap()).unwrap();
    }
}
