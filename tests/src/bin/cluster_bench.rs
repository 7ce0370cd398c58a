//! Three-node cluster benchmark, in one process on loopback (real QUIC with mutual TLS, real
//! model): placement policies compared on a shared-prefix workload, and the latency one QUIC hop
//! adds over a local placement. Run through `scripts/bench-cluster` on an idle machine.
//!
//! For each policy (`cache_aware`, `least_loaded`, `round_robin`), on a fresh cluster:
//! - **prefix**: 24 requests over 8 distinct ~620-token documents, sent one at a time, round-robin
//!   over the three HTTP ports (the integration test's workload) → cluster prefix-hit ratio;
//! - **throughput**: 48 requests over 8 documents (6 each, shuffled), 6 in flight, 32 output
//!   tokens each → aggregate output tokens/s, requests/s, latency p50/p99, prefix-hit ratio.
//!
//! Hop latency: on a `round_robin` cluster, 90 sequential short streaming requests to node a
//! (whose placement rotates over a, b, c), split by where they ran: time to first token and
//! total time, p50/p99, local vs remote.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use zerolayer_common::PlacementPolicy;
use zerolayer_tests::{ask, document, shuffled, Answer, TestCluster};

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

fn hit_ratio(d: &[Answer]) -> f64 {
    let input: u64 = d.iter().map(|d| d.input_tokens + d.cached_tokens).sum();
    d.iter().map(|d| d.cached_tokens).sum::<u64>() as f64 / input as f64
}

async fn policy_run(policy: PlacementPolicy, threads: usize) -> Value {
    let cluster = TestCluster::start(3, |c| {
        c.placement.policy = policy;
        for n in &mut c.nodes {
            n.workers[0].threads = threads;
        }
    })
    .await;
    cluster.wait_converged(&[0, 1, 2], Duration::from_secs(15)).await;
    let http = reqwest::Client::new();
    let tag = format!("{policy:?}");

    // Prefix workload: sequential, the test's order.
    let mut seq = Vec::new();
    let mut k = 0;
    let t = Instant::now();
    for round in 0..3 {
        for p in shuffled(8, 0x9e37_79b9 + round as u64) {
            let url = cluster.nodes[k % 3].url("/v1/messages");
            k += 1;
            seq.push(ask(&http, &url, &format!("{}\n\nQuestion {round}: what is this document about?", document(p, &tag)), 2).await);
        }
        cluster.wait_index_synced(&[0, 1, 2], Duration::from_secs(10)).await;
    }
    let seq_secs = t.elapsed().as_secs_f64();

    // Throughput workload: 6 in flight, fresh documents.
    let order: Vec<usize> = (0..48).map(|i| i % 8).collect::<Vec<_>>();
    let perm = shuffled(48, 0x5eed);
    let jobs: Vec<(String, String, String)> = perm
        .iter()
        .enumerate()
        .map(|(k, &i)| (cluster.nodes[k % 3].id.clone(), cluster.nodes[k % 3].url("/v1/messages"), format!("{}\n\nQuestion {k}: list three facts from it.", document(order[i], &format!("{tag}-tp")))))
        .collect();
    let jobs = std::sync::Arc::new(std::sync::Mutex::new(jobs.into_iter()));
    let t = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..6 {
        let jobs = jobs.clone();
        let http = http.clone();
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            loop {
                let next = jobs.lock().unwrap().next();
                let Some((node, url, text)) = next else { break };
                let d = ask(&http, &url, &text, 32).await;
                out.push((node, d));
            }
            out
        }));
    }
    let mut tp = Vec::new();
    let mut forwarded = 0;
    for t in tasks {
        for (node, d) in t.await.unwrap() {
            if !d.served_by.starts_with(&format!("{node}/")) {
                forwarded += 1;
            }
            tp.push(d);
        }
    }
    let tp_secs = t.elapsed().as_secs_f64();
    let out_tokens: u64 = tp.iter().map(|d| d.output_tokens).sum();
    let mut lat: Vec<f64> = tp.iter().map(|d| d.secs).collect();
    let r = json!({
        "policy": policy,
        "prefix_hit_ratio_sequential": hit_ratio(&seq),
        "sequential_secs": seq_secs,
        "prefix_hit_ratio_concurrent": hit_ratio(&tp),
        "requests": tp.len(),
        "output_tokens_per_s": out_tokens as f64 / tp_secs,
        "requests_per_s": tp.len() as f64 / tp_secs,
        "latency_p50_s": pct(&mut lat, 0.5),
        "latency_p99_s": pct(&mut lat, 0.99),
        "forwarded_fraction": forwarded as f64 / tp.len() as f64,
    });
    eprintln!("{r}");
    r
}

