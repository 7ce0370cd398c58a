//! The GPU backend's checks: `gpu-check` (src/bin) runs them on a GPU machine (`scripts/gpu-check`
//! builds the binary here, where Rust is, and ships it), and on the CUDA emulator in CI. Each
//! stage prints what it found and returns it as JSON.
//!
//! (a) each kernel against the CPU kernel on the same inputs (bits equal, and the worst error);
//! (b) greedy tokens of the GPU backend against the CPU backend on a synthetic model in every
//!     weight format (and on a real GGUF if `--model` names one), and GPU batch invariance: a
//!     prompt alone and in a batch of 16 gives the same logits, bit for bit;
//! (c) decode tokens/s at batch 1, 16 and 64, and prefill tokens/s;
//! (d) the paged-attention kernel's bytes/s on a long context against the device's copy bandwidth;
//! (e) with two GPUs or more: two NCCL ranks against one GPU.
//!
//! Usage: gpu-check [--out FILE] [--model FILE.gguf] [--device N] [--stages a,b,c,d,e]. Exit status
//! 0 when (a) and (b) pass (and (e), where it ran).

use std::path::PathBuf;
use std::time::Instant;

use serde_json::{json, Value};
use zerolayer_common::config::KvDtype;
use zerolayer_kernels::attention::{paged_attention, AttnRow, KvLayout, KvView};
use zerolayer_kernels::cuda::Gpu;
use zerolayer_kernels::ops::{rms_norm_row, silu_mul};
use zerolayer_kernels::pool::ThreadPool;
use zerolayer_kernels::quant::{matmul, MatmulScratch, Weight};
use crate::backend::{Backend, Cpu, Cuda};
use crate::model::{ForwardItem, Model};
use crate::sampler::{argmax, select_top_k, top_margin, Pick, Picked};
use crate::synthetic;

pub type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn rand_vec(n: usize, seed: u64) -> Vec<f32> {
    synthetic::values(n, seed, 1.0)
}

/// (bits equal, max |Δ| / max(1, max |cpu|)) over two results.
fn compare(cpu: &[f32], gpu: &[f32]) -> (bool, f64) {
    assert_eq!(cpu.len(), gpu.len());
    let scale = cpu.iter().fold(1f32, |m, x| m.max(x.abs())) as f64;
    let worst = cpu.iter().zip(gpu).map(|(a, b)| (a - b).abs() as f64).fold(0.0, f64::max);
    (cpu.iter().zip(gpu).all(|(a, b)| a.to_bits() == b.to_bits()), worst / scale)
}

fn kernel_entry(name: &str, cpu: &[f32], gpu: &[f32]) -> Value {
    let (exact, err) = compare(cpu, gpu);
    let pass = err <= 1e-5;
    println!("  {name:<28} {} (bit-exact: {exact}, worst relative error {err:.2e})", if pass { "pass" } else { "FAIL" });
    json!({"kernel": name, "pass": pass, "bit_exact": exact, "max_rel_error": err})
}

/// (a): every kernel on the same inputs as the CPU's.
pub fn kernels(gpu: &Gpu, model: &Model) -> Res<Vec<Value>> {
    println!("(a) kernels against the CPU");
    let pool = ThreadPool::new(std::thread::available_parallelism().map(|n| n.get()).unwrap_or(4).min(16));
    let mut out = Vec::new();
    matmul_checks(gpu, model, &pool, &mut out)?;
    row_op_checks(gpu, model, &mut out)?;
    attention_check(gpu, &pool, &mut out)?;
    sampling_checks(gpu, &mut out)?;
    Ok(out)
}

