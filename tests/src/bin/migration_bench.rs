//! Drain rotation under steady load, measured: three in-process nodes on the real model, streams
//! of long prompts running all the time, each node drained in turn (its sequences move with
//! their KV) and then undrained. Reports failed requests, the pause a moved stream sees against
//! the inter-token latency of streams that did not move, KV bytes moved and the rate, and the
//! time to move one 1,400-token sequence against the time to prefill it again.
//!
//! migration_bench [--streams 6] [--output-tokens 96] [--json PATH]
//!
//! (The process replacement that follows a drain is exercised by `coordinator/tests/rolling.rs`;
//! what a client sees is decided by the drain.)

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use zerolayer_tests::{document, TestCluster};

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// One streamed request: its first worker, when it started, and each content chunk's time.
struct Run {
    first: String,
    ok: bool,
    times: Vec<Instant>,
}

fn body(i: usize, output_tokens: u32) -> Value {
    // ~1,400 tokens: two documents and a paragraph, distinct from the first block on.
    let text = format!("{}\n\n{}\n\n{}\n\nContinue the text.", document(i, "mig"), document(i + 10_000, "mig"), zerolayer_tests::LOREM);
    json!({"model": "smollm2-135m-instruct", "max_tokens": output_tokens, "ignore_eos": true, "stream": true, "temperature": 0,
           "messages": [{"role": "user", "content": text}]})
}

async fn stream(http: &reqwest::Client, url: &str, b: &Value) -> Run {
    let mut run = Run { first: String::new(), ok: false, times: vec![] };
    let Ok(mut r) = http.post(url).json(b).send().await else { return run };
    if r.status() != 200 {
        return run;
    }
    run.first = r.headers().get("zerolayer-worker").map(|v| v.to_str().unwrap_or("").to_string()).unwrap_or_default();
    let mut buf = String::new();
    while let Ok(Some(chunk)) = r.chunk().await {
        let now = Instant::now();
        buf.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buf.find("\n\n") {
            let frame: String = buf.drain(..end + 2).collect();
            if frame.contains("[DONE]") {
                run.ok = true;
            } else if frame.contains("\"content\":\"") && !frame.contains("\"content\":\"\"") {
                run.times.push(now);
            }
        }
    }
    run
}

