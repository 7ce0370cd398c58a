//! Architectures we have no small file of, exact to llama.cpp on synthetic models: random F32
//! weights (every matrix, so that neither side rounds activations), SmolLM2's vocabulary
//! (`zerolayer_tests::synthetic_models`):
//! - Qwen3: Q and K RMS-normed per head, half-split RoPE, no biases, and attention 4 × 64 = 256
//!   wide in a 128-wide model;
//! - Llama 3.1: the `rope_freqs` tensor (long-context RoPE factors, base 500000) and tied
//!   embeddings (no `output.weight`).
//!
//! The reference is llama.cpp's run on the same bytes (llama-cpp-python 0.3.36, KV cache in f32,
//! flash attention off; `scripts/gen-synthetic-fixtures`, `tests/fixtures/synthetic.json`). The
//! test writes each model as the generator did and refuses a file whose checksum differs.

use zerolayer_common::{Job, SeqEvent, WorkerConfig};
use zerolayer_common::config::KvDtype;
use zerolayer_worker::engine::Engine;
use zerolayer_worker::loader::load;
use zerolayer_worker::model::{ForwardItem, KvCache};
use zerolayer_tests::*;

fn fixture() -> serde_json::Value {
    reference_fixture("synthetic", "gen-synthetic-fixtures")
}

/// For each synthetic model and each of 6 prompts:
/// - the prompt's ids are our tokenizer's too;
/// - after the prompt, the ten largest logits are llama.cpp's within 1e-3;
/// - 32 greedy tokens are llama.cpp's, every one (the fixture's smallest gap between the two
///   largest logits is at least 1e-3, so no step is a near-tie);
/// - all 6 at once, with a 16-token step budget (prompts prefill in chunks beside the others'
///   decodes), give each prompt's tokens alone.
#[test]
fn synthetic_qwen3_and_llama31_follow_llama_cpp_exactly() {
    let _g = heavy();
    let fx = fixture();
    let models = fx["models"].as_array().unwrap();
    let names: Vec<&str> = models.iter().map(|m| m["name"].as_str().unwrap()).collect();
    assert_eq!(names, synthetic_models().iter().map(|m| m.0).collect::<Vec<_>>(), "the fixture covers every synthetic model");
    let dir = temp_dir("synthetic");
    for m in models {
        let name = m["name"].as_str().unwrap();
        let path = dir.join(format!("{name}.gguf"));
        let checksum = write_synthetic(name, &path);
        assert_eq!(checksum.to_string(), m["checksum"].as_str().unwrap(), "{name}: not the file llama.cpp ran on (scripts/gen-synthetic-fixtures)");
        let l = load(&path, None, 2, |_, _| {}).unwrap_or_else(|e| panic!("{name}: {e}"));
        let runs = m["runs"].as_array().unwrap();
        assert_eq!(runs.len(), 6);
        let mut model = l.model;
        for (i, r) in runs.iter().enumerate() {
            let prompt = ids_of(&r["prompt_ids"]);
            assert_eq!(l.tokenizer.encode(r["prompt"].as_str().unwrap()).unwrap(), prompt, "{name}: prompt {i}'s ids");
            assert!(r["min_gap"].as_f64().unwrap() >= 1e-3, "{name}: prompt {i} has a near-tie");
            let blocks = prompt.len() / 16 + 2;
            let mut cache = KvCache::new(model.shard_cfg(), 16, KvDtype::F32, blocks);
            let table: Vec<u32> = (0..blocks as u32).collect();
            let logits = model.forward(&mut cache, &[ForwardItem { tokens: &prompt, start_pos: 0, block_table: &table, logits: 1 }]).unwrap().remove(0);
            for t in r["top_logits"].as_array().unwrap() {
                let (id, want) = (t[0].as_u64().unwrap() as usize, t[1].as_f64().unwrap() as f32);
                assert!((logits[id] - want).abs() < 1e-3, "{name}: prompt {i}: logit of {id} is {} where llama.cpp's is {want}", logits[id]);
            }
        }
        let cfg = WorkerConfig { block_size: 16, kv_cache_mb: 64, max_batch_tokens: 512, ..engine_cfg() };
        let mut engine = Engine::new(model, l.tokenizer.clone(), &cfg).unwrap();
        for (i, r) in runs.iter().enumerate() {
            engine.add(i as u64, Job::new(ids_of(&r["prompt_ids"]), greedy_tokens(32))).unwrap();
            let got = run_all(&mut engine).remove(&(i as u64)).unwrap().0;
            assert_eq!(got, ids_of(&r["output_ids"]), "{name}: prompt {i}'s 32 greedy tokens");
        }
        let cfg = WorkerConfig { max_batch_tokens: 16, ..cfg };
        let mut engine = Engine::new(load(&path, None, 2, |_, _| {}).unwrap().model, l.tokenizer.clone(), &cfg).unwrap();
        for (i, r) in runs.iter().enumerate() {
            engine.add(10 + i as u64, Job::new(ids_of(&r["prompt_ids"]), greedy_tokens(32))).unwrap();
        }
        let out = run_all(&mut engine);
        for (i, r) in runs.iter().enumerate() {
            assert_eq!(out[&(10 + i as u64)].0, ids_of(&r["output_ids"]), "{name}: prompt {i} in the batch of 6");
            assert!(matches!(out[&(10 + i as u64)].2, SeqEvent::Finished { .. }));
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
