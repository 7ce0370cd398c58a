//! Tensor parallelism on the CPU collective (threads in this process): the sharding that GPU
//! groups use, on the real models.
//!
//! - TP = 2 (and 3) computes the same function as TP = 1: greedy tokens are equal on the
//!   reference prompts except where TP = 1's top two logits are a near-tie, and the logits stay
//!   close throughout. (The only difference is the order of one sum: the attention output and
//!   FFN down projections add the ranks' partial sums instead of running one long sum.)
//! - It is deterministic run to run and batch invariant: a prompt alone and in a batch gives
//!   the same bits.
//! - Its KV blocks travel in the common layout: layer 0's (before any all-reduce) are the
//!   unsharded worker's bit for bit, and a sequence moves between a sharded and an unsharded
//!   engine.
//! - Uneven splits work: SmolLM2's 3 KV heads over 2 ranks (2 + 1).

use zerolayer_common::config::KvDtype;
use zerolayer_common::{Job, SamplingParams, SeqEvent};
use zerolayer_worker::backend::{self, Backend};
use zerolayer_common::WorkerConfig;
use zerolayer_worker::engine::Engine;
use zerolayer_worker::loader::{load, Loaded};
use zerolayer_worker::model::ForwardItem;
use zerolayer_worker::sampler::{argmax, top_margin};
use zerolayer_tests::*;

const BLOCK: usize = 16;
const BLOCKS: usize = 64;

fn load_model(qwen: bool) -> Loaded {
    let path = if qwen { qwen_model_path() } else { model_path() };
    load(&path, None, 2, |_, _| {}).expect("load the model")
}

fn backend_of(qwen: bool, tp: usize) -> Box<dyn Backend> {
    let l = load_model(qwen);
    let budget = l.model.cfg.kv_bytes_per_token(KvDtype::F32) * BLOCK * BLOCKS;
    backend::cpu(l.model, tp, 2, BLOCK, KvDtype::F32, budget).expect("backend")
}

/// Greedy decoding of `n` tokens straight on a backend: the tokens, and the logits each was
/// chosen from.
fn greedy(b: &mut dyn Backend, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    greedy_on(b, prompt, n, &(0..BLOCKS as u32).collect::<Vec<_>>())
}



fn prompts(qwen: bool) -> Vec<Vec<u32>> {
    let l = load_model(qwen);
    [
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
        "Once upon a time, in a small village by the sea,",
        "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n",
        "<|im_start|>user\nWrite a haiku about the ocean.<|im_end|>\n<|im_start|>assistant\n",
    ]
    .iter()
    .map(|p| l.tokenizer.encode(p).unwrap())
    .collect()
}

/// Checks that TP = `tp` computes TP = 1's function: greedy tokens equal until a step where TP =
/// 1's top-two margin is within twice the RMS logit difference between the two (a near-tie the
/// numerical noise can flip; from there on the contexts differ), and logits within
/// `max_rel_l2` (relative L2) of each other at every step compared.
///
/// Why the noise is not ~1e-7: activations are quantized to int8 per 32-element block before
/// every matmul (llama.cpp's Q8_1 scheme), so a one-ulp difference in a residual can move an
/// activation to the next code, a 1/127 step; such steps then compound over the layers. The KV
/// test below shows the sharded arithmetic itself is exact up to the first all-reduce.
fn assert_same_function(qwen: bool, tp: usize, max_rel_l2: f64) {
    let n = 24;
    let ps = prompts(qwen);
    let mut one = backend_of(qwen, 1);
    let mut many = backend_of(qwen, tp);
    assert!(many.describe().contains(&format!("over {tp} ranks")), "{}", many.describe());
    let (mut equal, mut worst_rel) = (0, 0f64);
    for (pi, p) in ps.iter().enumerate() {
        let (t1, l1) = greedy(&mut *one, p, n);
        let (t2, l2) = greedy(&mut *many, p, n);
        for step in 0..n {
            let d2: f64 = l1[step].iter().zip(&l2[step]).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
            let n2: f64 = l1[step].iter().map(|a| (*a as f64).powi(2)).sum();
            worst_rel = worst_rel.max((d2 / n2).sqrt());
            if t1[step] != t2[step] {
                let m = top_margin(&l1[step]);
                let rms = (d2 / l1[step].len() as f64).sqrt() as f32;
                assert!(m < 2.0 * rms, "prompt {pi} step {step}: TP={tp} chose {} where TP=1 chose {} by a margin of {m}, beyond the noise (RMS Δlogit {rms})", t2[step], t1[step]);
                eprintln!("prompt {pi}: diverges at step {step} on a near-tie (margin {m:.4}, RMS Δlogit {rms:.4})");
                break;
            }
        }
        if t1 == t2 {
            equal += 1;
        }
    }
    eprintln!("TP={tp} ({}): {equal}/{} prompts equal over {n} tokens; worst relative L2 of logits {worst_rel:.2e}", if qwen { "Qwen" } else { "SmolLM2" }, ps.len());
    assert!(worst_rel < max_rel_l2, "TP={tp} logits differ from TP=1's by {worst_rel:.2e} (relative L2)");
}

