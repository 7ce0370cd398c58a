//! The cluster's KV as one cache (real model, real QUIC + mTLS, two nodes in one process): a
//! request placed on a worker that lacks its prefix pulls the blocks another node caches
//! instead of recomputing them; a fetch that fails leaves it to recompute, with the same
//! output; and a drain copies its hottest cached prefixes to the nodes that stay.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use zerolayer_coordinator::view::NodeState;
use zerolayer_tests::{document, heavy, metric_with, StepGate, TestCluster};

/// About 1,800 tokens: three documents and a question (a test node caches about 2,500).
fn long_prompt(tag: &str) -> String {
    format!("{}\n{}\n{}\nWhat do the three documents above have in common?", document(0, tag), document(1, tag), document(2, tag))
}

/// One greedy Messages request: where it ran, its prompt and cached tokens, its text, and how
/// long it took (with one output token: the time to the first).
struct Asked {
    served_by: String,
    input: u64,
    cached: u64,
    text: String,
    secs: f64,
}

async fn ask(http: &reqwest::Client, url: String, text: &str, max_tokens: u32) -> Asked {
    let body = json!({"model": "smollm2-135m-instruct", "max_tokens": max_tokens, "temperature": 0, "messages": [{"role": "user", "content": text}]});
    let t = Instant::now();
    let r = tokio::time::timeout(Duration::from_secs(180), http.post(url).json(&body).send()).await.expect("an answer in time").unwrap();
    let served_by = r.headers().get("zerolayer-worker").map(|v| v.to_str().unwrap().to_string()).unwrap_or_default();
    let v: Value = r.json().await.unwrap();
    let secs = t.elapsed().as_secs_f64();
    let u = &v["usage"];
    let n = |k: &str| u[k].as_u64().unwrap_or_else(|| panic!("usage.{k} in {v}"));
    let input = n("input_tokens") + n("cache_read_input_tokens") + u["cache_creation_input_tokens"].as_u64().unwrap_or(0);
    Asked { served_by, input, cached: n("cache_read_input_tokens"), text: v["content"][0]["text"].as_str().unwrap_or_else(|| panic!("{v}")).to_string(), secs }
}

