//! Multi-tenant safety on a real 2-node cluster (QUIC, mutual TLS, gossip): per-key limits hold
//! across the cluster (requests, output tokens, concurrency), `count_tokens` is charged,
//! `ignore_eos` is an operator option per key, and a burst of huge bodies on one node is refused
//! off the async runtime, so its peer never takes it for dead.

use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::{json, Value};
use zerolayer_common::config::KeyConfig;
use zerolayer_coordinator::quota::TenantUsage;
use zerolayer_tests::*;

const MODEL: &str = "smollm2-135m-instruct";
const LIMITED: &str = "sk-limited-0123456789";
const OUTPUT: &str = "sk-output-0123456789";
const CONC: &str = "sk-concurrent-0123456789";
const COUNTER: &str = "sk-counter-0123456789";
const PLAIN: &str = "sk-plain-0123456789";
const ADMIN: &str = "sk-admin-0123456789";

fn key(name: &str, key: &str, edit: impl FnOnce(&mut KeyConfig)) -> KeyConfig {
    let mut k = KeyConfig { name: name.into(), key: key.into(), ..Default::default() };
    edit(&mut k);
    k
}

fn short(max_tokens: u32) -> Value {
    json!({"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]})
}

/// What `node` knows of `tenant` across the cluster.
fn usage(c: &TestCluster, node: usize, tenant: &str) -> Option<TenantUsage> {
    c.nodes[node].frontend.guard.quota.usage().into_iter().find(|u| u.tenant == tenant)
}

fn remaining(u: &TenantUsage, limit: &str) -> u32 {
    u.remaining.iter().find(|(n, _, _)| *n == limit).map(|(_, _, r)| *r).unwrap()
}

/// Polls until `ok` holds, or fails naming `what`.
async fn until(what: &str, within: Duration, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !ok() {
        assert!(Instant::now() < deadline, "{what}: not within {within:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn post(http: &reqwest::Client, url: String, key: &str, body: &Value) -> reqwest::Response {
    http.post(url).header("x-api-key", key).json(body).send().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_hold_across_the_cluster() {
    let _g = heavy();
    let cluster = TestCluster::start(2, |c| {
        c.auth.api_keys = vec![PLAIN.into()];
        c.auth.admin_key = Some(ADMIN.into());
        c.auth.keys = vec![
            key("limited", LIMITED, |k| k.requests_per_minute = Some(6)),
            key("output", OUTPUT, |k| {
                k.output_tokens_per_minute = Some(24);
                k.allow_ignore_eos = true;
            }),
            key("concurrent", CONC, |k| {
                k.max_concurrent_requests = Some(2);
                k.allow_ignore_eos = true;
            }),
            key("counter", COUNTER, |k| k.tokens_per_minute = Some(100)),
        ];
    })
    .await;
    cluster.wait_converged(&[0, 1], Duration::from_secs(30)).await;
    let http = reqwest::Client::builder().timeout(Duration::from_secs(120)).build().unwrap();
    let (a, b) = (&cluster.nodes[0], &cluster.nodes[1]);

    // 1. Six requests a minute: six on node a, then the seventh on node b gets 429.
    for i in 0..6 {
        let r = post(&http, a.url("/v1/messages"), LIMITED, &short(1)).await;
        assert_eq!(r.status(), 200, "request {i} on a");
        assert_eq!(r.headers()["anthropic-ratelimit-requests-remaining"], (5 - i).to_string().as_str());
    }
    until("node b hears of a's six requests", Duration::from_secs(10), || usage(&cluster, 1, "limited").is_some_and(|u| remaining(&u, "requests") == 0)).await;
    let r = post(&http, b.url("/v1/messages"), LIMITED, &short(1)).await;
    assert_eq!(r.status(), 429, "the seventh request, on the other node");
    let retry: u64 = r.headers()["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((1..=10).contains(&retry), "retry-after {retry}: one request frees every 10 s");
    assert_eq!(r.headers()["anthropic-ratelimit-requests-remaining"], "0", "b's headers tell the cluster's truth");
    assert_eq!(r.headers()["anthropic-ratelimit-requests-limit"], "6");
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["type"], "rate_limit_error");
    assert!(e["error"]["message"].as_str().unwrap().contains("requests per minute"), "{e}");
    // The admin status of either node shows the key's usage.
    let st: Value = http.get(b.url("/admin/status")).header("x-api-key", ADMIN).send().await.unwrap().json().await.unwrap();
    let limited = st["keys"].as_array().unwrap().iter().find(|k| k["tenant"] == "limited").expect("the key in b's status").clone();
    assert_eq!(limited["remaining"][0], json!(["requests", 6, 0]), "{st}");

    // 2. Output tokens: 24 a minute. 24 generated on a (ignore_eos, allowed for this key) spend
    // them; b then refuses the key's next generation, naming the output limit.
    let body = json!({"model": MODEL, "max_tokens": 24, "ignore_eos": true, "temperature": 0, "messages": [{"role": "user", "content": "Count."}]});
    let r = http.post(a.url("/v1/chat/completions")).bearer_auth(OUTPUT).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 24, "{v}");
    until("node b hears of a's output tokens", Duration::from_secs(10), || usage(&cluster, 1, "output").is_some_and(|u| remaining(&u, "output-tokens") == 0)).await;
    let r = post(&http, b.url("/v1/messages"), OUTPUT, &short(4)).await;
    assert_eq!(r.status(), 429);
    assert!(r.headers().contains_key("retry-after"));
    assert_eq!(r.headers()["anthropic-ratelimit-output-tokens-remaining"], "0");
    let e: Value = r.json().await.unwrap();
    assert!(e["error"]["message"].as_str().unwrap().contains("output tokens per minute"), "{e}");

    // 3. At most two requests in flight for a key, cluster-wide: two long streams on a (the
    // OpenAI route, where `ignore_eos` is accepted), and b
    // refuses a third; once they are gone, b admits again.
    let long = json!({"model": MODEL, "max_tokens": 2000, "ignore_eos": true, "stream": true, "temperature": 0, "messages": [{"role": "user", "content": "Write a long story."}]});
    let mut streams = Vec::new();
    for _ in 0..2 {
        let r = post(&http, a.url("/v1/chat/completions"), CONC, &long).await;
        assert_eq!(r.status(), 200);
        let mut s = r.bytes_stream();
        s.next().await.unwrap().unwrap();
        streams.push(s);
    }
    until("node b sees the two open requests", Duration::from_secs(10), || usage(&cluster, 1, "concurrent").is_some_and(|u| u.inflight_cluster == 2)).await;
    let r = post(&http, b.url("/v1/messages"), CONC, &short(1)).await;
    assert_eq!(r.status(), 429);
    let e: Value = r.json().await.unwrap();
    assert!(e["error"]["message"].as_str().unwrap().contains("concurrent requests"), "{e}");
    drop(streams);
    until("node b sees them closed", Duration::from_secs(20), || usage(&cluster, 1, "concurrent").is_some_and(|u| u.inflight_cluster == 0)).await;
    assert_eq!(post(&http, b.url("/v1/messages"), CONC, &short(1)).await.status(), 200);

    // 4. count_tokens is charged a tenth of what it counts: ~600 tokens cost ~60 of the key's
    // 100 tokens a minute, so the second count is refused.
    let doc = json!({"model": MODEL, "messages": [{"role": "user", "content": LOREM.repeat(4)}]});
    let r = post(&http, a.url("/v1/messages/count_tokens"), COUNTER, &doc).await;
    assert_eq!(r.status(), 200, "{:?}", r.text().await);
    let left: u32 = r.headers()["anthropic-ratelimit-tokens-remaining"].to_str().unwrap().parse().unwrap();
    let counted = r.json::<Value>().await.unwrap()["input_tokens"].as_u64().unwrap();
    assert!((500..1000).contains(&counted), "{counted}");
    assert_eq!(left as u64, 100 - counted.div_ceil(10), "charged a tenth, rounded up");
    let r = post(&http, a.url("/v1/messages/count_tokens"), COUNTER, &doc).await;
    assert_eq!(r.status(), 429);

    // 5. ignore_eos is the operator's to give: a key without it gets 403 on both APIs.
    let r = post(&http, a.url("/v1/chat/completions"), PLAIN, &json!({"model": MODEL, "max_tokens": 4, "ignore_eos": true, "messages": [{"role": "user", "content": "Hi"}]})).await;
    assert_eq!(r.status(), 403);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["type"], "permission_error", "{e}");
    assert!(e["error"]["message"].as_str().unwrap().contains("ignore_eos"), "{e}");
    assert_eq!(post(&http, a.url("/v1/messages"), PLAIN, &short(1)).await.status(), 200);
}

/// Peak resident memory of this process while `f` runs (sampled every 10 ms), in MiB.
fn rss_mib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: u64 = s.lines().find(|l| l.starts_with("VmRSS:")).unwrap().split_whitespace().nth(1).unwrap().parse().unwrap();
    kb / 1024
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_bodies_are_refused_off_the_runtime_and_the_peer_stays_live() {
    let _g = heavy();
    let cluster = TestCluster::start(2, |_| {}).await;
    cluster.wait_converged(&[0, 1], Duration::from_secs(30)).await;
    let http = reqwest::Client::builder().timeout(Duration::from_secs(300)).build().unwrap();
    // 30 MB of text (under the 32 MB body limit): far more tokens than the context, whatever
    // the tokenizer does.
    let body = serde_json::to_vec(&json!({"model": MODEL, "messages": [{"role": "user", "content": "lorem ipsum ".repeat(2_500_000)}]})).unwrap();
    assert!(body.len() > 29_000_000 && body.len() < 32 * 1024 * 1024);
    let body = bytes::Bytes::from(body);
    let base_rss = rss_mib();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Watch node b's view of node a, and this process's memory, while the burst runs.
    let watcher = {
        let b = cluster.nodes[1].frontend.clone();
        let done = done.clone();
        tokio::spawn(async move {
            let (mut peak, mut a_seen_dead) = (0u64, false);
            while !done.load(std::sync::atomic::Ordering::Acquire) {
                peak = peak.max(rss_mib());
                a_seen_dead |= b.cluster.nodes().iter().any(|n| n.id == "a" && n.state == zerolayer_coordinator::view::NodeState::Dead);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            (peak, a_seen_dead)
        })
    };
    let t0 = Instant::now();
    let answers = futures::future::join_all((0..8).map(|_| {
        let (http, url, body) = (http.clone(), cluster.nodes[0].url("/v1/messages/count_tokens"), body.clone());
        async move {
            let r = http.post(url).header("content-type", "application/json").body(body).send().await.unwrap();
            let status = r.status().as_u16();
            (status, r.json::<Value>().await.unwrap())
        }
    }))
    .await;
    let took = t0.elapsed();
    done.store(true, std::sync::atomic::Ordering::Release);
    let (peak, a_seen_dead) = watcher.await.unwrap();
    for (status, v) in &answers {
        assert_eq!(*status, 400, "{v}");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert!(v["error"]["message"].as_str().unwrap().contains("prompt is too long: at least"), "{v}");
    }
    assert!(!a_seen_dead, "node b took node a for dead during the burst");
    eprintln!("8 × 30 MB count_tokens: {took:?}; RSS {base_rss} MiB before, peak {peak} MiB");
    assert!(peak.saturating_sub(base_rss) < 1536, "peak RSS grew by {} MiB (bound 1.5 GiB)", peak - base_rss);
    // Node a still serves, and b still sees it ready.
    let r = http.post(cluster.nodes[0].url("/v1/messages")).json(&short(2)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(cluster.nodes[1].frontend.cluster.nodes().iter().any(|n| n.id == "a" && n.state == zerolayer_coordinator::view::NodeState::Ready));
}

/// Key A (allowed `ignore_eos` by the operator) runs six requests that each fill the whole
/// context, six times the KV the worker has; key B sends twelve short requests meanwhile. The
/// worker shares slots and KV between the keys, so B's slowest time to first token stays under
/// 1.5 s (first-come admission with youngest-first preemption makes B wait behind A's requests
/// for seconds), and admission's reservation keeps any sequence from being preempted twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_with_long_requests_cannot_starve_another() {
    let _g = heavy();
    const LONG: &str = "sk-long-0123456789";
    const SHORT: &str = "sk-short-0123456789";
    let s = TestServer::start(|c| {
        // About 530 tokens of KV: the context, and a sixth of what A's six requests want.
        c.nodes[0].workers[0].kv_cache_mb = 24;
        c.auth.keys = vec![key("long", LONG, |k| k.allow_ignore_eos = true), key("short", SHORT, |_| {})];
    })
    .await;
    let http = reqwest::Client::builder().timeout(Duration::from_secs(300)).build().unwrap();
    let worker = s.frontend.workers[0].handle.clone();
    let mut long = Vec::new();
    for i in 0..6 {
        let body = json!({"model": MODEL, "ignore_eos": true, "stream": true, "temperature": 0, "messages": [{"role": "user", "content": format!("Story {i}: once upon a time")}]});
        let r = http.post(s.url("/v1/chat/completions")).bearer_auth(LONG).json(&body).send().await.unwrap();
        assert_eq!(r.status(), 200);
        let mut stream = r.bytes_stream();
        long.push(tokio::spawn(async move { while let Some(Ok(_)) = stream.next().await {} }));
    }
    until("A's requests fill the cache and preempt each other", Duration::from_secs(120), || worker.signals().preemptions_total > 0).await;
    let mut ttft = Vec::new();
    for i in 0..12 {
        let t0 = Instant::now();
        let body = json!({"model": MODEL, "max_tokens": 1, "temperature": 0, "messages": [{"role": "user", "content": format!("Hello number {i}")}]});
        let r = post(&http, s.url("/v1/messages"), SHORT, &body).await;
        assert_eq!(r.status(), 200);
        ttft.push(t0.elapsed());
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let sig = worker.signals();
    for t in long {
        t.abort();
    }
    ttft.sort();
    eprintln!("B's time to first token under A's load: {ttft:?}; preemptions {}, repeated {}", sig.preemptions_total, sig.repreemptions_total);
    assert!(ttft[11] < Duration::from_millis(1500), "B's slowest time to first token {:?} (bound 1.5 s)", ttft[11]);
    assert!(sig.running + sig.waiting >= 2, "A's requests were still there while B was served");
    assert_eq!(sig.repreemptions_total, 0, "no sequence was preempted twice");
}