#[test]
fn qwen_tp2_computes_what_tp1_does() {
    let _g = heavy();
    // Measured 2.9e-2.
    assert_same_function(true, 2, 6e-2);
}

#[test]
fn smollm2_uneven_tp2_and_tp3_compute_what_tp1_does() {
    let _g = heavy();
    // Measured 1.1e-1 (the 135M model at Q4_1 is the more sensitive to activation codes).
    assert_same_function(false, 2, 0.2);
    assert_same_function(false, 3, 0.2);
}

/// Run to run, and alone against in a batch (other prompts prefilling and decoding beside it,
/// at other batch positions), TP = 2 gives the same bits.
#[test]
fn tp_is_deterministic_and_batch_invariant() {
    let _g = heavy();
    let ps = prompts(true);
    let mut b = backend_of(true, 2);
    let (t_alone, l_alone) = greedy(&mut *b, &ps[0], 8);
    let (t_again, l_again) = greedy(&mut *b, &ps[0], 8);
    assert_eq!((&t_alone, &l_alone), (&t_again, &l_again), "run to run");
    // The same prompt at position 1 of a batch of 3, in table-disjoint blocks.
    let tables: Vec<Vec<u32>> = (0..3).map(|i| (i * 20..i * 20 + 20).map(|x| x as u32).collect()).collect();
    let seqs = [ps[2].clone(), ps[0].clone(), ps[3].clone()];
    let mut ctx: Vec<Vec<u32>> = seqs.to_vec();
    let mut pos = vec![0usize; 3];
    let mut logits = Vec::new();
    let v = b.config().vocab_size;
    for step in 0..8 {
        let items: Vec<ForwardItem<'_>> = (0..3).map(|i| ForwardItem { tokens: &ctx[i][pos[i]..], start_pos: pos[i], block_table: &tables[i], logits: 1 }).collect();
        assert_eq!(b.forward_into(&items, &mut logits).unwrap(), 3);
        assert_eq!(logits[v..2 * v], l_alone[step][..], "step {step}: the batched row differs from the same prompt alone");
        for i in 0..3 {
            pos[i] = ctx[i].len();
            let t = argmax(&logits[i * v..(i + 1) * v]);
            ctx[i].push(t);
        }
        assert_eq!(ctx[1].last(), Some(&t_alone[step]));
    }
}