/// Every weight format's matmul at 1, 7 and 40 rows.
fn matmul_checks(gpu: &Gpu, model: &Model, pool: &ThreadPool, out: &mut Vec<Value>) -> Res<()> {
    let p = model.parts();
    let dense = Weight::from_f32(96, 512, &rand_vec(96 * 512, 5));
    let q5 = {
        let t = candle_core::Tensor::from_vec(rand_vec(96 * 512, 6), (96, 512), &candle_core::Device::Cpu)?;
        let q = candle_core::quantized::QTensor::quantize(&t, candle_core::quantized::GgmlDType::Q5K)?;
        Weight::from_q5_k(96, 512, &q.data()?)
    };
    let weights: Vec<(&str, &Weight)> = vec![
        ("matmul Q4_K (attn qkv)", p.layers[0].wqkv),
        ("matmul Q6_K (attn out)", p.layers[0].wo),
        ("matmul Q4_1 (gate/up)", p.layers[0].wgate_up),
        ("matmul Q4_0 (down)", p.layers[0].wdown),
        ("matmul Q8_0 (embedding)", p.embed),
        ("matmul F32", &dense),
        ("matmul Q5_K", &q5),
    ];
    let mut act = gpu.act_scratch()?;
    for (name, w) in weights {
        // 40 rows: the tiled kernel (from TILED_FROM_ROWS), over two full tiles and a partial one.
        for rows in [1usize, 7, 40] {
            let x = rand_vec(rows * w.cols, 11 + rows as u64);
            let mut y = vec![0f32; rows * w.rows];
            matmul(pool, w, &x, &mut y, &mut MatmulScratch::default());
            let dw = gpu.weight(w)?;
            let dx = gpu.upload(&x)?;
            let mut dy = gpu.zeros::<f32>(rows * w.rows)?;
            gpu.matmul(&dw, &dx, rows, &mut act, &mut dy)?;
            out.push(kernel_entry(&format!("{name} ×{rows}"), &y, &gpu.download(&dy, rows * w.rows)?));
        }
    }
    Ok(())
}

/// Embedding rows, RMSNorm and SiLU·mul.
fn row_op_checks(gpu: &Gpu, model: &Model, out: &mut Vec<Value>) -> Res<()> {
    let p = model.parts();
    // Embedding rows.
    let toks: Vec<i32> = vec![0, 17, 4095, 3];
    let mut want = vec![0f32; toks.len() * p.embed.cols];
    for (i, &t) in toks.iter().enumerate() {
        p.embed.dequantize_row(t as usize, &mut want[i * p.embed.cols..(i + 1) * p.embed.cols]);
    }
    let (de, dt) = (gpu.weight(p.embed)?, gpu.upload(&toks)?);
    let mut dx = gpu.zeros::<f32>(want.len())?;
    gpu.embed(&de, &dt, toks.len(), &mut dx)?;
    out.push(kernel_entry("embedding rows (Q8_0)", &want, &gpu.download(&dx, want.len())?));
    // RMSNorm.
    let d = 512;
    let x = rand_vec(3 * d, 21);
    let w = rand_vec(d, 22);
    let mut want = vec![0f32; 3 * d];
    for r in 0..3 {
        rms_norm_row(&x[r * d..(r + 1) * d], &w, 1e-5, &mut want[r * d..(r + 1) * d]);
    }
    let (dx, dw) = (gpu.upload(&x)?, gpu.upload(&w)?);
    let mut dy = gpu.zeros::<f32>(3 * d)?;
    gpu.rms_norm(&dx, None, 3, &dw, 1e-5, d, &mut dy)?;
    out.push(kernel_entry("rms_norm", &want, &gpu.download(&dy, 3 * d)?));
    // SiLU·mul over [gate | up] rows.
    let f = 1536;
    let gu: Vec<f32> = rand_vec(2 * 2 * f, 23).iter().map(|v| v * 8.0).collect();
    let mut want = Vec::new();
    for r in 0..2 {
        let (g, u) = gu[r * 2 * f..(r + 1) * 2 * f].split_at(f);
        let mut g = g.to_vec();
        silu_mul(&mut g, u);
        want.extend(g);
    }
    let dg = gpu.upload(&gu)?;
    let mut dy = gpu.zeros::<f32>(2 * f)?;
    gpu.silu_mul(&dg, f, 2, &mut dy)?;
    out.push(kernel_entry("silu_mul", &want, &gpu.download(&dy, 2 * f)?));
    Ok(())
}

