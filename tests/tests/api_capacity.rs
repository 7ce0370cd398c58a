//! The HTTP API under load and at its limits, on the real model: concurrent streams and early
//! disconnects that must give every KV block back, no new work while a node drains, and short
//! requests that queue on full workers instead of failing.

use std::time::Duration;

use futures::StreamExt;
use serde_json::{json, Value};
use zerolayer_common::SamplingParams;
use zerolayer_tests::*;

async fn free_blocks(c: &reqwest::Client, s: &TestServer) -> (f64, f64) {
    let page = c.get(s.url("/metrics")).send().await.unwrap().text().await.unwrap();
    (metric(&page, "zerolayer_kv_blocks_free").unwrap(), metric(&page, "zerolayer_kv_blocks_total").unwrap())
}

async fn wait_all_free(c: &reqwest::Client, s: &TestServer) {
    loop {
        let (free, total) = free_blocks(c, s).await;
        if free == total {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// 16 concurrent streams complete; then 8 more complete while 8 long generations (1,500
/// tokens, `ignore_eos`, so they cannot end early on their own) are dropped mid-stream. The
/// dropped ones must be cancelled at the worker: their blocks come back within about a second
/// of the last completion, and they generate far fewer tokens than they asked for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_concurrent_streams_and_early_disconnects_free_every_block() {
    let _g = heavy();
    let s = TestServer::start(|_| {}).await;
    let c = http_client(120);
    let worker = s.frontend.workers[0].handle.clone();
    const LONG: u64 = 1500;
    let mut generated_by_dropped = 0;
    for round in 0..2 {
        let before = worker.signals().generated_tokens_total;
        let mut tasks = vec![];
        for i in 0..16 {
            let c = c.clone();
            let disconnect = round == 1 && i % 2 == 0;
            let (url, body) = if disconnect {
                (s.url("/v1/chat/completions"), json!({"model": "smollm2-135m-instruct", "max_tokens": LONG, "stream": true, "ignore_eos": true,
                    "messages": [{"role": "user", "content": format!("Write a long poem about the number {i}.")}]}))
            } else {
                (s.url("/v1/messages"), messages_body(&format!("Write a short poem about the number {i}."), 32, true))
            };
            tasks.push(tokio::spawn(async move {
                let resp = c.post(url).json(&body).send().await.unwrap();
                assert_eq!(resp.status(), 200);
                let mut stream = resp.bytes_stream();
                let mut raw = Vec::new();
                while let Some(chunk) = stream.next().await {
                    raw.extend_from_slice(&chunk.unwrap());
                    if disconnect && String::from_utf8_lossy(&raw).matches("\"content\":").count() >= 3 {
                        return None; // drop the connection mid-stream
                    }
                }
                Some(String::from_utf8(raw).unwrap())
            }));
        }
        let mut completed = 0;
        for t in tasks {
            if let Some(body) = within(300, "stream completes", t).await.unwrap() {
                let ev = parse_sse(&body);
                assert_eq!(ev.last().unwrap().0, "message_stop", "stream {body}");
                completed += 1;
            }
        }
        assert_eq!(completed, if round == 0 { 16 } else { 8 });
        // Every block free again within about a second of the last completion: the dropped
        // sequences were cancelled, not left to run for another 1,500 tokens each.
        within(3, "KV blocks free within ~1 s of the last stream", wait_all_free(&c, &s)).await;
        if round == 1 {
            let generated = worker.signals().generated_tokens_total - before;
            generated_by_dropped = generated.saturating_sub(8 * 32);
            assert!(generated_by_dropped < 8 * LONG / 10, "dropped streams generated {generated_by_dropped} tokens of the {} they asked for", 8 * LONG);
        }
    }
    eprintln!("8 dropped streams generated {generated_by_dropped} tokens in all before they were cancelled");
    s.stop().await.unwrap();
}

/// While a lone node drains (SIGTERM's path), no new work starts: `/ready` is 503, a new
/// generation is refused (529: its only worker is out of placement, and there is no other; or
/// the connection is no longer accepted), and the coordinator itself refuses; the request
/// already running finishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_new_work_while_draining() {
    let _g = heavy();
    let s = TestServer::start(|c| c.server.shutdown_grace_secs = 60).await;
    let gate = s.hold_steps().await;
    let coordinator = s.frontend.clone();
    let c = http_client(120);
    // The first step (its events carry message_start) passes; the next is held.
    gate.hold_after(1);
    let resp = c.post(s.url("/v1/messages")).json(&messages_body("Count to five.", 8, true)).send().await.unwrap();
    let mut stream = resp.bytes_stream();
    let mut raw = String::new();
    read_stream_until(&mut stream, &mut raw, 60, "message_start", |r| r.contains("event: message_start")).await;
    gate.wait_blocked(Duration::from_secs(60)).await;
    let base = s.base.clone();
    let stopping = tokio::spawn(s.stop());
    within(10, "the node starts draining", async {
        while coordinator.is_ready() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    let fresh = reqwest::Client::new();
    match fresh.get(format!("{base}/ready")).send().await {
        Ok(r) => assert_eq!(r.status(), 503),
        Err(e) => assert!(e.is_connect(), "{e}"),
    }
    match fresh.post(format!("{base}/v1/messages")).json(&messages_body("Hello?", 4, false)).send().await {
        Ok(r) => {
            assert_eq!(r.status(), 529, "a new generation during the drain");
            assert_eq!(r.json::<Value>().await.unwrap()["error"]["type"], "overloaded_error");
        }
        Err(e) => assert!(e.is_connect(), "{e}"),
    }
    use zerolayer_coordinator::frontend::request::{GenerationRequest, Role, Turn};
    let mut req = GenerationRequest::chat("smollm2-135m-instruct", None, vec![Turn::new(Role::User, "Hi")]);
    (req.max_tokens, req.params) = (Some(1), SamplingParams::greedy(1));
    let open = zerolayer_coordinator::auth::Caller::Open;
    let admitted = coordinator.admit(&open, true).ok().expect("admitted: the refusal is placement's (no worker takes work)");
    let prepared = coordinator.served(&req.model).unwrap().prepare(req, zerolayer_coordinator::frontend::pipeline::Purpose::Generate).unwrap();
    let refused = coordinator.start(admitted, &open, prepared, "req_test").await.err().expect("refused while draining");
    assert_eq!(refused.status(), 529);
    gate.release();
    while let Some(chunk) = within(60, "the running stream finishes", stream.next()).await {
        raw.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
    }
    assert_eq!(parse_sse(&raw).last().unwrap().0, "message_stop", "{raw}");
    stopping.await.unwrap().unwrap();
}

/// One node, two workers with small KV caches. Each runs a long request that holds most of its
/// blocks; then a burst arrives that no worker has room for. It queues on the workers (placement
/// reason `queued_for_kv`) and completes, instead of failing with 529. The engines are held
/// while the burst is placed, so the workers' published signals cannot change under it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_short_requests_queue_across_workers() {
    let _g = heavy();
    let s = TestServer::start(|c| {
        let mut w = c.nodes[0].workers[0].clone();
        w.threads = 1;
        w.kv_cache_mb = 16; // 91 blocks of 4 tokens: room for one of these requests at a time
        w.id = "cpu0".into();
        let mut w1 = w.clone();
        w1.id = "cpu1".into();
        c.nodes[0].workers = vec![w, w1];
    })
    .await;
    let c = http_client(120);
    let gates = [StepGate::default(), StepGate::default()];
    for (w, g) in s.frontend.workers.iter().zip(&gates) {
        w.handle.set_step_hook(Some(g.hook())).await.unwrap();
    }
    let note = |i: usize| format!("Note {i}: {LOREM}\nSummarize the note."); // ~58 blocks
    let send = |body: Value, url: String| {
        let c = c.clone();
        tokio::spawn(async move {
            let r = c.post(url).json(&body).send().await.unwrap();
            let by = r.headers().get("zerolayer-worker").map(|v| v.to_str().unwrap().to_string());
            (r.status().as_u16(), by, r.text().await.unwrap())
        })
    };
    // Two holders, one per worker, each holding its prompt's ~58 blocks. Each worker's engine is
    // held as soon as its holder runs, so no holder can finish before the burst is placed.
    let mut tasks = vec![];
    for i in 0..2 {
        let holder = json!({"model": "smollm2-135m-instruct", "max_tokens": 60, "ignore_eos": true, "temperature": 0,
                            "messages": [{"role": "user", "content": note(i)}]});
        tasks.push(send(holder, s.url("/v1/chat/completions")));
        let w = within(60, "the holder runs", async {
            loop {
                if let Some(w) = (0..2).find(|&w| s.frontend.workers[w].handle.signals().running == 1 && !gates[w].is_held()) {
                    break w;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        gates[w].hold();
        gates[w].wait_blocked(Duration::from_secs(60)).await;
    }
    let free: Vec<u32> = s.frontend.workers.iter().map(|w| w.handle.signals().kv_blocks_free).collect();
    assert!(s.frontend.workers.iter().all(|w| w.handle.signals().running == 1), "one holder per worker");
    for i in 2..6 {
        tasks.push(send(messages_body(&note(i), 8, false), s.url("/v1/messages")));
    }
    within(60, "the burst is placed", async {
        loop {
            let page = c.get(s.url("/metrics")).send().await.unwrap().text().await.unwrap();
            if metric_with(&page, "zerolayer_placements_total", &[("reason", "queued_for_kv")]).unwrap_or(0.0) >= 4.0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    for g in &gates {
        g.release();
    }
    let mut served = vec![];
    for t in tasks {
        let (status, by, body) = within(600, "queued requests complete", t).await.unwrap();
        assert_eq!(status, 200, "{body}");
        served.push(by.unwrap());
    }
    eprintln!("free blocks while the holders ran: {free:?}; served by {served:?}");
    assert!(served[2..].iter().any(|w| w == "n1/cpu0") || served[2..].iter().any(|w| w == "n1/cpu1"));
    assert!(served.iter().any(|w| w == "n1/cpu0") && served.iter().any(|w| w == "n1/cpu1"), "both workers served: {served:?}");
    s.stop().await.unwrap();
}

/// Preparing a request (parsing, rendering, tokenizing) runs off the async runtime: on a
/// one-thread runtime, a timer set beside a slow preparation still fires on time. (Run on the
/// runtime itself, the preparation would hold the only thread until it ended.)
#[tokio::test(flavor = "current_thread")]
async fn preparation_runs_off_the_runtime() {
    let _g = heavy();
    let s = TestServer::start(|_| {}).await;
    let slow = s.frontend.prepare(|| std::thread::sleep(Duration::from_millis(600)));
    // The clock starts before either is polled: join! polls the preparation first, and one
    // that ran on this thread would finish before the timer's first poll.
    let t = std::time::Instant::now();
    let timer = async {
        tokio::time::sleep(Duration::from_millis(20)).await;
        t.elapsed()
    };
    let (prepared, waited) = tokio::join!(slow, timer);
    prepared.expect("prepared");
    assert!(waited < Duration::from_millis(400), "a 20 ms timer fired after {waited:?}: the preparation held the runtime");
    s.stop().await.unwrap();
}
