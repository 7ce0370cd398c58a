//! The HTTP benchmark harness: streams OpenAI chat completions (or, for a base model, legacy
//! completions of the raw prompt) at a live server, level by level
//! (prompt kind × concurrency), and reports time to first token, inter-token latency, aggregate
//! output tokens/s and requests/s, plus the worker's KV fragmentation sampled during the level.
//!
//! Bounded: each level runs a fixed number of requests and starts none after its time limit;
//! requests in flight then finish (each is bounded by `output_tokens`). It only talks to the URL
//! it is given (`scripts/bench` starts a server on loopback).
//!
//! Requests use `ignore_eos` (vLLM's extension) so every request generates exactly
//! `output_tokens`, and each prompt starts with its own request number, so the prefix cache only
//! shares the chat template's header.

use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::{json, Value};

use crate::LOREM;

/// Which OpenAI endpoint the requests go to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    /// `/v1/chat/completions`: the prompt as a user message, through the chat template.
    Chat,
    /// `/v1/completions`: the prompt as it is (a base model, which has no chat template).
    Completions,
}

/// One level of the sweep.
#[derive(Clone, Debug)]
pub struct Level {
    /// The model the requests name.
    pub model: String,
    pub api: Api,
    /// `short` (~100 prompt tokens) or `long` (~1,500).
    pub prompt: String,
    pub concurrency: usize,
    pub requests: usize,
    pub output_tokens: u32,
    pub time_limit: Duration,
}

/// What one level measured.
#[derive(Clone, Debug, Serialize)]
pub struct LevelResult {
    pub prompt: String,
    pub concurrency: usize,
    pub requests_ok: usize,
    pub requests_failed: usize,
    pub prompt_tokens_mean: f64,
    pub output_tokens: u64,
    pub wall_s: f64,
    pub output_tokens_per_s: f64,
    pub requests_per_s: f64,
    pub ttft_ms_p50: f64,
    pub ttft_ms_p99: f64,
    pub itl_ms_p50: f64,
    pub itl_ms_p99: f64,
    /// Per-stream decode rate: 1000 ÷ mean inter-token latency.
    pub decode_tokens_per_s_per_stream: f64,
    /// Aggregate decode tokens/s while the first `concurrency` requests all decode together:
    /// tokens streamed between the last of them getting its first token and the first of them
    /// finishing, ÷ that window. No prefill runs in it (the next requests start only when one
    /// finishes), so it is the like-for-like figure for a batched-decode benchmark. None when
    /// the window is empty.
    pub steady_decode_tokens_per_s: Option<f64>,
    pub e2e_s_p50: f64,
    pub e2e_s_p99: f64,
    /// Mean and max `kv_fragmentation_ratio` over samples taken while `concurrency` sequences
    /// were running (the steady state), from `/admin/status`. None if never sampled there.
    pub kv_fragmentation_mean: Option<f64>,
    pub kv_fragmentation_max: Option<f64>,
}

pub fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    s[((s.len() as f64 - 1.0) * p).round() as usize]
}

/// The prompt of request `i`: ~100 tokens (`short`) or ~1,500 (`long`).
pub fn prompt(kind: &str, i: usize) -> String {
    let chars = if kind == "long" { 7_400 } else { 430 };
    let mut s = format!("Request {i}. Summarize the following text. ");
    while s.len() < chars {
        s.push_str(LOREM);
        s.push(' ');
    }
    s.truncate(chars);
    s
}

struct One {
    /// The request's number in the level (0-based).
    index: usize,
    /// When each text-carrying event arrived.
    token_times: Vec<Instant>,
    ok: bool,
    prompt_tokens: u64,
    output_tokens: u64,
    ttft_ms: f64,
    itl_ms: Vec<f64>,
    e2e_s: f64,
}