/// Paged attention through scattered block tables (GQA 8/2).
fn attention_check(gpu: &Gpu, pool: &ThreadPool, out: &mut Vec<Value>) -> Res<()> {
    // Paged attention through scattered block tables.
    let layout = KvLayout { block_size: 16, n_kv_heads: 2, head_dim: 64, group: 1 }; // the GPU's block-major layout
    let n_blocks = 96;
    let kc = rand_vec(n_blocks * layout.block_elems(), 31);
    let vc = rand_vec(n_blocks * layout.block_elems(), 32);
    let tables: Vec<Vec<u32>> = (0..3).map(|s| (0..32u32).map(|i| (i * 3 + s) % n_blocks as u32).collect()).collect();
    let pos = [100usize, 500, 37];
    let (n_heads, hd) = (8, 64);
    let q = rand_vec(3 * n_heads * hd, 33);
    let rows: Vec<AttnRow<'_>> = (0..3).map(|t| AttnRow { table: &tables[t], pos: pos[t] }).collect();
    let mut want = vec![0f32; 3 * n_heads * hd];
    let scale = 0.125;
    paged_attention(pool, &KvView { layout: &layout, k: &kc, v: &vc, window: 0 }, &rows, &q, n_heads * hd, n_heads, scale, &mut want);
    let flat: Vec<i32> = tables.iter().flat_map(|t| t.iter().map(|&b| b as i32)).collect();
    let at: Vec<i32> = (0..3).map(|t| (t * 32) as i32).collect();
    let pos_i: Vec<i32> = pos.iter().map(|&p| p as i32).collect();
    let (dk, dv, dq) = (gpu.upload(&kc)?, gpu.upload(&vc)?, gpu.upload(&q)?);
    let (dtab, dat, dpos) = (gpu.upload(&flat)?, gpu.upload(&at)?, gpu.upload(&pos_i)?);
    let mut scores = gpu.zeros::<f32>(1)?;
    let mut dout = gpu.zeros::<f32>(want.len())?;
    gpu.attention(&dq, 3, n_heads * hd, (&dk, &dv), (&dtab, &dat, &dpos), (n_heads, 2, hd), 16, scale, &mut scores, 501, &mut dout)?;
    out.push(kernel_entry("paged attention (GQA 8/2)", &want, &gpu.download(&dout, want.len())?));
    Ok(())
}

/// Greedy sampling and top-k selection on the device.
fn sampling_checks(gpu: &Gpu, out: &mut Vec<Value>) -> Res<()> {
    // Greedy sampling on the device: each row's first largest logit (rows with ties included).
    let vocab = 49152;
    let mut logits = rand_vec(4 * vocab, 51);
    logits[2 * vocab + 100] = 5.0;
    logits[2 * vocab + 40_000] = 5.0;
    let want: Vec<f32> = (0..4).map(|r| argmax(&logits[r * vocab..(r + 1) * vocab]) as f32).collect();
    let dl = gpu.upload(&logits)?;
    let mut dp = gpu.zeros::<i32>(4)?;
    gpu.argmax(&dl, 4, vocab, &mut dp)?;
    let got: Vec<f32> = gpu.download(&dp, 4)?.into_iter().map(|t| t as f32).collect();
    out.push(kernel_entry("argmax (greedy sampling)", &want, &got));
    // Top-k selection for sampling: rows with ties across the cut and ±0, several k and
    // temperatures, against the host's selection (candidate tokens, then scaled logits).
    let mut logits = rand_vec(3 * vocab, 53);
    logits[7] = logits[40_000];
    logits[vocab + 3] = -0.0;
    logits[vocab + 4] = 0.0;
    for i in 0..300 {
        logits[2 * vocab + i * 97] = 1.5; // 300 equal values: the cut falls among them
    }
    let sel: [(usize, u32, f32); 3] = [(0, 40, 1.0 / 0.7), (1, 1, 1.0), (2, 256, 1.0 / 1.3)];
    let (mut want_i, mut want_v) = (Vec::new(), Vec::new());
    let kmax = 256usize;
    for &(r, k, inv_t) in &sel {
        let c = select_top_k(&logits[r * vocab..(r + 1) * vocab], k as usize, inv_t);
        want_i.extend(c.iter().map(|e| e.0 as f32));
        want_v.extend(c.iter().map(|e| e.1));
    }
    let dl = gpu.upload(&logits)?;
    let (dr, dk) = (gpu.upload(&sel.map(|s| s.0 as i32))?, gpu.upload(&sel.map(|s| s.1 as i32))?);
    let dt = gpu.upload(&sel.map(|s| s.2))?;
    let (mut di, mut dv) = (gpu.zeros::<i32>(3 * kmax)?, gpu.zeros::<f32>(3 * kmax)?);
    gpu.top_k(&dl, vocab, (&dr, &dk, &dt), 3, kmax, (&mut di, &mut dv))?;
    let (gi, gv) = (gpu.download(&di, 3 * kmax)?, gpu.download(&dv, 3 * kmax)?);
    let (mut got_i, mut got_v) = (Vec::new(), Vec::new());
    for (j, &(_, k, _)) in sel.iter().enumerate() {
        got_i.extend(gi[j * kmax..j * kmax + k as usize].iter().map(|&t| t as f32));
        got_v.extend_from_slice(&gv[j * kmax..j * kmax + k as usize]);
    }
    out.push(kernel_entry("top-k selection (tokens)", &want_i, &got_i));
    out.push(kernel_entry("top-k selection (logits / T)", &want_v, &got_v));
    Ok(())
}

