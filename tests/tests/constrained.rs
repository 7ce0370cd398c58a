//! Constrained decoding (llguidance): the engine only samples what a request's grammar allows,
//! in a batch and across a move, and the official SDKs (Python and TypeScript) get forced tool
//! inputs and structured outputs that validate against their schemas, 50 of 50.

use std::time::Duration;

use serde_json::{json, Value};
use zerolayer_common::{Job, SamplingParams, SeqEvent, StopReason};
use zerolayer_worker::chat::{ChatMessage, ChatTemplate};
use zerolayer_common::WorkerConfig;
use zerolayer_worker::engine::Engine;
use zerolayer_tests::*;

/// A JSON object with an integer and a word from a list, as the coordinator would write it.
const GRAMMAR: &str = r#"start: %json {"type": "object", "properties": {"n": {"type": "integer"}, "word": {"enum": ["alpha", "beta", "gamma"]}}, "required": ["n", "word"], "additionalProperties": false, "x-guidance": {"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}}"#;

fn prompt(engine: &Engine, template: &ChatTemplate, text: &str) -> Vec<u32> {
    let p = template.render_for_generation(&[ChatMessage::new("user", text)]).unwrap();
    engine.tokenizer.encode(&p).unwrap()
}

/// Sampled (temperature 1), so the grammar, not the model's habits, makes the output valid.
fn constrained(seed: u64) -> SamplingParams {
    SamplingParams { temperature: 1.0, seed: Some(seed), max_tokens: 64, grammar: Some(GRAMMAR.into()), ..Default::default() }
}

fn check(text: &str) {
    let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?} is not JSON: {e}"));
    let o = v.as_object().unwrap_or_else(|| panic!("{text:?} is not an object"));
    assert_eq!(o.len(), 2, "{text}");
    assert!(o["n"].is_i64() || o["n"].is_u64(), "{text}");
    assert!(["alpha", "beta", "gamma"].contains(&o["word"].as_str().unwrap()), "{text}");
}

#[test]
fn the_grammar_holds_in_a_batch_and_across_a_move() {
    let _g = heavy();
    let template = load_default().template;
    let mut solo = engine(engine_cfg());
    let asks = ["Pick a number and a Greek letter.", "Write a poem about the sea.", "Count to five.", "What is two plus two?"];
    let prompts: Vec<Vec<u32>> = asks.iter().map(|a| prompt(&solo, &template, a)).collect();
    // Alone: each of 4 seeds gives valid JSON that ends the turn.
    let mut alone = vec![];
    for seed in 0..4u64 {
        solo.add(seed, Job::new(prompts[seed as usize].clone(), constrained(seed))).unwrap();
        let out = run_all(&mut solo);
        let (tokens, text, fin) = &out[&seed];
        check(text);
        assert!(matches!(fin, SeqEvent::Finished { reason: StopReason::EndTurn, .. }), "{fin:?}");
        alone.push(tokens.clone());
    }
    let free = SamplingParams::greedy(24);
    let mut free_alone = vec![];
    for (i, p) in prompts.iter().enumerate() {
        solo.add(100 + i as u64, Job::new(p.clone(), free.clone())).unwrap();
        free_alone.push(run_all(&mut solo)[&(100 + i as u64)].0.clone());
    }

    // Together, in a small odd step budget: the constrained sequences sample what they did
    // alone, and the free ones next to them are untouched by the masks.
    let mut batch = engine(WorkerConfig { max_batch_tokens: 37, ..engine_cfg() });
    for (i, p) in prompts.iter().enumerate() {
        batch.add(i as u64, Job::new(p.clone(), constrained(i as u64))).unwrap();
        batch.add(100 + i as u64, Job::new(p.clone(), free.clone())).unwrap();
    }
    let out = run_all(&mut batch);
    for i in 0..prompts.len() {
        assert_eq!(out[&(i as u64)].0, alone[i], "constrained sequence {i} differs in a batch");
        assert_eq!(out[&(100 + i as u64)].0, free_alone[i], "free sequence {i} differs next to constrained ones");
    }

    // Moved after 5 tokens (exported, resumed on another engine): the parser is rebuilt from
    // the tokens so far and the sequence continues with exactly the same tokens.
    let mut from = engine(engine_cfg());
    from.add(7, Job::new(prompts[0].clone(), constrained(0))).unwrap();
    let mut sent = 0;
    while sent < 5 {
        for (_, ev) in from.step().unwrap().events {
            if let SeqEvent::Delta { tokens, .. } = ev {
                sent += tokens.len();
            }
        }
    }
    let moved = from.export(7).expect("exported");
    assert!(moved.generated.len() >= 5 && moved.generated.len() < alone[0].len(), "{} of {}", moved.generated.len(), alone[0].len());
    let mut to = engine(engine_cfg());
    to.add(7, Job::new(moved.prompt.clone(), SamplingParams { seed: Some(moved.seed), ..constrained(0) }).resuming(moved.generated.clone())).unwrap();
    let rest = run_all(&mut to);
    let mut whole = moved.generated.clone();
    whole.extend(&rest[&7].0);
    assert_eq!(whole, alone[0], "the moved sequence continues with the same tokens");

    // A grammar that does not compile fails that request alone, at once.
    let bad = SamplingParams { grammar: Some("start: %json {".into()), ..SamplingParams::greedy(8) };
    assert!(solo.add(50, Job::new(prompts[0].clone(), bad)).is_err());
}