/// Blocks read from a TP = 2 backend are in the common layout: layer 0's K and V (computed
/// before any all-reduce) equal the unsharded backend's bit for bit, later layers' are close;
/// and bytes written are read back unchanged.
#[test]
fn tp_kv_blocks_are_in_the_common_layout() {
    let _g = heavy();
    let p = &prompts(false)[1];
    let (mut one, mut two) = (backend_of(false, 1), backend_of(false, 2));
    assert_eq!(one.kv().block_bytes, two.kv().block_bytes);
    assert_eq!(one.kv().num_blocks, two.kv().num_blocks, "the group has the whole model's blocks");
    greedy(&mut *one, p, 1);
    greedy(&mut *two, p, 1);
    let (mut a, mut b) = (Vec::new(), Vec::new());
    one.read_block(0, &mut a).unwrap();
    two.read_block(0, &mut b).unwrap();
    let cfg = one.config().clone();
    let layer_bytes = 2 * BLOCK * cfg.kv_dim() * 4;
    assert_eq!(a.len(), cfg.n_layers * layer_bytes);
    assert_eq!(a[..layer_bytes], b[..layer_bytes], "layer 0 K/V");
    let f = |x: &[u8]| -> Vec<f32> { x.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect() };
    let (fa, fb) = (f(&a), f(&b));
    let d2: f64 = fa.iter().zip(&fb).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
    let n2: f64 = fa.iter().map(|a| (*a as f64).powi(2)).sum();
    eprintln!("K/V of all layers: relative L2 {:.2e}", (d2 / n2).sqrt());
    assert!((d2 / n2).sqrt() < 0.05, "K/V differ by {:.2e} (relative L2)", (d2 / n2).sqrt());
    assert!(fa != fb, "later layers sum partials in another order; bit-equality would mean the test reads one rank twice");
    // Written bytes come back in the same layout.
    two.write_block(5, &a).unwrap();
    let mut back = Vec::new();
    two.read_block(5, &mut back).unwrap();
    assert_eq!(back, a);
    // Outside the cache, or of the wrong size: refused, not a panic, and nothing is appended.
    let n = two.kv().num_blocks as u32;
    assert!(two.read_block(n, &mut back).is_err() && back == a);
    assert!(two.write_block(n, &a).is_err());
    assert!(two.write_block(5, &a[1..]).is_err());
}

/// A sequence exported from a TP = 2 engine mid-decode resumes on another TP = 2 engine with
/// exactly the tokens of an uninterrupted run (its KV blocks are used, not recomputed), and its
/// blocks are accepted by an unsharded engine of the same model, which serves the rest from
/// them. With either KV element type; a cache of the other type refuses the blocks.
#[test]
fn sequences_move_between_sharded_and_unsharded_engines() {
    let _g = heavy();
    for (kv_dtype, other) in [(KvDtype::F32, KvDtype::F16), (KvDtype::F16, KvDtype::F32)] {
        move_between_engines(kv_dtype, other);
    }
}

