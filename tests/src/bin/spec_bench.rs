//! Speculative decoding against plain decoding, on the engine (no HTTP), in one run.
//!
//! `cargo run -p zerolayer-tests --bin spec_bench -- [--model qwen|smollm2] [--threads N] [--rounds N]`
//!
//! Three workloads, each run with `speculative = "ngram"` and `"off"` alternately, `--rounds`
//! times (default 3), reporting the median decode tokens/s of each and their ratio:
//! - `code-edit`: batch 1, rewrite a 45-line Python file with one identifier renamed (greedy);
//! - `prose`: batch 1, a short story (greedy);
//! - `prose16`: 16 streams of prose at once (aggregate).
//!
//! Decode time runs from each sequence's first token to its end (so prefill is not counted).
//! The two engines' outputs must be identical, or the run panics. Run it on an idle machine.

use std::collections::HashMap;
use std::time::Instant;

use zerolayer_common::config::Speculative;
use zerolayer_common::{Job, SamplingParams, SeqEvent, WorkerConfig};
use zerolayer_worker::chat::{ChatMessage, ChatTemplate};
use zerolayer_worker::engine::Engine;
use zerolayer_worker::loader::load;
use zerolayer_tests::{engine_cfg, model_path, qwen_model_path};

/// 45 lines; the edit renames `records` to `entries`.
const FILE: &str = r#"import json
from dataclasses import dataclass


@dataclass
class Record:
    name: str
    amount: float
    tags: list


def load(path):
    with open(path) as f:
        records = [Record(**r) for r in json.load(f)]
    return records


def total(records):
    return sum(r.amount for r in records)


def by_tag(records, tag):
    return [r for r in records if tag in r.tags]


def largest(records, n=3):
    ordered = sorted(records, key=lambda r: r.amount, reverse=True)
    return ordered[:n]


def summary(records):
    lines = []
    lines.append(f"count: {len(records)}")
    lines.append(f"total: {total(records):.2f}")
    for r in largest(records):
        lines.append(f"  {r.name}: {r.amount:.2f}")
    return "\n".join(lines)


def main(path):
    records = load(path)
    print(summary(records))
    for tag in ("food", "travel"):
        print(tag, total(by_tag(records, tag)))
"#;

fn render(t: &ChatTemplate, e: &Engine, text: &str) -> Vec<u32> {
    e.tokenizer.encode(&t.render_for_generation(&[ChatMessage::new("user", text)]).unwrap()).unwrap()
}

/// Runs `prompts` at once, greedy; returns the tokens decoded once every sequence had its
/// first, the seconds they took, and the outputs.
fn run(e: &mut Engine, prompts: &[Vec<u32>], max_tokens: u32) -> (usize, f64, HashMap<u64, Vec<u32>>) {
    for (i, p) in prompts.iter().enumerate() {
        e.add(i as u64, Job::new(p.clone(), SamplingParams::greedy(max_tokens))).unwrap();
    }
    let (mut first, mut out, mut total) = (None, HashMap::<u64, Vec<u32>>::new(), 0);
    while e.has_work() {
        for (id, ev) in e.step().unwrap().events {
            if let SeqEvent::Delta { tokens, .. } = ev {
                total += tokens.len();
                out.entry(id).or_default().extend(tokens);
            }
        }
        if first.is_none() && out.len() == prompts.len() {
            first = Some((Instant::now(), total));
        }
    }
    let (t, base) = first.expect("every sequence decoded");
    (total - base, t.elapsed().as_secs_f64(), out)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let get = |k: &str| args.iter().position(|a| a == k).and_then(|i| args.get(i + 1)).cloned();
    let threads: usize = get("--threads").map_or(2, |v| v.parse().unwrap());
    let rounds: usize = get("--rounds").map_or(3, |v| v.parse().unwrap());
    let path = match get("--model").as_deref() {
        None | Some("qwen") => qwen_model_path(),
        Some("smollm2") => model_path(),
        Some(m) => panic!("--model {m:?}: qwen or smollm2"),
    };
    let cfg = WorkerConfig { kv_cache_mb: 1024, ..engine_cfg() };
    let make = |speculative| {
        let l = load(&path, None, threads, |_, _| {}).unwrap();
        (Engine::new(l.model, l.tokenizer, &WorkerConfig { speculative, ..cfg.clone() }).unwrap(), l.template)
    };
    let (mut on, template) = make(Speculative::Ngram);
    let (mut off, _) = make(Speculative::Off);
    let edit = vec![render(&template, &on, &format!("Rename `records` to `entries` everywhere in this file. Reply with the whole file and nothing else.\n\n```python\n{FILE}```"))];
    let topics = ["a lighthouse keeper", "a lost cat", "the first snow", "a night train", "an old map", "a quiet library", "a storm at sea", "a garden robot"];
    let prose: Vec<Vec<u32>> = (0..16).map(|i| render(&template, &on, &format!("Write a short story about {} (version {i}).", topics[i % 8]))).collect();
    let workloads: [(&str, Vec<Vec<u32>>, u32); 3] = [("code-edit", edit, 700), ("prose", prose[..1].to_vec(), 256), ("prose16", prose, 128)];
    println!("{:<10} {:>12} {:>12} {:>7} {:>10}", "workload", "ngram tok/s", "off tok/s", "ratio", "accepted");
    for (name, prompts, max_tokens) in workloads {
        let (mut with, mut without) = (vec![], vec![]);
        let (d0, a0) = (on.signals().draft_tokens_total, on.signals().draft_accepted_total);
        for r in 0..rounds {
            let (n1, s1, o1) = run(&mut on, &prompts, max_tokens);
            let (n2, s2, o2) = run(&mut off, &prompts, max_tokens);
            assert_eq!(o1, o2, "{name}: speculation changed the output");
            eprintln!("{name} round {r}: ngram {n1} tokens in {s1:.2} s, off {n2} tokens in {s2:.2} s");
            with.push(n1 as f64 / s1);
            without.push(n2 as f64 / s2);
        }
        let sig = on.signals();
        let acc = (sig.draft_accepted_total - a0) as f64 / (sig.draft_tokens_total - d0).max(1) as f64;
        let (a, b) = (median(with), median(without));
        println!("{name:<10} {a:>12.1} {b:>12.1} {:>6.2}x {:>9.1}%", a / b, 100.0 * acc);
    }
}