/// Greedy decoding of `n` tokens on a backend; returns the tokens and each step's logits.
pub fn greedy(b: &mut dyn Backend, prompt: &[u32], n: usize, table: &[u32]) -> Res<(Vec<u32>, Vec<Vec<f32>>)> {
    let (mut ctx, mut pos, mut toks, mut all, mut logits) = (prompt.to_vec(), 0, Vec::new(), Vec::new(), Vec::new());
    let v = b.config().vocab_size;
    for _ in 0..n {
        b.forward_into(&[ForwardItem { tokens: &ctx[pos..], start_pos: pos, block_table: table, logits: 1 }], &mut logits)?;
        let l = logits[..v].to_vec();
        let t = argmax(&l);
        pos = ctx.len();
        ctx.push(t);
        toks.push(t);
        all.push(l);
    }
    Ok((toks, all))
}

/// (b) on one model file: GPU against CPU greedy, and GPU batch invariance.
pub fn equivalence(path: &std::path::Path, device: usize, label: &str) -> Res<Value> {
    println!("(b) {label}: greedy tokens, GPU against CPU, and GPU batch invariance");
    let bs = 16;
    let (cpu_model, _) = Model::from_gguf(path, 0, |_, _| {})?;
    let (gpu_model, _) = Model::from_gguf(path, 0, |_, _| {})?;
    let vocab = cpu_model.cfg.vocab_size as u64;
    let budget = cpu_model.cfg.kv_bytes_per_token(KvDtype::F32) * bs * 1024;
    let mut cpu = Cpu::new(cpu_model, bs, KvDtype::F32, budget)?;
    let mut gpu = Cuda::new(gpu_model, device, bs, budget, 0.9)?;
    let table: Vec<u32> = (0..64).collect();
    let prompts: Vec<Vec<u32>> = (0..4u64).map(|i| (0..(9 + 13 * i)).map(|j| ((j * 7919 + i * 104_729) % vocab) as u32).collect()).collect();
    let n = 24;
    let mut cases = Vec::new();
    let mut pass = true;
    for (pi, p) in prompts.iter().enumerate() {
        let (tc, lc) = greedy(&mut cpu, p, n, &table)?;
        let (tg, lg) = greedy(&mut gpu, p, n, &table)?;
        let same = tc.iter().zip(&tg).take_while(|(a, b)| a == b).count();
        let worst = lc.iter().zip(&lg).take(same + usize::from(same < n)).map(|(a, b)| compare(a, b).1).fold(0.0, f64::max);
        let exact = lc.iter().zip(&lg).take(same).all(|(a, b)| compare(a, b).0);
        // A divergence is acceptable only on a near-tie (the CPU's top two within 1e-3).
        let ok = same == n || top_margin(&lc[same]) < 1e-3;
        pass &= ok;
        println!("  prompt {pi}: {same}/{n} tokens equal{}, logits bit-exact: {exact}, worst relative error {worst:.2e} {}", if same < n { format!(" (diverges, CPU margin {:.2e})", top_margin(&lc[same])) } else { String::new() }, if ok { "pass" } else { "FAIL" });
        cases.push(json!({"prompt": pi, "tokens_equal": same, "of": n, "logits_bit_exact": exact, "max_rel_error": worst, "pass": ok}));
    }
    // Sampling on the device: the top-k candidates it selects (with a greedy row beside) are
    // the host's selection over the CPU backend's logits, so a seeded draw is the same.
    let (p0, t2) = (&prompts[1], &table[..]);
    let two_rows = [
        ForwardItem { tokens: p0, start_pos: 0, block_table: t2, logits: 1 },
        ForwardItem { tokens: &prompts[2], start_pos: 0, block_table: &(64..128).collect::<Vec<u32>>(), logits: 1 },
    ];
    let inv_t = 1.0 / 0.8f32;
    let picks = [Pick::TopK { k: 40, inv_t }, Pick::Greedy];
    let (mut cl, mut gl, mut picked) = (Vec::new(), Vec::new(), Picked::default());
    cpu.forward_into(&two_rows, &mut cl)?;
    gpu.forward_pick(&two_rows, &picks, &mut gl, &mut picked)?;
    let v = vocab as usize;
    let mut got = picked.candidates(0).map(<[_]>::to_vec).unwrap_or_default();
    got.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let top_k_ok = got == select_top_k(&cl[..v], 40, inv_t) && picked.token(1) == Some(argmax(&cl[v..2 * v])) && gl.is_empty();
    pass &= top_k_ok;
    println!("  device top-k candidates and greedy token beside them, no logits sent back: {}", if top_k_ok { "pass" } else { "FAIL" });
    // Batch invariance: prompt 0 alone, then at position 5 of a batch of 16.
    let (_, alone) = greedy(&mut gpu, &prompts[0], 1, &table)?;
    let tables: Vec<Vec<u32>> = (0..16u32).map(|i| (64 + i * 40..64 + i * 40 + 40).collect()).collect();
    let others: Vec<Vec<u32>> = (0..16u64).map(|i| (0..(5 + 11 * i)).map(|j| ((j * 31 + i * 7) % vocab) as u32).collect()).collect();
    let items: Vec<ForwardItem<'_>> = (0..16)
        .map(|i| ForwardItem { tokens: if i == 5 { &prompts[0] } else { &others[i] }, start_pos: 0, block_table: &tables[i], logits: 1 })
        .collect();
    let mut logits = Vec::new();
    gpu.forward_into(&items, &mut logits)?;
    let v = vocab as usize;
    let invariant = logits[5 * v..6 * v].iter().zip(&alone[0]).all(|(a, b)| a.to_bits() == b.to_bits());
    pass &= invariant;
    println!("  batch invariance (alone vs. 6th of 16): {}", if invariant { "pass (bit-identical)" } else { "FAIL" });
    Ok(json!({"model": label, "cases": cases, "device_top_k": top_k_ok, "batch_invariant": invariant, "pass": pass}))
}

