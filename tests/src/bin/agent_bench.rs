//! The cluster's KV as one cache, measured on a skewed agent workload: three nodes in one
//! process on loopback (real QUIC with mutual TLS, real model), 12 agent sessions sharing a
//! ~3,600-token system prompt, each with its own growing history (4 turns, each adding a
//! ~200-token tool result), 4 sessions in flight, while node c is kept busy by long generations
//! submitted straight to its worker. Each turn enters at the next node (a load balancer
//! without affinity), and the first session's first turn runs alone (the system prompt is
//! cached on one node before the others start). Run through `scripts/bench-agents` on an idle
//! machine.
//!
//! For each configuration, on a fresh cluster: `cache_aware` with remote prefix fetch, with fetch
//! and a disk tier per worker, without fetch, and `round_robin`, each with 448 MiB of KV per
//! worker; then fetch with and without the disk tier again with 320 MiB of KV (RAM pressure: a
//! session's prefix is evicted between its turns; `--tight-mb`, `--only tight`). For each: the cluster prefix-hit ratio
//! (prompt tokens read from cache over prompt tokens), the tokens that came by fetch and from
//! disk, time to first token p50/p99, and output tokens/s over the workload.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use zerolayer_common::{Job, PlacementPolicy, SamplingParams};
use zerolayer_tests::{metric_with, parse_sse, TestCluster, LOREM};

const SESSIONS: usize = 12;
const TURNS: usize = 4;
const IN_FLIGHT: usize = 4;

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(((v.len() as f64 - 1.0) * p).round() as usize).copied().unwrap_or(f64::NAN)
}

/// About 3,600 tokens of shared instructions.
fn system_prompt() -> String {
    let mut s = String::from("You are a careful coding agent working in a large repository. ");
    for i in 0..22 {
        s.push_str(&format!("Section {i} of the handbook. {LOREM} "));
    }
    s
}

/// A ~200-token tool result, its own for each session and turn.
fn tool_output(s: usize, k: usize) -> String {
    let words: Vec<&str> = LOREM.split(' ').collect();
    let start = (s * 31 + k * 17) % (words.len() / 2);
    format!("[session {s} log {k}] {} {}", words[start..].join(" "), words[..start].join(" "))
}

/// One measured turn.
struct Turn {
    ttft: f64,
    prompt: u64,
    cached: u64,
    output: u64,
    text: String,
}

/// A streamed Messages request: time to the first text delta, usage, and the text.
async fn turn(http: &reqwest::Client, url: &str, system: &str, history: &[(String, String)], question: &str) -> Turn {
    let mut messages = vec![];
    for (u, a) in history {
        messages.push(json!({"role": "user", "content": u}));
        messages.push(json!({"role": "assistant", "content": a}));
    }
    messages.push(json!({"role": "user", "content": question}));
    let body = json!({"model": "smollm2-135m-instruct", "max_tokens": 16, "temperature": 0, "stream": true, "messages": messages,
                      "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}]});
    let t = Instant::now();
    let mut r = http.post(url).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let (mut raw, mut ttft) = (String::new(), None);
    while let Some(c) = r.chunk().await.unwrap() {
        raw.push_str(&String::from_utf8_lossy(&c));
        if ttft.is_none() && raw.contains("content_block_delta") {
            ttft = Some(t.elapsed().as_secs_f64());
        }
    }
    let events = parse_sse(&raw);
    let start = events.iter().find(|(e, _)| e == "message_start").map(|(_, d)| d["message"]["usage"].clone()).unwrap_or_default();
    let n = |v: &Value, k: &str| v[k].as_u64().unwrap_or(0);
    let output = events.iter().filter(|(e, _)| e == "message_delta").map(|(_, d)| n(&d["usage"], "output_tokens")).last().unwrap_or(0);
    let text = events.iter().filter_map(|(_, d)| d["delta"]["text"].as_str()).collect();
    let prompt = n(&start, "input_tokens") + n(&start, "cache_read_input_tokens") + n(&start, "cache_creation_input_tokens");
    Turn { ttft: ttft.unwrap_or(f64::NAN), prompt, cached: n(&start, "cache_read_input_tokens"), output, text }
}

/// Keeps node c's worker busy with long generations until `stop`.
fn keep_busy(cluster: &TestCluster, stop: std::sync::Arc<std::sync::atomic::AtomicBool>) -> Vec<tokio::task::JoinHandle<()>> {
    let handle = cluster.nodes[2].frontend.cluster.local_worker("cpu0").unwrap().handle.clone();
    (0..2u32)
        .map(|i| {
            let (handle, stop) = (handle.clone(), stop.clone());
            tokio::spawn(async move {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(200) };
                    let Ok(mut s) = handle.submit(Job::new((1..400).map(|t| t * 7 + i).collect(), params)).await else { return };
                    while s.recv().await.is_some() {
                        if stop.load(std::sync::atomic::Ordering::Relaxed) {
                            return;
                        }
                    }
                }
            })
        })
        .collect()
}