/// A forced call streams as a `tool_use` block whose `input_json_delta`s add up to input that
/// holds to the schema; free text with tools on `auto` stays text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forced_call_streams_as_tool_use_and_auto_text_stays_free() {
    let _g = heavy();
    let s = TestServer::qwen().await;
    let c = http_client(300);
    let order = json!({"name": "place_order", "description": "Place an order",
        "input_schema": {"type": "object", "properties": {"item": {"type": "string", "maxLength": 30}, "quantity": {"type": "integer", "minimum": 1, "maximum": 9},
                                                          "size": {"enum": ["S", "M", "L"]}},
                         "required": ["item", "quantity", "size"], "additionalProperties": false}});
    let body = json!({"model": "qwen", "max_tokens": 128, "temperature": 0, "stream": true, "tools": [order],
                      "tool_choice": {"type": "tool", "name": "place_order"},
                      "messages": [{"role": "user", "content": "Hello there!"}]});
    let r = c.post(s.url("/v1/messages")).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let sse = r.text().await.unwrap();
    let events: Vec<Value> = sse.lines().filter_map(|l| l.strip_prefix("data: ")).map(|d| serde_json::from_str(d).unwrap()).collect();
    let start = events.iter().find(|e| e["type"] == "content_block_start").expect("a block");
    assert_eq!(start["content_block"]["type"], "tool_use", "{sse}");
    assert_eq!(start["content_block"]["name"], "place_order", "{sse}");
    let input: String = events.iter().filter(|e| e["delta"]["type"] == "input_json_delta").map(|e| e["delta"]["partial_json"].as_str().unwrap()).collect();
    let input: Value = serde_json::from_str(&input).unwrap_or_else(|e| panic!("{input}: {e}"));
    assert!(input["item"].as_str().is_some_and(|i| i.len() <= 30), "{input}");
    assert!(input["quantity"].as_i64().is_some_and(|q| (1..=9).contains(&q)), "{input}");
    assert!(["S", "M", "L"].contains(&input["size"].as_str().unwrap()), "{input}");
    let delta = events.iter().find(|e| e["type"] == "message_delta").unwrap();
    assert_eq!(delta["delta"]["stop_reason"], "tool_use", "{sse}");

    let auto = json!({"model": "qwen", "max_tokens": 40, "temperature": 0, "tools": [order],
                      "messages": [{"role": "user", "content": "Reply with one short sentence about the moon."}]});
    let v: Value = c.post(s.url("/v1/messages")).json(&auto).send().await.unwrap().json().await.unwrap();
    assert!(v["content"][0]["type"] == "text" && !v["content"][0]["text"].as_str().unwrap().is_empty(), "{v}");
    s.stop().await.unwrap();
}

/// The official SDKs, Python and TypeScript: 50 forced tool calls over five schema shapes
/// (nested objects, enums, arrays, required fields, numbers), streamed and not, and structured
/// outputs; every input and output validates (tests/clients/constrained_*).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_sdks_get_inputs_and_outputs_that_validate() {
    let _g = heavy();
    let root = repo_root();
    let venv = client_setup("scripts/client-venv");
    let node_dir = client_setup("scripts/client-node");
    let s = TestServer::qwen().await;
    let runs = [
        (format!("{venv}/bin/python"), root.join("tests/clients/constrained_test.py"), "def test_"),
        ("node".to_string(), root.join("tests/clients/constrained_test.mjs"), "  async "),
    ];
    for (program, script, marker) in runs {
        let env = [("ZEROLAYER_BASE_URL", s.base.as_str()), ("ZEROLAYER_CLIENTS_NODE", node_dir.as_str())];
        run_client_script(&program, &script, marker, &env, 3, Duration::from_secs(900)).await;
    }
    s.stop().await.unwrap();
}