async fn one(http: &reqwest::Client, base: &str, level: &Level, i: usize) -> One {
    let mut body = json!({
        "model": level.model,
        "max_tokens": level.output_tokens,
        "temperature": 0,
        "ignore_eos": true,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let path = match level.api {
        Api::Chat => {
            body["messages"] = json!([{"role": "user", "content": prompt(&level.prompt, i)}]);
            "chat/completions"
        }
        Api::Completions => {
            body["prompt"] = json!(prompt(&level.prompt, i));
            "completions"
        }
    };
    let t0 = Instant::now();
    let mut out = One { index: i, token_times: vec![], ok: false, prompt_tokens: 0, output_tokens: 0, ttft_ms: f64::NAN, itl_ms: vec![], e2e_s: 0.0 };
    let mut resp = match http.post(format!("{base}/v1/{path}")).json(&body).send().await {
        Ok(r) => r,
        Err(e) => {
            eprintln!("request {i} failed: {e}");
            return out;
        }
    };
    if !resp.status().is_success() {
        eprintln!("request {i} failed: {} {}", resp.status(), resp.text().await.unwrap_or_default());
        return out;
    }
    let mut buf = String::new();
    let mut last: Option<Instant> = None;
    loop {
        let chunk = match resp.chunk().await {
            Ok(Some(c)) => c,
            Ok(None) => break,
            Err(e) => {
                eprintln!("request {i}: the stream broke: {e}");
                return out;
            }
        };
        let now = Instant::now();
        buf.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buf.find("\n\n") {
            let frame: String = buf.drain(..end + 2).collect();
            for line in frame.lines() {
                let Some(data) = line.strip_prefix("data:") else { continue };
                let data = data.trim();
                if data == "[DONE]" {
                    out.ok = true;
                    continue;
                }
                let Ok(v) = serde_json::from_str::<Value>(data) else { continue };
                if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                    out.prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(0);
                    out.output_tokens = u["completion_tokens"].as_u64().unwrap_or(0);
                }
                let choice = &v["choices"][0];
                let text = if level.api == Api::Chat { &choice["delta"]["content"] } else { &choice["text"] };
                let has_text = text.as_str().is_some_and(|s| !s.is_empty());
                if has_text {
                    out.token_times.push(now);
                    match last {
                        None => out.ttft_ms = now.duration_since(t0).as_secs_f64() * 1e3,
                        Some(l) => out.itl_ms.push(now.duration_since(l).as_secs_f64() * 1e3),
                    }
                    last = Some(now);
                }
            }
        }
    }
    out.e2e_s = t0.elapsed().as_secs_f64();
    if !out.ok {
        eprintln!("request {i}: the stream ended without [DONE]: {buf:?}");
    }
    out
}

/// Runs one level against `base` (e.g. `http://127.0.0.1:8080`).
pub async fn run_level(base: &str, level: &Level) -> LevelResult {
    let http = reqwest::Client::builder().pool_max_idle_per_host(level.concurrency).build().unwrap();
    let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let deadline = Instant::now() + level.time_limit;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Fragmentation sampler: only while the level's full concurrency is running.
    let sampler = {
        let (http, base, stop, c) = (http.clone(), base.to_string(), stop.clone(), level.concurrency as u64);
        tokio::spawn(async move {
            let mut frag = vec![];
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                if let Ok(r) = http.get(format!("{base}/admin/status")).send().await {
                    if let Ok(v) = r.json::<Value>().await {
                        for w in v["workers"].as_array().into_iter().flatten() {
                            let s = &w["signals"];
                            if s["running"].as_u64() == Some(c) && s["waiting"].as_u64() == Some(0) {
                                frag.push(s["kv_fragmentation_ratio"].as_f64().unwrap_or(0.0));
                            }
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            frag
        })
    };
    let t0 = Instant::now();
    let mut tasks = vec![];
    for _ in 0..level.concurrency {
        let (http, base, level, next) = (http.clone(), base.to_string(), level.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            let mut mine = vec![];
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= level.requests || Instant::now() > deadline {
                    break;
                }
                mine.push(one(&http, &base, &level, i).await);
            }
            mine
        }));
    }
    let mut all = vec![];
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    let wall_s = t0.elapsed().as_secs_f64();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let frag = sampler.await.unwrap_or_default();
    let ok: Vec<&One> = all.iter().filter(|o| o.ok).collect();
    let ttft: Vec<f64> = ok.iter().map(|o| o.ttft_ms).filter(|t| t.is_finite()).collect();
    let itl: Vec<f64> = ok.iter().flat_map(|o| o.itl_ms.iter().copied()).collect();
    let e2e: Vec<f64> = ok.iter().map(|o| o.e2e_s).collect();
    let output_tokens: u64 = ok.iter().map(|o| o.output_tokens).sum();
    let itl_mean = if itl.is_empty() { f64::NAN } else { itl.iter().sum::<f64>() / itl.len() as f64 };
    let steady = steady_decode(&all, level.concurrency);
    LevelResult {
        prompt: level.prompt.clone(),
        concurrency: level.concurrency,
        requests_ok: ok.len(),
        requests_failed: all.len() - ok.len(),
        prompt_tokens_mean: ok.iter().map(|o| o.prompt_tokens as f64).sum::<f64>() / ok.len().max(1) as f64,
        output_tokens,
        wall_s,
        output_tokens_per_s: output_tokens as f64 / wall_s,
        requests_per_s: ok.len() as f64 / wall_s,
        ttft_ms_p50: percentile(&ttft, 0.5),
        ttft_ms_p99: percentile(&ttft, 0.99),
        itl_ms_p50: percentile(&itl, 0.5),
        itl_ms_p99: percentile(&itl, 0.99),
        decode_tokens_per_s_per_stream: 1e3 / itl_mean,
        steady_decode_tokens_per_s: steady,
        e2e_s_p50: percentile(&e2e, 0.5),
        e2e_s_p99: percentile(&e2e, 0.99),
        kv_fragmentation_mean: (!frag.is_empty()).then(|| frag.iter().sum::<f64>() / frag.len() as f64),
        kv_fragmentation_max: frag.iter().copied().reduce(f64::max),
    }
}

/// Tokens/s over the window where the first `n` requests (the first wave) all decode: from the
/// last first token among them to the first last token among them.
fn steady_decode(all: &[One], n: usize) -> Option<f64> {
    let wave: Vec<&One> = all.iter().filter(|o| o.index < n && o.ok && !o.token_times.is_empty()).collect();
    if wave.len() < n {
        return None;
    }
    let start = wave.iter().map(|o| o.token_times[0]).max()?;
    let end = wave.iter().map(|o| *o.token_times.last().unwrap()).min()?;
    let secs = end.checked_duration_since(start)?.as_secs_f64();
    if secs <= 0.0 {
        return None;
    }
    let tokens = wave.iter().flat_map(|o| &o.token_times).filter(|&&t| t > start && t <= end).count();
    Some(tokens as f64 / secs)
}

/// The results as a markdown table.
pub fn markdown(results: &[LevelResult]) -> String {
    let mut s = String::from(
        "| prompt | concurrency | ok / failed | prompt tokens | output tok/s | req/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | decode tok/s per stream | steady decode tok/s, all streams | KV fragmentation mean / max |\n|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in results {
        let frag = match (r.kv_fragmentation_mean, r.kv_fragmentation_max) {
            (Some(m), Some(x)) => format!("{:.2}% / {:.2}%", m * 100.0, x * 100.0),
            _ => "not sampled".into(),
        };
        s.push_str(&format!(
            "| {} | {} | {} / {} | {:.0} | {:.1} | {:.2} | {:.1} / {:.1} | {:.1} / {:.1} | {:.1} | {} | {} |\n",
            r.prompt,
            r.concurrency,
            r.requests_ok,
            r.requests_failed,
            r.prompt_tokens_mean,
            r.output_tokens_per_s,
            r.requests_per_s,
            r.ttft_ms_p50,
            r.ttft_ms_p99,
            r.itl_ms_p50,
            r.itl_ms_p99,
            r.decode_tokens_per_s_per_stream,
            r.steady_decode_tokens_per_s.map_or("n/a".into(), |v| format!("{v:.1}")),
            frag
        ));
    }
    s
}
