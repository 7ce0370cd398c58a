//! Speculative decoding is lossless: with prompt-lookup drafts verified in the step's batch,
//! every sequence gives exactly the tokens plain decoding gives, greedy and seeded, alone and in
//! a batch of 8, under a grammar, and across a move between a speculating worker and one that
//! does not; on both models. Each comparison runs the same jobs on an engine with
//! `speculative = "off"` and one with `"ngram"`, and the speculating one must have kept some
//! drafts (or the comparison proves nothing).

use std::collections::HashMap;

use zerolayer_common::config::Speculative;
use zerolayer_common::{Job, SamplingParams, SeqEvent, WorkerConfig};
use zerolayer_worker::chat::{ChatMessage, ChatTemplate};
use zerolayer_worker::engine::Engine;
use zerolayer_worker::loader::load;
use zerolayer_tests::*;

/// Code to copy with a change: what prompt lookup drafts from.
const CODE: &str = "def total_price(items, tax_rate):\n    subtotal = 0\n    for item in items:\n        subtotal += item.price * item.quantity\n    tax = subtotal * tax_rate\n    return subtotal + tax\n\n\ndef count_items(items):\n    count = 0\n    for item in items:\n        count += item.quantity\n    return count\n";

const GRAMMAR: &str = r#"start: %json {"type": "object", "properties": {"name": {"type": "string"}, "lines": {"type": "integer"}}, "required": ["name", "lines"], "additionalProperties": false}"#;

fn asks() -> Vec<String> {
    vec![
        format!("Rewrite this Python code, renaming `items` to `products` everywhere. Reply with the code only.\n\n{CODE}"),
        format!("Repeat this code exactly, then explain it in one sentence.\n\n{CODE}"),
        "Write a short story about a lighthouse keeper.".into(),
        format!("Add a docstring to each function:\n\n{CODE}"),
    ]
}

fn render(template: &ChatTemplate, engine: &Engine, text: &str) -> Vec<u32> {
    let p = template.render_for_generation(&[ChatMessage::new("user", text)]).unwrap();
    engine.tokenizer.encode(&p).unwrap()
}

/// Greedy, and seeded sampling (temperature 0.8, top-p 0.95).
fn params(i: usize, max_tokens: u32) -> SamplingParams {
    if i % 2 == 0 {
        SamplingParams::greedy(max_tokens)
    } else {
        SamplingParams { temperature: 0.8, top_p: Some(0.95), seed: Some(1000 + i as u64), max_tokens, ..Default::default() }
    }
}

struct Pair {
    off: Engine,
    on: Engine,
}

fn pair(path: &std::path::Path, cfg: WorkerConfig) -> (Pair, std::sync::Arc<ChatTemplate>) {
    let make = |speculative| {
        let l = load(path, None, 2, |_, _| {}).expect("load the model");
        let e = Engine::new(l.model, l.tokenizer, &WorkerConfig { speculative, ..cfg.clone() }).unwrap();
        (e, l.template)
    };
    let (off, template) = make(Speculative::Off);
    let (on, _) = make(Speculative::Ngram);
    (Pair { off, on }, template)
}

/// Runs `jobs` on `engine`, one at a time (`alone`) or all at once.
fn run(engine: &mut Engine, jobs: &[(u64, Job)], alone: bool) -> HashMap<u64, Vec<u32>> {
    let mut out = HashMap::new();
    for (id, job) in jobs {
        engine.add(*id, job.clone()).unwrap();
        if alone {
            out.extend(run_all(engine).into_iter().map(|(id, (t, _, _))| (id, t)));
        }
    }
    out.extend(run_all(engine).into_iter().map(|(id, (t, _, _))| (id, t)));
    out
}