async fn fetched_tokens(cluster: &TestCluster) -> f64 {
    let page = reqwest::get(cluster.nodes[0].url("/metrics")).await.unwrap().text().await.unwrap();
    ["a", "b", "c"].iter().map(|n| metric_with(&page, "zerolayer_kv_fetched_tokens_total", &[("node", n)]).unwrap_or(0.0)).sum()
}

/// Prompt tokens read back from the workers' disk tiers.
/// (Each node's `/metrics` shows its own workers' signals.)
async fn restored_tokens(cluster: &TestCluster) -> f64 {
    let mut blocks = 0.0;
    for n in &cluster.nodes {
        let page = reqwest::get(n.url("/metrics")).await.unwrap().text().await.unwrap();
        blocks += metric_with(&page, "zerolayer_kv_disk_blocks_restored_total", &[("node", &n.id)]).unwrap_or(0.0);
    }
    4.0 * blocks
}

/// One configuration: placement `policy`, remote `fetch` on or off, `kv_mb` of RAM cache per
/// worker and a 1 GiB disk tier under it if `disk`.
struct Setup {
    name: &'static str,
    policy: PlacementPolicy,
    fetch: bool,
    disk: bool,
    kv_mb: usize,
}

async fn run(setup: &Setup, threads: usize) -> Value {
    let disk_dir = zerolayer_tests::temp_dir("bench-kv-disk");
    let cluster = TestCluster::start(3, |c| {
        c.placement.policy = setup.policy;
        c.placement.fetch = setup.fetch;
        for n in &mut c.nodes {
            n.workers[0].threads = threads;
            n.workers[0].kv_cache_mb = setup.kv_mb;
            if setup.disk {
                n.workers[0].kv_disk_mb = 1024;
                n.workers[0].kv_disk_dir = Some(disk_dir.clone());
            }
        }
    })
    .await;
    let name = setup.name;
    cluster.wait_converged(&[0, 1, 2], Duration::from_secs(15)).await;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let busy = keep_busy(&cluster, stop.clone());
    let fetched_before = fetched_tokens(&cluster).await;
    let system = std::sync::Arc::new(system_prompt());
    let urls: Vec<String> = cluster.nodes.iter().map(|n| n.url("/v1/messages")).collect();
    let t = Instant::now();
    let mut clients = vec![];
    let (first_tx, first_rx) = tokio::sync::watch::channel(false);
    for c in 0..IN_FLIGHT {
        let (system, urls, mut first_rx, first_tx) = (system.clone(), urls.clone(), first_rx.clone(), first_tx.clone());
        clients.push(tokio::spawn(async move {
            let http = reqwest::Client::new();
            let mut turns = vec![];
            if c > 0 {
                let _ = first_rx.wait_for(|done| *done).await;
            }
            for s in (c..SESSIONS).step_by(IN_FLIGHT) {
                let mut history: Vec<(String, String)> = vec![];
                for k in 0..TURNS {
                    let question = format!("Session {s}, turn {k}. The tool printed: {}\nWhich file should change next, and why?", tool_output(s, k));
                    let url = &urls[(s + k) % urls.len()];
                    let r = turn(&http, url, &system, &history, &question).await;
                    let _ = first_tx.send(true);
                    history.push((question, r.text.clone()));
                    turns.push(r);
                }
            }
            turns
        }));
    }
    let mut turns = vec![];
    for c in clients {
        turns.extend(c.await.unwrap());
    }
    let secs = t.elapsed().as_secs_f64();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for b in busy {
        let _ = tokio::time::timeout(Duration::from_secs(30), b).await;
    }
    let prompt: u64 = turns.iter().map(|t| t.prompt).sum();
    let cached: u64 = turns.iter().map(|t| t.cached).sum();
    let output: u64 = turns.iter().map(|t| t.output).sum();
    let mut ttft: Vec<f64> = turns.iter().map(|t| t.ttft).collect();
    let r = json!({
        "config": name, "requests": turns.len(), "secs": secs,
        "hit_ratio": cached as f64 / prompt as f64, "prompt_tokens": prompt, "cached_tokens": cached,
        "fetched_tokens": fetched_tokens(&cluster).await - fetched_before,
        "restored_tokens": restored_tokens(&cluster).await, "kv_mb": setup.kv_mb,
        "ttft_p50_s": pct(&mut ttft, 0.5), "ttft_p99_s": pct(&mut ttft, 0.99),
        "output_tokens_per_s": output as f64 / secs,
    });
    eprintln!("{r}");
    let _ = std::fs::remove_dir_all(&disk_dir);
    r
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let json_out = args.iter().position(|a| a == "--json").map(|i| args[i + 1].clone());
    let threads: usize = args.iter().position(|a| a == "--threads").map(|i| args[i + 1].parse().unwrap()).unwrap_or(1);
    let mut runs = vec![];
    // `--tight-mb N`: the RAM cache of the last two runs (320); `--only tight`: only those two.
    let tight: usize = args.iter().position(|a| a == "--tight-mb").map(|i| args[i + 1].parse().unwrap()).unwrap_or(320);
    let only_tight = args.windows(2).any(|w| w[0] == "--only" && w[1] == "tight");
    let ca = PlacementPolicy::CacheAware;
    let setups = [
        Setup { name: "cache_aware + fetch", policy: ca, fetch: true, disk: false, kv_mb: 448 },
        Setup { name: "cache_aware + fetch + disk", policy: ca, fetch: true, disk: true, kv_mb: 448 },
        Setup { name: "cache_aware, no fetch", policy: ca, fetch: false, disk: false, kv_mb: 448 },
        Setup { name: "round_robin", policy: PlacementPolicy::RoundRobin, fetch: false, disk: false, kv_mb: 448 },
        Setup { name: "cache_aware + fetch", policy: ca, fetch: true, disk: false, kv_mb: tight },
        Setup { name: "cache_aware + fetch + disk", policy: ca, fetch: true, disk: true, kv_mb: tight },
    ];
    for setup in setups.iter().filter(|s| !only_tight || s.kv_mb == tight) {
        runs.push(run(setup, threads).await);
    }
    println!("| placement | KV RAM (MiB) | cluster hit ratio | tokens fetched | tokens from disk | TTFT p50 / p99 (s) | output tok/s | wall (s) |");
    println!("|---|---|---|---|---|---|---|---|");
    for r in &runs {
        let f = |k: &str| r[k].as_f64().unwrap();
        println!(
            "| {} | {} | {:.3} | {} | {} | {:.2} / {:.2} | {:.2} | {:.0} |",
            r["config"].as_str().unwrap(),
            f("kv_mb"),
            f("hit_ratio"),
            f("fetched_tokens"),
            f("restored_tokens"),
            f("ttft_p50_s"),
            f("ttft_p99_s"),
            f("output_tokens_per_s"),
            f("secs")
        );
    }
    if let Some(p) = json_out {
        std::fs::write(p, serde_json::to_string_pretty(&json!({"threads_per_worker": threads, "runs": runs})).unwrap()).unwrap();
    }
}