/// Drains node `i` and waits until every node sees it draining.
async fn drain(cluster: &TestCluster, i: usize) {
    let http = reqwest::Client::new();
    let id = &cluster.nodes[i].id;
    let r: Value = http.post(cluster.nodes[i].url(&format!("/admin/nodes/{id}/drain"))).send().await.unwrap().json().await.unwrap();
    assert_eq!(r["draining"], true, "{r}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cluster.nodes.iter().all(|n| n.frontend.cluster.nodes().iter().any(|x| &x.id == id && x.state == NodeState::Draining)) {
        assert!(Instant::now() < deadline, "every node sees {id} draining");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `/metrics` of node `i` (in-process nodes share one recorder: series are told apart by `node`).
async fn metrics_page(cluster: &TestCluster, i: usize) -> String {
    reqwest::get(cluster.nodes[i].url("/metrics")).await.unwrap().text().await.unwrap()
}

/// Two nodes (a drain warming up `warm_chains` chains): a long prompt answered on a, the
/// prefix index synced, then a drained. Returns the cluster, the prompt and a's answer.
async fn held_by_a_then_drained(tag: &str, warm_chains: u32) -> (TestCluster, String, Asked) {
    let cluster = TestCluster::start(2, |c| c.cluster.drain_warm_chains = warm_chains).await;
    cluster.wait_converged(&[0, 1], Duration::from_secs(20)).await;
    let prompt = long_prompt(tag);
    let on_a = ask(&reqwest::Client::new(), cluster.nodes[0].url("/v1/messages"), &prompt, 8).await;
    assert_eq!(on_a.served_by, "a/cpu0");
    cluster.wait_index_synced(&[0, 1], Duration::from_secs(10)).await;
    drain(&cluster, 0).await;
    (cluster, prompt, on_a)
}

async fn fetches(cluster: &TestCluster, i: usize, outcome: &str) -> f64 {
    let page = metrics_page(cluster, i).await;
    metric_with(&page, "zerolayer_kv_fetches_total", &[("node", &cluster.nodes[i].id), ("direction", "in"), ("outcome", outcome)]).unwrap_or(0.0)
}

/// Acceptance: after the holder of a ~2,000-token prefix is drained, the same prompt sent to
/// the other node reads at least 90% of it from cache (fetched over QUIC), answers exactly
/// what the holder answered, and its time to first token is at most half a cold prompt's of
/// the same length, measured in this run.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_drained_holders_prefix_is_fetched_not_recomputed() {
    let _g = heavy();
    // No warm-up: the drain leaves the prefix on a, which b must fetch.
    let cluster = TestCluster::start(2, |c| c.cluster.drain_warm_chains = 0).await;
    cluster.wait_converged(&[0, 1], Duration::from_secs(20)).await;
    let http = reqwest::Client::new();
    let (a, b) = (cluster.nodes[0].url("/v1/messages"), cluster.nodes[1].url("/v1/messages"));
    // A warm-up on each node (the first prompt pays for page faults), then the cold reference
    // on b: a prompt of the same shape that nothing caches.
    for url in [&a, &b] {
        ask(&http, url.clone(), &long_prompt("warm"), 1).await;
    }
    let cold = ask(&http, b.clone(), &long_prompt("cold"), 1).await;
    assert_eq!(cold.served_by, "b/cpu0");
    assert!(cold.cached < cold.input / 10, "the cold prompt is cold: {} of {} cached", cold.cached, cold.input);
    let prompt = long_prompt("held");
    let on_a = ask(&http, a.clone(), &prompt, 8).await;
    assert_eq!(on_a.served_by, "a/cpu0");
    assert!(on_a.input > 1_700, "a ~2,000-token prompt: {}", on_a.input);
    cluster.wait_index_synced(&[0, 1], Duration::from_secs(10)).await;
    drain(&cluster, 0).await;
    let before = fetches(&cluster, 1, "ok").await;
    let fetched = ask(&http, b.clone(), &prompt, 1).await;
    assert_eq!(fetched.served_by, "b/cpu0", "a drains: b runs it");
    let page = metrics_page(&cluster, 1).await;
    let lines: Vec<&str> = page.lines().filter(|l| l.contains("kv_fetch") || l.contains("placements_total")).collect();
    assert!(fetches(&cluster, 1, "ok").await > before, "b fetched the prefix ({} of {} cached): {lines:#?}", fetched.cached, fetched.input);
    assert!(fetched.cached * 10 >= fetched.input * 9, "at least 90% read from cache: {} of {}", fetched.cached, fetched.input);
    eprintln!("cold TTFT {:.3}s, fetched TTFT {:.3}s ({} of {} tokens cached)", cold.secs, fetched.secs, fetched.cached, fetched.input);
    assert!(fetched.secs * 2.0 <= cold.secs, "TTFT {:.3}s with the fetch, {:.3}s cold", fetched.secs, cold.secs);
    // The fetched KV is the holder's, bit for bit: the same greedy answer.
    let again = ask(&http, b.clone(), &prompt, 8).await;
    assert_eq!(again.text, on_a.text);
    let page = metrics_page(&cluster, 1).await;
    let tokens = metric_with(&page, "zerolayer_kv_fetched_tokens_total", &[("node", "b")]).unwrap_or(0.0);
    assert!(tokens >= 0.9 * fetched.input as f64, "fetched tokens counted: {tokens}");
    let out = metric_with(&page, "zerolayer_kv_fetch_bytes_total", &[("node", "a"), ("direction", "out")]).unwrap_or(0.0);
    assert!(out > 0.0, "a counts the bytes it served");
    // The workers' own signals (`zerolayer status`'s "kv in/out") count the blocks.
    let signals = |i: usize| cluster.nodes[i].frontend.cluster.local_worker("cpu0").unwrap().handle.signals();
    let deadline = Instant::now() + Duration::from_secs(5);
    while signals(1).kv_blocks_imported_total * u64::from(signals(1).block_size) < fetched.input * 9 / 10 || signals(0).kv_blocks_served_total == 0 {
        assert!(Instant::now() < deadline, "signals count the blocks: {:?} in on b, {:?} out of a", signals(1).kv_blocks_imported_total, signals(0).kv_blocks_served_total);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A fetch whose holder dies while it waits for the blocks fails, and the request recomputes
/// its prefix: the answer is exactly the holder's.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fetch_from_a_dying_holder_falls_back_to_recomputing() {
    let _g = heavy();
    let (mut cluster, prompt, on_a) = held_by_a_then_drained("dying", 0).await;
    let (http, b) = (reqwest::Client::new(), cluster.nodes[1].url("/v1/messages"));
    // a's engine is held mid-step (a sequence of its own keeps it stepping), so the fetch's
    // read waits behind it; then a dies.
    let worker = cluster.nodes[0].frontend.cluster.local_worker("cpu0").unwrap().handle.clone();
    let gate = StepGate::default();
    worker.set_step_hook(Some(gate.hook())).await.unwrap();
    gate.hold();
    let _busy = worker.submit(zerolayer_common::Job::new(vec![1, 2, 3, 4, 5], zerolayer_common::SamplingParams::greedy(64))).await.unwrap();
    gate.wait_blocked(Duration::from_secs(10)).await;
    let failed_before = fetches(&cluster, 1, "failed").await;
    let asked = tokio::spawn({
        let (http, b, prompt) = (http.clone(), b.clone(), prompt.clone());
        async move { ask(&http, b, &prompt, 8).await }
    });
    tokio::time::sleep(Duration::from_millis(700)).await;
    cluster.nodes[0].kill();
    let recomputed = asked.await.unwrap();
    gate.release();
    assert_eq!(recomputed.served_by, "b/cpu0");
    assert!(fetches(&cluster, 1, "failed").await > failed_before, "the fetch failed");
    assert!(recomputed.cached < recomputed.input / 10, "recomputed: {} of {} cached", recomputed.cached, recomputed.input);
    assert_eq!(recomputed.text, on_a.text, "the same output");
}

/// A drain's warm-up: the drained node's cached prefix (no sequence holds it) is copied to the
/// other node, so that after the drained node is gone the prompt still reads at least 90% of
/// itself from cache there, with the same answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_drain_copies_its_hot_prefixes_before_the_node_goes() {
    let _g = heavy();
    let (mut cluster, prompt, on_a) = held_by_a_then_drained("warmed", 32).await;
    let (http, b) = (reqwest::Client::new(), cluster.nodes[1].url("/v1/messages"));
    let report_url = cluster.nodes[0].url("/admin/nodes/a/drain");
    let deadline = Instant::now() + Duration::from_secs(30);
    let report = loop {
        let r: Value = http.get(&report_url).send().await.unwrap().json().await.unwrap();
        if r["warm_ms"].as_u64().unwrap_or(0) > 0 || r["warmed_chains"].as_u64().unwrap_or(0) > 0 {
            break r;
        }
        assert!(Instant::now() < deadline, "the warm-up ends: {r}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(report["warmed_chains"].as_u64().unwrap() >= 1, "{report}");
    cluster.nodes[0].kill();
    let after = ask(&http, b.clone(), &prompt, 8).await;
    assert_eq!(after.served_by, "b/cpu0");
    assert!(after.cached * 10 >= after.input * 9, "at least 90% read from cache after a is gone: {} of {}", after.cached, after.input);
    assert_eq!(after.text, on_a.text, "the same answer");
}
