//! What constrained decoding costs per token: the time to compute one sequence's mask of
//! allowed tokens and advance its parser, over the Qwen2.5 vocabulary (151k tokens), for the
//! grammars the coordinator writes. Each grammar is fed a fixed text it allows, token by token.
//!
//! `cargo run --release -p zerolayer-tests --bin grammar_bench [-- MODEL.gguf]`

use std::time::Instant;

use serde_json::json;
use zerolayer_coordinator::frontend::constrain::{grammar, Shape};
use zerolayer_coordinator::frontend::tools::{Tool, ToolChoice};
use zerolayer_worker::grammar::Constraint;

fn main() {
    let path = std::env::args().nth(1).map(std::path::PathBuf::from).unwrap_or_else(zerolayer_tests::qwen_model_path);
    let (tok, _, _) = zerolayer_worker::loader::load_frontend(&path).expect("model front end");
    let t0 = Instant::now();
    let grammars = tok.grammars().expect("grammar compiler");
    println!("grammar compiler for {} tokens built in {:.0} ms", tok.vocab_size(), t0.elapsed().as_secs_f64() * 1e3);

    let tools: Vec<Tool> = (0..24)
        .map(|i| Tool {
            name: format!("tool_{i}"),
            description: Some(format!("Tool number {i}")),
            parameters: json!({"type": "object", "properties": {"path": {"type": "string"}, "count": {"type": "integer"}, "mode": {"enum": ["a", "b"]}}, "required": ["path"]}),
            deferred: false,
        })
        .collect();
    let schema = json!({"type": "object", "properties": {"title": {"type": "string"}, "items": {"type": "array", "items": {"type": "string"}}, "n": {"type": "integer"}}, "required": ["title", "items", "n"]});
    let story = "Once upon a time, a knight rode out to find the dragon that had burned the village. ".repeat(6);
    let call = "<tool_call>\n{\"name\": \"tool_7\", \"arguments\": {\"path\": \"src/main.rs\", \"count\": 3, \"mode\": \"b\"}}\n</tool_call>";
    let json_text = "{\"title\": \"Groceries\", \"items\": [\"milk\", \"eggs\", \"flour\", \"butter\", \"sugar\"], \"n\": 5}";
    let cases = [
        ("auto, 24 tools: free text", Shape { tools: &tools, choice: &ToolChoice::Auto, format: None, parallel: true }, story.as_str()),
        ("auto, 24 tools: a call", Shape { tools: &tools, choice: &ToolChoice::Auto, format: None, parallel: true }, call),
        ("forced tool (any of 24)", Shape { tools: &tools, choice: &ToolChoice::Any, format: None, parallel: false }, call),
        ("structured output (json_schema)", Shape { tools: &[], choice: &ToolChoice::Auto, format: Some(&schema), parallel: false }, json_text),
    ];
    println!("| grammar | tokens | compile ms | from the compiled cache ms | mask+commit µs/token mean | p99 | max |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for (name, shape, text) in cases {
        let lark = grammar(shape).unwrap().unwrap();
        let ids = tok.encode_text(text).unwrap();
        let mut times = Vec::new();
        let (mut compile_ms, mut copy_ms) = (0.0, 0.0);
        for round in 0..3 {
            let t = Instant::now();
            let mut c = Constraint::new(grammars.clone(), &lark, &[]).expect("compiles");
            let ms = t.elapsed().as_secs_f64() * 1e3;
            if round == 0 {
                compile_ms = ms;
            } else {
                copy_ms = ms;
            }
            for &id in &ids {
                let t = Instant::now();
                let mask = c.allowed().expect("a mask");
                assert!(zerolayer_worker::grammar::allows(mask, id), "{name}: token {id} not allowed");
                c.commit(id).expect("commit");
                if round > 0 {
                    times.push(t.elapsed().as_secs_f64() * 1e6);
                }
            }
        }
        times.sort_by(f64::total_cmp);
        let mean = times.iter().sum::<f64>() / times.len() as f64;
        let p99 = times[(times.len() * 99 / 100).min(times.len() - 1)];
        println!("| {name} | {} | {compile_ms:.1} | {copy_ms:.2} | {mean:.0} | {p99:.0} | {:.0} |", ids.len(), times[times.len() - 1]);
    }
}