#[tokio::main(flavor = "multi_thread", worker_threads = 4)]
async fn main() -> anyhow::Result<()> {
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).with_writer(std::io::stderr).init();
    }
    let args: Vec<String> = std::env::args().collect();
    let streams: usize = arg(&args, "--streams").map(|v| v.parse()).transpose()?.unwrap_or(6);
    let output_tokens: u32 = arg(&args, "--output-tokens").map(|v| v.parse()).transpose()?.unwrap_or(96);
    let cluster = TestCluster::start(3, |c| {
        for n in &mut c.nodes {
            n.workers[0].kv_cache_mb = 512;
            n.workers[0].threads = 1;
        }
    })
    .await;
    cluster.wait_converged(&[0, 1, 2], Duration::from_secs(30)).await;
    let http = reqwest::Client::new();
    let urls: Vec<String> = cluster.nodes.iter().map(|n| n.url("/v1/chat/completions")).collect();

    // Recompute: prefill a fresh 1,400-token prompt on an idle node (time to first token).
    let mut prefill_ms = vec![];
    for k in 0..3 {
        let mut b = body(90_000 + k, 1);
        b["stream"] = json!(false);
        let t = Instant::now();
        let r = http.post(&urls[0]).json(&b).send().await?;
        anyhow::ensure!(r.status() == 200, "prefill run failed");
        let v: Value = r.json().await?;
        prefill_ms.push(t.elapsed().as_secs_f64() * 1e3);
        eprintln!("prefill of {} prompt tokens: {:.0} ms", v["usage"]["prompt_tokens"], prefill_ms[k]);
    }
    let prefill_ms_p50 = pct(&mut prefill_ms, 0.5);

    // One 1,400-token sequence moved off an otherwise idle node: the move itself.
    let solo = {
        let (http, url) = (http.clone(), urls[1].clone());
        tokio::spawn(async move { stream(&http, &url, &body(80_000, 200)).await })
    };
    let b = &cluster.nodes[1];
    while b.frontend.workers[0].handle.signals().active_decode_blocks == 0 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    http.post(b.url(&format!("/admin/nodes/{}/drain", b.id))).send().await?;
    let solo_report = loop {
        let r: Value = http.get(b.url(&format!("/admin/nodes/{}/drain", b.id))).send().await?.json().await?;
        if r["emptied_after_ms"].is_number() {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    http.post(b.url(&format!("/admin/nodes/{}/undrain", b.id))).send().await?;
    let solo_run = solo.await?;
    anyhow::ensure!(solo_run.ok, "the solo stream failed");
    let solo_pause = solo_run.times.windows(2).map(|w| w[1].duration_since(w[0]).as_secs_f64() * 1e3).fold(0f64, f64::max);
    let solo_move = solo_report["recent"][0].clone();
    eprintln!("solo move: {solo_move}; the stream's longest gap {solo_pause:.0} ms");

    // Steady load: `streams` clients, each sending one request after another.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let runs: Arc<Mutex<Vec<(Run, Instant)>>> = Arc::default();
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut clients = vec![];
    for c in 0..streams {
        let (http, urls, stop, runs, next) = (http.clone(), urls.clone(), stop.clone(), runs.clone(), next.clone());
        clients.push(tokio::spawn(async move {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let t = Instant::now();
                let run = stream(&http, &urls[(i + c) % urls.len()], &body(i, output_tokens)).await;
                runs.lock().unwrap().push((run, t));
            }
        }));
    }
    // The rotation: each node drained while streams run on it, then let back in.
    let mut drains = vec![];
    for n in 0..3 {
        tokio::time::sleep(Duration::from_secs(4)).await;
        // Drain while the node decodes something (not between requests).
        let deadline = Instant::now() + Duration::from_secs(60);
        while cluster.nodes[n].frontend.workers[0].handle.signals().active_decode_blocks == 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let id = cluster.nodes[n].id.clone();
        let at = Instant::now();
        http.post(cluster.nodes[0].url(&format!("/admin/nodes/{id}/drain"))).send().await?;
        let report = loop {
            let r: Value = http.get(cluster.nodes[n].url(&format!("/admin/nodes/{id}/drain"))).send().await?.json().await?;
            if r["sequences"] == 0 && r["emptied_after_ms"].is_number() {
                break r;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        eprintln!("drained {id}: {} moved with KV, {} without, {} bytes in {} ms", report["moved_with_kv"], report["moved_without_kv"], report["kv_bytes_sent"], report["move_ms"]);
        http.post(cluster.nodes[0].url(&format!("/admin/nodes/{id}/undrain"))).send().await?;
        drains.push((id, at, report));
    }
    tokio::time::sleep(Duration::from_secs(4)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for c in clients {
        c.await?;
    }
    let runs = std::mem::take(&mut *runs.lock().unwrap());

    // A stream moved if it ran on a node while that node was drained: its largest gap around the
    // drain is its pause. Every other gap of every stream is an ordinary inter-token latency.
    let mut itl = vec![];
    let mut pauses = vec![];
    let mut failed = 0;
    for (run, _) in &runs {
        if !run.ok {
            failed += 1;
            continue;
        }
        let node = run.first.split('/').next().unwrap_or("");
        let gaps: Vec<(Instant, f64)> = run.times.windows(2).map(|w| (w[1], w[1].duration_since(w[0]).as_secs_f64() * 1e3)).collect();
        let drained = drains.iter().find(|(id, at, _)| id == node && run.times.first().is_some_and(|t| t < at) && run.times.last().is_some_and(|t| t > at));
        match drained {
            Some((_, at, _)) => {
                let around: Vec<f64> = gaps.iter().filter(|(t, _)| *t >= *at).map(|(_, g)| *g).collect();
                pauses.push(around.iter().cloned().fold(0f64, f64::max));
                itl.extend(gaps.iter().filter(|(t, _)| *t < *at).map(|(_, g)| *g));
            }
            None => itl.extend(gaps.iter().map(|(_, g)| *g)),
        }
    }
    let moves: Vec<Value> = drains.iter().flat_map(|(_, _, r)| r["recent"].as_array().cloned().unwrap_or_default()).collect();
    let bytes: f64 = moves.iter().map(|m| m["bytes_sent"].as_f64().unwrap_or(0.0)).sum();
    let move_ms: f64 = moves.iter().map(|m| m["ms"].as_f64().unwrap_or(0.0)).sum();
    // Moves of sequences of about 1,400 tokens (prompt and output): their time against
    // re-prefilling such a prompt.
    let mut long_ms: Vec<f64> = moves.iter().filter(|m| m["tokens"].as_u64().unwrap_or(0) >= 1300 && m["kv_tokens"].as_u64().unwrap_or(0) > 0).map(|m| m["ms"].as_f64().unwrap()).collect();
    let long_p50 = pct(&mut long_ms, 0.5);
    let result = json!({
        "requests": runs.len(),
        "failed": failed,
        "streams": streams,
        "itl_ms_p50": pct(&mut itl.clone(), 0.5),
        "itl_ms_p99": pct(&mut itl, 0.99),
        "moved_streams": pauses.len(),
        "pause_ms_p50": pct(&mut pauses.clone(), 0.5),
        "pause_ms_p99": pct(&mut pauses, 0.99),
        "sequences_moved": moves.len(),
        "kv_bytes_moved": bytes,
        "kv_move_rate_mb_per_s": if move_ms > 0.0 { bytes / 1e6 / (move_ms / 1e3) } else { f64::NAN },
        "move_ms_p50_1400_tokens": long_p50,
        "move_ms_max_1400_tokens": long_ms.iter().cloned().fold(f64::NAN, f64::max),
        "export_wait_ms_p50": pct(&mut moves.iter().map(|m| m["wait_ms"].as_f64().unwrap_or(0.0)).collect::<Vec<_>>(), 0.5),
        "export_wait_ms_max": moves.iter().map(|m| m["wait_ms"].as_f64().unwrap_or(0.0)).fold(0f64, f64::max),
        "prefill_ms_p50_1400_tokens": prefill_ms_p50,
        "solo_move": solo_move,
        // The stream's pause for the move (export wait, then what the pre-copy left), over
        // re-prefilling; and with the pre-copy counted too (the stream kept running during it).
        "solo_move_over_prefill": (solo_move["wait_ms"].as_f64().unwrap_or(0.0) + solo_move["ms"].as_f64().unwrap_or(0.0)) / prefill_ms_p50,
        "solo_move_with_precopy_over_prefill": (solo_move["precopy_ms"].as_f64().unwrap_or(0.0) + solo_move["wait_ms"].as_f64().unwrap_or(0.0) + solo_move["ms"].as_f64().unwrap_or(0.0)) / prefill_ms_p50,
        "solo_stream_longest_gap_ms": solo_pause,
        "move_over_prefill": long_p50 / prefill_ms_p50,
        "drains": drains.iter().map(|(id, _, r)| json!({"node": id, "report": r})).collect::<Vec<_>>(),
    });
    println!("{}", serde_json::to_string_pretty(&result)?);
    if let Some(path) = arg(&args, "--json") {
        std::fs::write(path, serde_json::to_string_pretty(&result)?)?;
    }
    Ok(())
}