fn move_between_engines(kv_dtype: KvDtype, other: KvDtype) {
    let ecfg = WorkerConfig { block_size: BLOCK, kv_cache_mb: 32, kv_dtype, ..engine_cfg() };
    let make = |tp: usize| {
        let l = load_model(false);
        let b = backend::cpu(l.model, tp, 2, BLOCK, ecfg.kv_dtype, ecfg.kv_cache_mb << 20).unwrap();
        Engine::with_backend(b, l.tokenizer, &ecfg).unwrap()
    };
    let prompt = prompts(false)[1].clone();
    let params = SamplingParams { max_tokens: 40, temperature: 0.0, ignore_eos: true, ..Default::default() };
    let mut straight = make(2);
    straight.add(1, Job::new(prompt.clone(), params.clone())).unwrap();
    let reference = run_all(&mut straight).remove(&1).unwrap().0;
    assert_eq!(reference.len(), 40);

    let mut origin = make(2);
    origin.add(7, Job::new(prompt.clone(), params.clone())).unwrap();
    let mut got = Vec::new();
    while got.len() < 20 {
        for (_, ev) in origin.step().unwrap().events {
            if let SeqEvent::Delta { tokens, .. } = ev {
                got.extend(tokens);
            }
        }
    }
    let export = origin.export(7).expect("export");
    assert_eq!(export.generated, got);
    let blocks = export.block_hashes.len();
    assert!(blocks >= 2, "full blocks travel");
    let import = || export.to_import(|_| false);
    // A cache of the other element type has blocks of another size: refused, nothing written.
    let l = load_model(false);
    let wrong_cfg = WorkerConfig { kv_dtype: other, ..ecfg.clone() };
    let b = backend::cpu(l.model, 1, 2, BLOCK, other, ecfg.kv_cache_mb << 20).unwrap();
    let mut wrong = Engine::with_backend(b, l.tokenizer, &wrong_cfg).unwrap();
    let e = wrong.import(&import()).unwrap_err().to_string();
    assert!(e.contains("bytes"), "{kv_dtype} blocks into a {other} cache: {e}");
    for tp in [2, 1] {
        let mut target = make(tp);
        let report = target.import(&import()).unwrap();
        assert_eq!(report.imported, blocks, "TP={tp}: {report:?}");
        target.add(8, Job::new(export.prompt.clone(), params.clone()).resuming(export.generated.clone())).unwrap();
        let mut rest = Vec::new();
        let mut first = true;
        while target.has_work() {
            let step = target.step().unwrap();
            if first {
                let fresh = prompt.len() + got.len() - blocks * BLOCK;
                assert_eq!(step.tokens_computed, fresh, "TP={tp}: the resumed sequence computes only what the imported blocks do not hold");
                first = false;
            }
            for (_, ev) in step.events {
                if let SeqEvent::Delta { tokens, .. } = ev {
                    rest.extend(tokens);
                }
            }
        }
        let all: Vec<u32> = got.iter().chain(&rest).copied().collect();
        assert_eq!(all.len(), 40);
        if tp == 2 {
            assert_eq!(all, reference, "{kv_dtype} KV, moved between TP=2 engines: the tokens of an uninterrupted run");
        }
    }
}

/// A node whose worker is sharded over two ranks serves the API, and answers the same
/// greedy request the same way every time (alone, and beside other requests).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_serves_with_a_tensor_parallel_worker() {
    let _g = heavy();
    let ask = |q: &str| serde_json::json!({"model": "SmolLM2-135M-Instruct", "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": q}]});
    let c = reqwest::Client::builder().timeout(std::time::Duration::from_secs(120)).build().unwrap();
    let s = TestServer::start(|cfg| cfg.nodes[0].workers[0].tensor_parallel = 2).await;
    let text = |v: serde_json::Value| v["content"][0]["text"].as_str().unwrap().to_string();
    let alone = c.post(s.url("/v1/messages")).json(&ask("What is the capital of France?")).send().await.unwrap();
    assert_eq!(alone.status(), 200);
    let alone = text(alone.json().await.unwrap());
    assert!(!alone.is_empty());
    let (a, b) = tokio::join!(
        c.post(s.url("/v1/messages")).json(&ask("What is the capital of France?")).send(),
        c.post(s.url("/v1/messages")).json(&ask("Name a color.")).send()
    );
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!((a.status().as_u16(), b.status().as_u16()), (200, 200));
    assert_eq!(text(a.json().await.unwrap()), alone, "the same greedy request beside another");
    s.stop().await.unwrap();
}

/// A GPU worker in a build without the CUDA backend (as CI's) stops the node at startup, saying
/// so and what to do: never a silent fall back to the CPU.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_worker_without_a_cuda_build_is_refused_saying_why() {
    let mut cfg = zerolayer_common::ClusterConfig::default();
    cfg.model.path = model_path();
    cfg.nodes[0].http = "127.0.0.1:0".into();
    cfg.nodes[0].workers[0].device = "cuda:0".into();
    cfg.nodes[0].workers[0].kv_cache_mb = 64;
    let err = match zerolayer_coordinator::node::Node::start(cfg, "n1", |_, _, _| {}).await {
        Ok(_) => panic!("a cuda:0 worker started in a build without the CUDA backend"),
        Err(e) => format!("{e:#}"),
    };
    assert!(err.contains("cuda:0") && err.contains("no CUDA backend") && err.contains("--features cuda"), "{err}");
}
