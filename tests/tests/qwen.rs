//! The second model family: Qwen2.5-Coder-0.5B-Instruct (qwen2 architecture, Q4_K_M GGUF with
//! Q5_0, Q8_0, Q4_K and Q6_K tensors, Q/K/V biases, half-split RoPE at base 1e6, 32k context),
//! against llama.cpp itself (`tests/fixtures/qwen2.5-coder.json`, made by
//! `scripts/gen-qwen-fixtures` with llama-cpp-python on the same file).

use zerolayer_common::{Job, SeqEvent};
use zerolayer_worker::chat::ChatMessage;
use zerolayer_common::WorkerConfig;
use zerolayer_worker::engine::Engine;
use zerolayer_worker::loader::load;
use zerolayer_tests::*;

fn fixture() -> serde_json::Value {
    reference_fixture("qwen2.5-coder", "gen-qwen-fixtures")
}

/// The architecture is read from the file, and the tokenizer and chat template come from it.
#[test]
fn qwen_loads_with_its_architecture_tokenizer_and_template() {
    let _g = heavy();
    let l = load(&qwen_model_path(), None, 2, |_, _| {}).expect("load Qwen2.5-Coder");
    let c = &l.model.cfg;
    assert_eq!((c.arch.as_str(), c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.head_dim), ("qwen2", 24, 896, 14, 2, 64));
    assert_eq!((c.context_length, c.rope_base, c.vocab_size), (32768, 1e6, 151936));
    let im_end = l.tokenizer.encode("<|im_end|>").unwrap();
    assert_eq!(im_end, vec![151645]);
    assert!(l.tokenizer.is_end_token(151645));
    let text = l
        .template
        .render_for_generation(&[ChatMessage::new("system", "Be brief."), ChatMessage::new("user", "Hi")])
        .unwrap();
    assert_eq!(text, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");

    let fx = fixture();
    let cases = fx["tokenizer"].as_array().unwrap();
    assert!(cases.len() >= 10);
    for c in cases {
        let text = c["text"].as_str().unwrap();
        assert_eq!(l.tokenizer.encode(text).unwrap(), ids_of(&c["ids"]), "encoding {text:?}");
    }
    // Digits one by one (the `qwen2` pre-tokenizer), unlike Llama 3's groups of three.
    assert_eq!(l.tokenizer.encode("12345").unwrap().len(), 5);
}

/// Greedy decoding gives llama.cpp's tokens on 3 prompts, each alone and all three batched
/// together (prefill chunks of different sizes, then decodes side by side).
#[test]
fn qwen_greedy_output_equals_llama_cpp() {
    let _g = heavy();
    let fx = fixture();
    let runs = fx["greedy"].as_array().unwrap();
    assert_eq!(runs.len(), 3);
    let l = load(&qwen_model_path(), None, 2, |_, _| {}).expect("load Qwen2.5-Coder");
    let cfg = WorkerConfig { block_size: 16, kv_cache_mb: 256, max_batch_tokens: 48, ..engine_cfg() };
    let mut engine = Engine::new(l.model, l.tokenizer.clone(), &cfg).unwrap();
    let mut alone = Vec::new();
    for (i, r) in runs.iter().enumerate() {
        let prompt = ids_of(&r["prompt_ids"]);
        assert_eq!(l.tokenizer.encode(r["prompt"].as_str().unwrap()).unwrap(), prompt, "prompt {i} tokenizes as in llama.cpp");
        let want = ids_of(&r["output_ids"]);
        engine.add(i as u64, Job::new(prompt, greedy_tokens(want.len() as u32))).unwrap();
        let out = run_all(&mut engine);
        let got = &out[&(i as u64)].0;
        assert_eq!(
            got,
            &want,
            "prompt {i}: ours {:?} vs llama.cpp {:?}",
            l.tokenizer.decode(got).unwrap(),
            r["output_text"].as_str().unwrap()
        );
        alone.push(got.clone());
    }
    // All three at once, with a 48-token step budget so prompts prefill in chunks beside decodes.
    for (i, r) in runs.iter().enumerate() {
        engine.add(10 + i as u64, Job::new(ids_of(&r["prompt_ids"]), greedy_tokens(alone[i].len() as u32))).unwrap();
    }
    let out = run_all(&mut engine);
    for (i, want) in alone.iter().enumerate() {
        assert_eq!(&out[&(10 + i as u64)].0, want, "prompt {i} batched");
        assert!(matches!(out[&(10 + i as u64)].2, SeqEvent::Finished { .. }));
    }
}

/// Qwen's tool-call tags are user-defined tokens: ordinary text in output, unlike control tokens.
#[test]
fn qwen_tool_call_tags_are_output_text() {
    let l = load(&qwen_model_path(), None, 2, |_, _| {}).expect("load Qwen2.5-Coder");
    let ids = l.tokenizer.encode("<tool_call>\n{}\n</tool_call><|im_end|>").unwrap();
    assert_eq!(ids[0], 151657);
    assert_eq!(l.tokenizer.decode(&ids).unwrap(), "<tool_call>\n{}\n</tool_call>");
}

/// Tool conversations (offered tools; a turn with text and two calls; two results, one as
/// text blocks) parsed as Anthropic requests give exactly the prompt tokens that Hugging Face's
/// rendering of the same conversation gives through llama.cpp's tokenizer.
#[test]
fn qwen_tool_prompts_equal_hugging_face_rendering() {
    let fx = fixture();
    let l = load(&qwen_model_path(), None, 2, |_, _| {}).expect("load Qwen2.5-Coder");
    let cases = fx["tool_prompts"].as_array().unwrap();
    assert_eq!(cases.len(), 2);
    for (i, c) in cases.iter().enumerate() {
        let req = zerolayer_coordinator::frontend::api::anthropic::parse(&c["request"], zerolayer_coordinator::frontend::api::anthropic::Endpoint::Messages)
            .unwrap_or_else(|e| panic!("case {i}: {e}"));
        let text = req.generation.render(&l.template).unwrap();
        assert_eq!(text, c["text"].as_str().unwrap(), "case {i}: rendered text");
        let ids = zerolayer_coordinator::frontend::prompt::prompt_ids(&req.generation, &l.template, &l.tokenizer, false).unwrap();
        assert_eq!(ids, ids_of(&c["ids"]), "case {i}: prompt tokens");
    }
}