/// (e), with two GPUs or more: the synthetic model over two GPU ranks (NCCL) against one GPU,
/// greedy, with the near-tie rule of the CPU tensor-parallel tests.
pub fn tensor_parallel(path: &std::path::Path, device: usize) -> Res<Value> {
    println!("(e) tensor parallel over cuda:{device} and cuda:{}, against cuda:{device} alone", device + 1);
    let bs = 16;
    let (one_m, _) = Model::from_gguf(path, 0, |_, _| {})?;
    let (two_m, _) = Model::from_gguf(path, 0, |_, _| {})?;
    let budget = one_m.cfg.kv_bytes_per_token(KvDtype::F32) * bs * 256;
    let mut one = Cuda::new(one_m, device, bs, budget, 0.9)?;
    let mut two = crate::backend::cuda_group(two_m, device..device + 2, bs, budget, 0.9)?;
    let table: Vec<u32> = (0..64).collect();
    let vocab = one.config().vocab_size as u64;
    let mut pass = true;
    let mut cases = Vec::new();
    for pi in 0..3u64 {
        let p: Vec<u32> = (0..(11 + 7 * pi)).map(|j| ((j * 104_729 + pi * 7919) % vocab) as u32).collect();
        let (t1, l1) = greedy(&mut one, &p, 16, &table)?;
        let (t2, _) = greedy(&mut two, &p, 16, &table)?;
        let (t2b, _) = greedy(&mut two, &p, 16, &table)?;
        let same = t1.iter().zip(&t2).take_while(|(a, b)| a == b).count();
        let ok = t2 == t2b && (same == 16 || top_margin(&l1[same]) < 0.1);
        pass &= ok;
        println!("  prompt {pi}: {same}/16 tokens equal, deterministic: {} {}", t2 == t2b, if ok { "pass" } else { "FAIL" });
        cases.push(json!({"prompt": pi, "tokens_equal": same, "deterministic": t2 == t2b, "pass": ok}));
    }
    Ok(json!({"cases": cases, "pass": pass}))
}