fn lossless_on(path: &std::path::Path, max_tokens: u32) {
    let cfg = WorkerConfig { max_batch_tokens: 256, ..engine_cfg() };
    let (mut p, template) = pair(path, cfg);
    let prompts: Vec<Vec<u32>> = asks().iter().map(|a| render(&template, &p.off, a)).collect();
    // 8 jobs: each prompt greedy and seeded.
    let jobs: Vec<(u64, Job)> = (0..8).map(|i| (i as u64, Job::new(prompts[i / 2].clone(), params(i, max_tokens)))).collect();
    let plain = run(&mut p.off, &jobs, true);
    assert_eq!(p.off.signals().draft_tokens_total, 0, "speculative = off drafts nothing");
    let alone = run(&mut p.on, &jobs, true);
    for (id, _) in &jobs {
        assert_eq!(alone[id], plain[id], "job {id} alone: speculation changed the tokens ({:?} vs {:?})", p.on.tokenizer.decode(&alone[id]), p.off.tokenizer.decode(&plain[id]));
    }
    let sig = p.on.signals();
    eprintln!("alone: {} draft tokens, {} kept, {} generated", sig.draft_tokens_total, sig.draft_accepted_total, sig.generated_tokens_total);
    assert!(sig.draft_accepted_total > 0, "drafts were kept, so verification ran: {sig:?}");
    assert!(sig.draft_accepted_total < sig.draft_tokens_total, "some drafts were rejected, so rejection ran: {sig:?}");
    let batched: Vec<(u64, Job)> = jobs.iter().map(|(id, j)| (100 + id, j.clone())).collect();
    let together = run(&mut p.on, &batched, false);
    for (id, _) in &jobs {
        assert_eq!(together[&(100 + id)], plain[id], "job {id} in a batch of 8: speculation changed the tokens");
    }
    let after = p.on.signals();
    assert!(after.draft_accepted_total > sig.draft_accepted_total, "the batch of 8 speculated too: {after:?}");

    // Moved mid-stream both ways: from a speculating engine to a plain one (the longest seeded
    // job), and back (the longest greedy one).
    let longest = |odd: u64| (0..8u64).filter(|i| i % 2 == odd).max_by_key(|i| plain[i].len()).unwrap();
    for (from_on, id) in [(true, longest(1)), (false, longest(0))] {
        let (from, to) = if from_on { (&mut p.on, &mut p.off) } else { (&mut p.off, &mut p.on) };
        let job = jobs[id as usize].1.clone();
        assert!(plain[&id].len() > 24, "job {id} is long enough to move: {}", plain[&id].len());
        from.add(50 + id, job.clone()).unwrap();
        let mut sent = 0;
        while sent < 12 {
            assert!(from.has_work(), "job {id} ended after {sent} tokens");
            for (_, ev) in from.step().unwrap().events {
                if let SeqEvent::Delta { tokens, .. } = ev {
                    sent += tokens.len();
                }
            }
        }
        let moved = from.export(50 + id).expect("exported");
        assert!(moved.generated.len() >= 12 && moved.generated.len() < plain[&id].len());
        to.add(50 + id, Job::new(moved.prompt.clone(), SamplingParams { seed: Some(moved.seed), ..job.params.clone() }).resuming(moved.generated.clone())).unwrap();
        let mut whole = moved.generated.clone();
        whole.extend(&run_all(to)[&(50 + id)].0);
        assert_eq!(whole, plain[&id], "job {id} moved (from the speculating engine: {from_on}) continues with the same tokens");
    }

    // Under a grammar (sampled, so the grammar decides what is valid): valid and identical.
    let constrained = SamplingParams { temperature: 1.0, seed: Some(7), max_tokens: 64, grammar: Some(GRAMMAR.into()), ..Default::default() };
    let ask = render(&template, &p.off, "Describe the code above as JSON.");
    let job = Job::new([prompts[0].clone(), ask].concat(), constrained);
    p.off.add(900, job.clone()).unwrap();
    p.on.add(900, job).unwrap();
    let (off, on) = (run_all(&mut p.off).remove(&900).unwrap(), run_all(&mut p.on).remove(&900).unwrap());
    let v: serde_json::Value = serde_json::from_str(&on.1).unwrap_or_else(|e| panic!("{:?} is not JSON: {e}", on.1));
    assert!(v["name"].is_string() && v["lines"].is_i64(), "{}", on.1);
    assert_eq!(on.0, off.0, "the constrained sequence is identical with speculation");
}

#[test]
fn speculation_is_lossless_on_smollm2() {
    let _g = heavy();
    lossless_on(&model_path(), 96);
}

#[test]
fn speculation_is_lossless_on_qwen() {
    let _g = heavy();
    lossless_on(&qwen_model_path(), 64);
}