async fn hop_latency(threads: usize) -> Value {
    let cluster = TestCluster::start(3, |c| {
        c.placement.policy = PlacementPolicy::RoundRobin;
        for n in &mut c.nodes {
            n.workers[0].threads = threads;
        }
    })
    .await;
    cluster.wait_converged(&[0, 1, 2], Duration::from_secs(15)).await;
    let http = reqwest::Client::new();
    let url = cluster.nodes[0].url("/v1/messages");
    let body = json!({"model": "smollm2-135m-instruct", "max_tokens": 8, "temperature": 0, "stream": true,
                      "messages": [{"role": "user", "content": "Name a colour."}]});
    let (mut lt, mut lf, mut rt, mut rf) = (vec![], vec![], vec![], vec![]);
    for i in 0..93 {
        let t = Instant::now();
        let mut r = http.post(&url).json(&body).send().await.unwrap();
        let by = r.headers()["zerolayer-worker"].to_str().unwrap().to_string();
        let mut text = String::new();
        let mut ttft = None;
        while let Some(c) = r.chunk().await.unwrap() {
            text.push_str(&String::from_utf8_lossy(&c));
            if ttft.is_none() && text.contains("content_block_delta") {
                ttft = Some(t.elapsed().as_secs_f64() * 1e3);
            }
        }
        let total = t.elapsed().as_secs_f64() * 1e3;
        if i < 3 {
            continue; // warm-up: each worker caches the prompt once
        }
        let ttft = ttft.expect("a delta");
        if by.starts_with("a/") {
            lt.push(ttft);
            lf.push(total);
        } else {
            rt.push(ttft);
            rf.push(total);
        }
    }
    let r = json!({
        "local_requests": lt.len(), "remote_requests": rt.len(),
        "ttft_ms_p50_local": pct(&mut lt.clone(), 0.5), "ttft_ms_p99_local": pct(&mut lt.clone(), 0.99),
        "ttft_ms_p50_remote": pct(&mut rt.clone(), 0.5), "ttft_ms_p99_remote": pct(&mut rt.clone(), 0.99),
        "total_ms_p50_local": pct(&mut lf.clone(), 0.5), "total_ms_p99_local": pct(&mut lf.clone(), 0.99),
        "total_ms_p50_remote": pct(&mut rf.clone(), 0.5), "total_ms_p99_remote": pct(&mut rf.clone(), 0.99),
    });
    eprintln!("{r}");
    r
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let json_out = args.iter().position(|a| a == "--json").map(|i| args[i + 1].clone());
    let threads: usize = args.iter().position(|a| a == "--threads").map(|i| args[i + 1].parse().unwrap()).unwrap_or(1);
    let mut policies = Vec::new();
    for p in [PlacementPolicy::CacheAware, PlacementPolicy::LeastLoaded, PlacementPolicy::RoundRobin] {
        policies.push(policy_run(p, threads).await);
    }
    let hop = hop_latency(threads).await;
    println!("| policy | prefix-hit ratio (24 sequential) | prefix-hit ratio (48 concurrent) | output tok/s | requests/s | latency p50 / p99 (s) |");
    println!("|---|---|---|---|---|---|");
    for p in &policies {
        println!(
            "| {} | {:.3} | {:.3} | {:.1} | {:.2} | {:.2} / {:.2} |",
            p["policy"].as_str().unwrap(),
            p["prefix_hit_ratio_sequential"].as_f64().unwrap(),
            p["prefix_hit_ratio_concurrent"].as_f64().unwrap(),
            p["output_tokens_per_s"].as_f64().unwrap(),
            p["requests_per_s"].as_f64().unwrap(),
            p["latency_p50_s"].as_f64().unwrap(),
            p["latency_p99_s"].as_f64().unwrap()
        );
    }
    let f = |k: &str| hop[k].as_f64().unwrap();
    println!();
    println!("| placement | requests | TTFT p50 / p99 (ms) | total p50 / p99 (ms) |");
    println!("|---|---|---|---|");
    println!("| local | {} | {:.1} / {:.1} | {:.1} / {:.1} |", hop["local_requests"], f("ttft_ms_p50_local"), f("ttft_ms_p99_local"), f("total_ms_p50_local"), f("total_ms_p99_local"));
    println!("| remote (one QUIC hop) | {} | {:.1} / {:.1} | {:.1} / {:.1} |", hop["remote_requests"], f("ttft_ms_p50_remote"), f("ttft_ms_p99_remote"), f("total_ms_p50_remote"), f("total_ms_p99_remote"));
    println!(
        "| hop adds | | {:+.1} / {:+.1} | {:+.1} / {:+.1} |",
        f("ttft_ms_p50_remote") - f("ttft_ms_p50_local"),
        f("ttft_ms_p99_remote") - f("ttft_ms_p99_local"),
        f("total_ms_p50_remote") - f("total_ms_p50_local"),
        f("total_ms_p99_remote") - f("total_ms_p99_local")
    );
    if let Some(p) = json_out {
        std::fs::write(p, serde_json::to_string_pretty(&json!({"threads_per_worker": threads, "policies": policies, "hop": hop})).unwrap()).unwrap();
    }
}