/// (c): decode tokens/s at batch 1, 16, 64 and prefill tokens/s.
pub fn throughput(path: &std::path::Path, device: usize, label: &str) -> Res<Value> {
    println!("(c) {label}: throughput");
    let bs = 16;
    let (m, _) = Model::from_gguf(path, 0, |_, _| {})?;
    let vocab = m.cfg.vocab_size as u64;
    let mut gpu = Cuda::new(m, device, bs, 0, 0.5)?;
    let ctx = 128;
    let mut figures = serde_json::Map::new();
    let mut logits = Vec::new();
    for batch in [1usize, 16, 64] {
        let tables: Vec<Vec<u32>> = (0..batch as u32).map(|i| (i * 16..i * 16 + 16).collect()).collect();
        let prompts: Vec<Vec<u32>> = (0..batch as u64).map(|i| (0..ctx as u64).map(|j| ((j * 131 + i * 17) % vocab) as u32).collect()).collect();
        let items: Vec<ForwardItem<'_>> = (0..batch).map(|i| ForwardItem { tokens: &prompts[i], start_pos: 0, block_table: &tables[i], logits: 1 }).collect();
        gpu.forward_into(&items, &mut logits)?;
        let steps = 32;
        let t0 = Instant::now();
        for s in 0..steps {
            let toks: Vec<[u32; 1]> = (0..batch).map(|i| [((s * 7 + i) as u64 % vocab) as u32]).collect();
            let items: Vec<ForwardItem<'_>> = (0..batch).map(|i| ForwardItem { tokens: &toks[i], start_pos: ctx + s, block_table: &tables[i], logits: 1 }).collect();
            gpu.forward_into(&items, &mut logits)?;
        }
        let tps = (steps * batch) as f64 / t0.elapsed().as_secs_f64();
        println!("  decode, batch {batch:>2}: {tps:>10.0} tokens/s");
        figures.insert(format!("decode_batch_{batch}_tok_s"), json!(tps));
    }
    let tables: Vec<Vec<u32>> = (0..8u32).map(|i| (i * 40..i * 40 + 40).collect()).collect();
    let prompts: Vec<Vec<u32>> = (0..8u64).map(|i| (0..512u64).map(|j| ((j * 37 + i) % vocab) as u32).collect()).collect();
    let items: Vec<ForwardItem<'_>> = (0..8).map(|i| ForwardItem { tokens: &prompts[i], start_pos: 0, block_table: &tables[i], logits: 1 }).collect();
    gpu.forward_into(&items, &mut logits)?;
    let t0 = Instant::now();
    gpu.forward_into(&items, &mut logits)?;
    let tps = 4096.0 / t0.elapsed().as_secs_f64();
    println!("  prefill, 8 × 512 tokens: {tps:>10.0} tokens/s");
    figures.insert("prefill_tok_s".into(), json!(tps));
    Ok(json!({"model": label, "figures": figures}))
}

/// (d): the attention kernel's bytes/s on long contexts against the copy kernel's.
pub fn bandwidth(gpu: &Gpu) -> Res<Value> {
    println!("(d) paged attention against copy bandwidth");
    let n = 256 << 20; // 1 GiB of f32
    let src = gpu.zeros::<f32>(n)?;
    let mut dst = gpu.zeros::<f32>(n)?;
    gpu.copy(&src, &mut dst, n)?;
    let t = gpu.time(|| gpu.copy(&src, &mut dst, n))?;
    let copy_bps = (2 * 4 * n) as f64 / t;
    let (rows, ctx, n_heads, n_kv, hd, bs) = (64usize, 4096usize, 8usize, 2usize, 64usize, 16usize);
    let blocks = rows * ctx / bs;
    let kc = gpu.zeros::<f32>(blocks * bs * n_kv * hd)?;
    let vc = gpu.zeros::<f32>(blocks * bs * n_kv * hd)?;
    let tables: Vec<i32> = (0..blocks as i32).collect();
    let at: Vec<i32> = (0..rows).map(|r| (r * ctx / bs) as i32).collect();
    let pos: Vec<i32> = vec![(ctx - 1) as i32; rows];
    let (dt, da, dp) = (gpu.upload(&tables)?, gpu.upload(&at)?, gpu.upload(&pos)?);
    let q = gpu.upload(&rand_vec(rows * n_heads * hd, 41))?;
    let mut scores = gpu.zeros::<f32>(rows * n_heads * ctx)?;
    let mut out = gpu.zeros::<f32>(rows * n_heads * hd)?;
    let mut run = || gpu.attention(&q, rows, n_heads * hd, (&kc, &vc), (&dt, &da, &dp), (n_heads, n_kv, hd), bs, 0.125, &mut scores, ctx, &mut out);
    run()?;
    let t = gpu.time(&mut run)?;
    let kv_bytes = (rows * ctx * n_kv * hd * 2 * 4) as f64;
    let attn_bps = kv_bytes / t;
    println!("  copy {:.0} GB/s; attention over {rows} × {ctx} positions reads K/V at {:.0} GB/s = {:.2} of copy", copy_bps / 1e9, attn_bps / 1e9, attn_bps / copy_bps);
    Ok(json!({"copy_bytes_per_s": copy_bps, "attention_kv_bytes_per_s": attn_bps, "ratio": attn_bps / copy_bps, "rows": rows, "context": ctx}))
}

/// `gpu-check`'s whole run over `args` (see the module docs): the exit status.
pub fn main_with_args(args: impl Iterator<Item = String>) -> i32 {
    match run(args) {
        Ok(pass) => i32::from(!pass),
        Err(e) => {
            eprintln!("gpu-check: {e}");
            2
        }
    }
}

fn run(args: impl Iterator<Item = String>) -> Res<bool> {
    let usage = "usage: gpu-check [--out FILE] [--model FILE.gguf] [--device N] [--stages a,b,c,d,e]";
    let mut out = PathBuf::from("gpu-check.json");
    let mut model: Option<PathBuf> = None;
    let mut device = 0usize;
    let mut stages = String::from("a,b,c,d,e");
    let mut args = args;
    while let Some(a) = args.next() {
        match a.as_str() {
            "--out" => out = PathBuf::from(args.next().ok_or("--out FILE")?),
            "--model" => model = Some(PathBuf::from(args.next().ok_or("--model FILE")?)),
            "--device" => device = args.next().ok_or("--device N")?.parse()?,
            "--stages" => stages = args.next().ok_or("--stages a,b,c,d,e")?,
            _ => return Err(format!("unknown argument {a}; {usage}").into()),
        }
    }
    let run_stage: Vec<&str> = stages.split(',').map(str::trim).collect();
    if let Some(bad) = run_stage.iter().find(|s| !["a", "b", "c", "d", "e"].contains(s)) {
        return Err(format!("unknown stage {bad:?}; {usage}").into());
    }
    let wants = |s: &str| run_stage.contains(&s);
    let t0 = Instant::now();
    let gpu = Gpu::open(device)?;
    let mem = gpu.memory()?;
    println!("cuda:{device}: {} (kernels compiled for {}), {:.1} GiB free of {:.1}", gpu.name, gpu.arch, mem.free as f64 / (1u64 << 30) as f64, mem.total as f64 / (1u64 << 30) as f64);
    let dir = std::env::temp_dir().join(format!("zl-gpu-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let synth = dir.join("synthetic.gguf");
    synthetic::write(&synth, synthetic::Shape::default(), 42)?;
    // A Qwen2 too: Q/K/V biases and half-split RoPE, the other path of qkv_rope_store.
    let synth_qwen2 = dir.join("synthetic-qwen2.gguf");
    synthetic::write(&synth_qwen2, synthetic::Shape { arch: synthetic::Arch::Qwen2, ..Default::default() }, 43)?;
    let (m, _) = Model::from_gguf(&synth, 0, |_, _| {})?;
    let mut report = json!({"device": gpu.name, "arch": gpu.arch, "memory_total": mem.total});
    // Each stage runs whatever the others did: one run on a scarce machine says as much as it can.
    let stage = |name: &str, report: &mut Value, f: &mut dyn FnMut() -> Res<Value>| {
        let t = Instant::now();
        let v = f().unwrap_or_else(|e| {
            println!("  {name}: ERROR {e}");
            json!({"error": e.to_string(), "pass": false})
        });
        println!("  ({name}: {:.1} s)", t.elapsed().as_secs_f64());
        report[name] = v;
    };
    let mut models = vec![(synth.clone(), "synthetic".to_string()), (synth_qwen2.clone(), "synthetic-qwen2".to_string())];
    if let Some(p) = &model {
        models.push((p.clone(), p.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default()));
    }
    let mut pass = serde_json::Map::new();
    if wants("a") {
        stage("kernels", &mut report, &mut || Ok(json!(kernels(&gpu, &m)?)));
        pass.insert("a_kernels".into(), json!(report["kernels"].as_array().is_some_and(|k| k.iter().all(|e| e["pass"] == json!(true)))));
    }
    if wants("b") {
        stage("equivalence", &mut report, &mut || Ok(json!(models.iter().map(|(p, l)| equivalence(p, device, l).unwrap_or_else(|e| json!({"model": l, "error": e.to_string(), "pass": false}))).collect::<Vec<_>>())));
        pass.insert("b_equivalence".into(), json!(report["equivalence"].as_array().is_some_and(|e| e.iter().all(|e| e["pass"] == json!(true)))));
    }
    if wants("c") {
        stage("throughput", &mut report, &mut || Ok(json!(models.iter().map(|(p, l)| throughput(p, device, l).unwrap_or_else(|e| json!({"model": l, "error": e.to_string()}))).collect::<Vec<_>>())));
    }
    if wants("d") {
        stage("bandwidth", &mut report, &mut || bandwidth(&gpu));
    }
    if wants("e") && Gpu::count()? > device + 1 {
        stage("tensor_parallel", &mut report, &mut || tensor_parallel(&synth, device));
        pass.insert("e_tensor_parallel".into(), json!(report["tensor_parallel"]["pass"] == json!(true)));
    }
    let all = pass.values().all(|v| v == &json!(true));
    let said: Vec<String> = pass.iter().map(|(k, v)| format!("{k} {}", if v == &json!(true) { "pass" } else { "FAIL" })).collect();
    report["pass"] = Value::Object(pass);
    report["seconds"] = json!(t0.elapsed().as_secs_f64());
    std::fs::write(&out, serde_json::to_string_pretty(&report)?)?;
    let _ = std::fs::remove_dir_all(&dir);
    println!("{}; report in {}", said.join(", "), out.display());
    Ok(all)
}

/// The checks on the CUDA emulator (feature `cuda-emulator`): the GPU backend's own code, with
/// `kernels.cu` compiled for the CPU, against the CPU backend, where CI runs (no GPU).
#[cfg(all(test, feature = "cuda-emulator"))]
mod on_the_emulator {
    use super::*;

    fn synthetic_model(name: &str) -> (PathBuf, Model) {
        synthetic_of(name, synthetic::Shape::default())
    }

    fn synthetic_of(name: &str, shape: synthetic::Shape) -> (PathBuf, Model) {
        let dir = std::env::temp_dir().join(format!("zl-emu-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("synthetic.gguf");
        synthetic::write(&path, shape, 42).unwrap();
        let (m, _) = Model::from_gguf(&path, 0, |_, _| {}).unwrap();
        (path, m)
    }

    #[test]
    fn the_device_is_the_emulator_and_says_so() {
        let gpu = Gpu::open(0).unwrap();
        assert!(gpu.name.starts_with(zerolayer_kernels::cuda::emulator::NAME), "{}", gpu.name);
        assert_eq!(gpu.arch, "compute_90");
        assert!(Gpu::open(7).is_err(), "the emulator has 2 devices");
    }

    /// Every kernel gives the CPU kernel's bits (kernels.cu repeats the CPU's operations in
    /// order; only a launch whose arguments, indexing or barriers are wrong would differ).
    #[test]
    fn every_kernel_equals_the_cpu_kernel_bit_for_bit() {
        let gpu = Gpu::open(0).unwrap();
        let (_, m) = synthetic_model("kernels");
        let report = kernels(&gpu, &m).unwrap();
        assert!(report.len() >= 24, "{report:?}");
        for e in &report {
            assert_eq!(e["pass"], json!(true), "{e}");
            assert_eq!(e["bit_exact"], json!(true), "{e}");
        }
    }

    /// The CUDA backend (weights uploaded as flat blocks, paged KV in device memory, every
    /// launch of a forward) gives the CPU backend's greedy tokens and logits, and the same bits
    /// for a prompt alone and in a batch of 16.
    #[test]
    fn the_gpu_backend_equals_the_cpu_backend_and_is_batch_invariant() {
        assert_equivalent(synthetic_model("equivalence").0, "synthetic");
    }

    /// The same for a Qwen2: Q/K/V biases and half-split RoPE (qkv_rope_store's other path).
    #[test]
    fn the_gpu_backend_equals_the_cpu_backend_on_a_qwen2() {
        assert_equivalent(synthetic_of("equivalence-qwen2", synthetic::Shape { n_layers: 2, arch: synthetic::Arch::Qwen2, ..Default::default() }).0, "synthetic-qwen2");
    }

    fn assert_equivalent(path: PathBuf, label: &str) {
        let r = equivalence(&path, 0, label).unwrap();
        assert_eq!(r["pass"], json!(true), "{r}");
        assert_eq!(r["batch_invariant"], json!(true), "{r}");
        assert_eq!(r["device_top_k"], json!(true), "{r}");
        for c in r["cases"].as_array().unwrap() {
            assert_eq!(c["tokens_equal"], c["of"], "{c}");
            assert_eq!(c["logits_bit_exact"], json!(true), "{c}");
        }
    }

    /// Two emulated GPUs as one tensor-parallel group (NCCL all-gather, rank-order sums) give
    /// one GPU's greedy tokens except at near-ties, the same run to run.
    #[test]
    fn tensor_parallel_over_two_emulated_gpus() {
        let (path, _) = synthetic_model("tp");
        let r = tensor_parallel(&path, 0).unwrap();
        assert_eq!(r["pass"], json!(true), "{r}");
    }
}
