//! A whole cluster in one process: three nodes on 127.0.0.1:0, each with a CPU worker on the
//! real model, joined over real QUIC with mutual TLS and chitchat gossip. Every claim is an
//! assertion on responses (`zerolayer-worker`, usage) or on the nodes' views, never on logs.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::time::timeout;
use zerolayer_common::PlacementPolicy;
use zerolayer_coordinator::view::NodeState;
use zerolayer_coordinator::cluster::frames::read_reply;
use zerolayer_tests::{ask, document, heavy, parse_sse, shuffled, Answer, TestCluster, LOREM};

const PREFIXES: usize = 8;
const ROUNDS: usize = 3;

/// An answer and the document it asked about.
struct Outcome {
    prefix: usize,
    answer: Answer,
}

impl std::ops::Deref for Outcome {
    type Target = Answer;
    fn deref(&self) -> &Answer {
        &self.answer
    }
}

/// Sends `ROUNDS` requests for each of `PREFIXES` documents, round-robin over the nodes' HTTP
/// ports, one at a time, in a fixed shuffled order per round. Between rounds it waits until
/// every node's prefix index has caught up. Returns (prefix-hit ratio, requests whose prefix
/// was already cached somewhere that were served where it was cached, such requests).
async fn prefix_workload(cluster: &TestCluster, tag: &str) -> (f64, usize, usize, Vec<Outcome>) {
    let http = reqwest::Client::new();
    let live: Vec<usize> = (0..cluster.nodes.len()).collect();
    let mut outcomes = Vec::new();
    let mut home: HashMap<usize, Vec<String>> = HashMap::new();
    let (mut on_home, mut warm) = (0, 0);
    let mut k = 0;
    for round in 0..ROUNDS {
        for p in shuffled(PREFIXES, 0x9e37_79b9 + round as u64) {
            let node = &cluster.nodes[k % cluster.nodes.len()];
            k += 1;
            let text = format!("{}\n\nQuestion {round}: what is this document about?", document(p, tag));
            let o = Outcome { prefix: p, answer: ask(&http, &node.url("/v1/messages"), &text, 2).await };
            if let Some(h) = home.get(&p) {
                warm += 1;
                if h.contains(&o.served_by) {
                    on_home += 1;
                }
            }
            home.entry(p).or_default().push(o.served_by.clone());
            outcomes.push(o);
        }
        cluster.wait_index_synced(&live, Duration::from_secs(10)).await;
    }
    let first = outcomes[0].input_tokens + outcomes[0].cached_tokens;
    assert!((600..700).contains(&first), "documents are ~600-token prefixes, got {first}");
    let input: u64 = outcomes.iter().map(|o| o.input_tokens + o.cached_tokens).sum();
    let cached: u64 = outcomes.iter().map(|o| o.cached_tokens).sum();
    (cached as f64 / input as f64, on_home, warm, outcomes)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_nodes_place_by_cache_load_and_liveness() {
    let _g = heavy();
    let t0 = Instant::now();
    // Without remote prefix fetch: step 4 needs a request forwarded to the one node that caches
    // its document, where a fetch could run it on a instead (`prefix_fetch.rs` tests fetches).
    let mut cluster = TestCluster::start(3, |c| {
        c.placement.policy = PlacementPolicy::CacheAware;
        c.placement.fetch = false;
    })
    .await;
    cluster.wait_converged(&[0, 1, 2], Duration::from_secs(15)).await;
    eprintln!("3 nodes ready after {:.1}s", t0.elapsed().as_secs_f64());
    let http = reqwest::Client::new();
    // No node may call a live one dead, however loaded the machine is (a watcher samples every
    // node's view until the kill in step 4).
    let watching = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let views: Vec<_> = cluster.nodes.iter().map(|n| n.frontend.cluster.clone()).collect();
    let w2 = watching.clone();
    let watcher = tokio::spawn(async move {
        let mut samples = 0u64;
        while w2.load(std::sync::atomic::Ordering::Acquire) {
            for v in &views {
                let dead: Vec<String> = v.nodes().into_iter().filter(|n| !n.local && n.state == NodeState::Dead).map(|n| n.id).collect();
                assert!(dead.is_empty(), "{} saw live nodes {dead:?} as dead", v.node_id);
            }
            samples += 1;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        samples
    });

    // 1. Cache-aware placement: requests for a cached document go where it is cached.
    let (ca_ratio, on_home, warm, outcomes) = prefix_workload(&cluster, "ca").await;
    let remote = outcomes.iter().enumerate().filter(|(k, o)| !o.served_by.starts_with(&format!("{}/", cluster.nodes[k % 3].id))).count();
    eprintln!("({:.1}s) cache_aware: prefix-hit ratio {ca_ratio:.3};", t0.elapsed().as_secs_f64());
    eprintln!("cache_aware: {on_home}/{warm} warm requests on a worker caching their document; {remote} of 24 forwarded");
    assert!(on_home * 10 >= warm * 8, "most warm requests land where their prefix is cached ({on_home}/{warm})");
    assert!(remote > 0, "some requests must have crossed nodes");
    for p in 0..PREFIXES {
        let by: Vec<&str> = outcomes.iter().filter(|o| o.prefix == p).map(|o| o.served_by.as_str()).collect();
        eprintln!("document {p}: served by {by:?}");
    }

    // 2. Saturation: a burst at node a spills onto the other nodes' workers.
    let a = cluster.nodes[0].url("/v1/messages");
    let burst: Vec<_> = (0..6)
        .map(|i| {
            let http = http.clone();
            let a = a.clone();
            let text = format!("Burst {i}: {LOREM} {LOREM}");
            tokio::spawn(async move { ask(&http, &a, &text, 8).await.served_by })
        })
        .collect();
    let mut served = Vec::new();
    for b in burst {
        served.push(b.await.unwrap());
    }
    eprintln!("burst sent to a served by {served:?} ({:.1}s)", t0.elapsed().as_secs_f64());
    assert!(served.iter().any(|s| s.starts_with("a/")), "the local worker takes its share");
    assert!(served.iter().any(|s| !s.starts_with("a/")), "once a is busy, requests sent to a are served by b's or c's worker");

    // Documents that live on exactly one node other than a (a forwards them there).
    let remote_docs: Vec<(usize, usize)> = (0..PREFIXES)
        .filter_map(|p| {
            let by: Vec<&str> = outcomes.iter().filter(|o| o.prefix == p).map(|o| o.served_by.as_str()).collect();
            let owner = cluster.nodes.iter().position(|n| by.iter().all(|s| *s == format!("{}/cpu0", n.id)))?;
            (owner != 0).then_some((p, owner))
        })
        .collect();
    assert!(!remote_docs.is_empty(), "some document must live only on b or c");

    // 3. A client that disconnects from a forwarded stream cancels the sequence on its owner.
    let (b_doc, owner) = remote_docs[remote_docs.len() - 1];
    let owner_worker = &cluster.nodes[owner].frontend.workers[0].handle;
    let generated_before = owner_worker.signals().generated_tokens_total;
    // `ignore_eos` (the OpenAI route): the sequence cannot end early on its own, so stopping
    // short of max_tokens proves the cancellation.
    let body = json!({"model": "smollm2-135m-instruct", "max_tokens": 400, "temperature": 0, "stream": true, "ignore_eos": true,
                      "messages": [{"role": "user", "content": format!("{}\n\nQuestion 8: write a long essay about it.", document(b_doc, "ca"))}]});
    let mut resp = http.post(cluster.nodes[0].url("/v1/chat/completions")).json(&body).send().await.unwrap();
    assert_eq!(resp.headers()["zerolayer-worker"].to_str().unwrap(), format!("{}/cpu0", cluster.nodes[owner].id));
    let mut seen = String::new();
    while seen.matches("\"content\":").count() < 3 {
        let chunk = timeout(Duration::from_secs(30), resp.chunk()).await.expect("first tokens").unwrap().expect("stream open");
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    // The owner's published signals have seen the sequence run.
    let deadline = Instant::now() + Duration::from_secs(10);
    while owner_worker.signals().generated_tokens_total == generated_before {
        assert!(Instant::now() < deadline, "the owner's signals show the sequence");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    drop(resp);
    let dropped_at = Instant::now();
    let at_drop = owner_worker.signals().at_ms;
    loop {
        let s = owner_worker.signals();
        // A snapshot taken after the drop, showing the worker idle.
        if s.at_ms > at_drop && s.running == 0 && s.waiting == 0 {
            let generated = s.generated_tokens_total - generated_before;
            assert!((1..200).contains(&generated), "the owner ran the sequence and stopped early ({generated} of 400 tokens)");
            eprintln!("client disconnect cancelled the forwarded sequence on its owner after {generated} tokens, {:.2}s after the drop", dropped_at.elapsed().as_secs_f64());
            break;
        }
        assert!(dropped_at.elapsed() < Duration::from_secs(5), "the owner must cancel within seconds of the client leaving");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // 4. A node dies mid-request: the stream goes on (the coordinator holding the client replays
    //    prompt + delivered tokens on a survivor) and the client gets exactly the text an
    //    undisturbed run gets. A document only the victim caches is sent to a, so a forwards it
    //    there.
    let (c_doc, victim) = remote_docs[0];
    let victim_id = cluster.nodes[victim].id.clone();
    let survivors: Vec<usize> = (0..3).filter(|&i| i != victim).collect();
    let body = json!({"model": "smollm2-135m-instruct", "max_tokens": 120, "temperature": 0, "stream": true,
                      "messages": [{"role": "user", "content": format!("{}\n\nQuestion 9: write a long essay about it.", document(c_doc, "ca"))}]});
    let streamed_text = |raw: &str| -> String { parse_sse(raw).iter().filter_map(|(_, d)| d["delta"]["text"].as_str().map(str::to_string)).collect() };
    let undisturbed = http.post(&a).json(&body).send().await.unwrap();
    assert_eq!(undisturbed.headers()["zerolayer-worker"].to_str().unwrap(), format!("{victim_id}/cpu0"));
    let undisturbed = streamed_text(&undisturbed.text().await.unwrap());
    let mut resp = http.post(&a).json(&body).send().await.unwrap();
    assert_eq!(resp.headers()["zerolayer-worker"].to_str().unwrap(), format!("{victim_id}/cpu0"), "the request must be forwarded to the victim");
    let mut text = String::new();
    while text.matches("content_block_delta").count() < 3 {
        let chunk = timeout(Duration::from_secs(30), resp.chunk()).await.expect("first tokens").unwrap().expect("stream open");
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    watching.store(false, std::sync::atomic::Ordering::Release);
    let samples = watcher.await.unwrap();
    eprintln!("no false dead-node verdict in {samples} samples of every node's view under load");
    let killed_at = Instant::now();
    cluster.nodes[victim].kill();
    let rest = timeout(Duration::from_secs(120), async {
        while let Some(chunk) = resp.chunk().await.unwrap_or(None) {
            text.push_str(&String::from_utf8_lossy(&chunk));
        }
    })
    .await;
    assert!(rest.is_ok(), "the stream must finish, not hang");
    let events = parse_sse(&text);
    assert_eq!(events.last().unwrap().0, "message_stop", "the stream completes: {text}");
    assert!(!events.iter().any(|(n, _)| n == "error"), "no error event: {text}");
    assert_eq!(streamed_text(&text), undisturbed, "exactly the undisturbed text, after a replay on a survivor");
    eprintln!("a stream whose node died finished on a survivor {:.2}s after the kill, with the undisturbed text", killed_at.elapsed().as_secs_f64());

    // 5. The others mark the victim dead and stop placing on it.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let dead = survivors
            .iter()
            .all(|&i| cluster.nodes[i].frontend.cluster.nodes().iter().any(|n| n.id == victim_id && n.state == NodeState::Dead));
        if dead {
            break;
        }
        assert!(Instant::now() < deadline, "the survivors must mark {victim_id} dead within 15 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!("{victim_id} marked dead by the others {:.2}s after it was killed", killed_at.elapsed().as_secs_f64());
    for (k, p) in (0..PREFIXES).enumerate() {
        // Even documents the victim cached must now be served by the survivors.
        let node = &cluster.nodes[survivors[k % 2]];
        let o = ask(&http, &node.url("/v1/messages"), &format!("{}\n\nQuestion 7: who wrote it?", document(p, "ca")), 2).await;
        assert!(!o.served_by.starts_with(&format!("{victim_id}/")), "placed on a dead node: {}", o.served_by);
    }
    let admin: Value = http.get(cluster.nodes[0].url("/admin/cluster")).send().await.unwrap().json().await.unwrap();
    let mut states: Vec<(String, String)> =
        admin["nodes"].as_array().unwrap().iter().map(|n| (n["id"].as_str().unwrap().into(), n["state"].as_str().unwrap().into())).collect();
    states.sort();
    let want: Vec<(String, String)> =
        ["a", "b", "c"].iter().map(|id| (id.to_string(), if *id == victim_id { "dead" } else { "ready" }.to_string())).collect();
    assert_eq!(states, want);

    // 6. An owner that cannot be reached: the other survivor caches a fresh document, then
    //    dies. Right after (a peer is called dead only after 1.5 s of silence) a request for
    //    that document sent to a is placed on it first; forwarding fails, and the next
    //    candidate (a itself) serves it.
    let other = survivors.iter().copied().find(|&i| i != 0).unwrap();
    let other_id = cluster.nodes[other].id.clone();
    let fresh = format!("{}\n\nQuestion 11: summarize it.", document(99, "unreachable"));
    let first = ask(&http, &cluster.nodes[other].url("/v1/messages"), &fresh, 2).await;
    assert_eq!(first.served_by, format!("{other_id}/cpu0"), "a fresh document stays on the node it was sent to");
    cluster.wait_index_synced(&[0, other], Duration::from_secs(10)).await;
    let failures = |page: &str| zerolayer_tests::metric_with(page, "zerolayer_forward_failures_total", &[("node", "a"), ("peer", &other_id)]).unwrap_or(0.0);
    let before = failures(&http.get(cluster.nodes[0].url("/metrics")).send().await.unwrap().text().await.unwrap());
    cluster.nodes[other].kill();
    let retried = ask(&http, &a, &fresh, 2).await;
    assert_eq!(retried.served_by, "a/cpu0", "the next candidate serves it");
    let after = failures(&http.get(cluster.nodes[0].url("/metrics")).send().await.unwrap().text().await.unwrap());
    assert!(after > before, "a tried the unreachable owner first ({before} -> {after})");
    eprintln!("a request placed on an unreachable owner was served by the next candidate after {:.2}s", retried.secs);
    drop(cluster);
    eprintln!("({:.1}s) round-robin run starts", t0.elapsed().as_secs_f64());

    // 7. The same workload under round-robin placement, on a fresh cluster.
    let rr_cluster = TestCluster::start(3, |c| c.placement.policy = PlacementPolicy::RoundRobin).await;
    rr_cluster.wait_converged(&[0, 1, 2], Duration::from_secs(15)).await;
    let (rr_ratio, rr_home, rr_warm, _) = prefix_workload(&rr_cluster, "rr").await;
    eprintln!("round_robin: prefix-hit ratio {rr_ratio:.3}; {rr_home}/{rr_warm} warm requests on a worker caching their document");
    assert!(ca_ratio >= 2.0 * rr_ratio, "cache_aware hit ratio {ca_ratio:.3} must be at least 2x round_robin's {rr_ratio:.3}");
    eprintln!("total {:.1}s", t0.elapsed().as_secs_f64());
}

/// Cluster links without a model: what mutual TLS lets in and keeps out.
/// An admin call for another node goes over the cluster link, not HTTP: it works while the
/// target's gossiped HTTP address leads nowhere. The target checks the caller's key against
/// its own admin key, as its own admin API would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_calls_for_another_node_go_over_the_cluster_link() {
    let _g = heavy();
    const ADMIN: &str = "sk-admin-0123456789";
    let cluster = TestCluster::start(2, |c| c.auth.admin_key = Some(ADMIN.into())).await;
    cluster.wait_converged(&[0, 1], Duration::from_secs(15)).await;
    let (a, b) = (&cluster.nodes[0], &cluster.nodes[1]);
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    b.frontend.cluster.set_http_addr(closed.clone());
    let deadline = Instant::now() + Duration::from_secs(10);
    while !a.frontend.cluster.nodes().iter().any(|n| n.id == "b" && n.http == closed) {
        assert!(Instant::now() < deadline, "a learns b's new (dead) HTTP address");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let http = reqwest::Client::new();
    let call = |method: reqwest::Method, action: &str, key: &str| http.request(method, a.url(&format!("/admin/nodes/b/{action}"))).header("x-api-key", key).send();
    let r = call(reqwest::Method::POST, "drain", ADMIN).await.unwrap();
    assert_eq!(r.status(), 200);
    let report: Value = r.json().await.unwrap();
    assert_eq!((report["node"].as_str(), report["draining"].as_bool()), (Some("b"), Some(true)), "{report}");
    assert_eq!(b.frontend.cluster.state(), NodeState::Draining);
    let r: Value = call(reqwest::Method::GET, "drain", ADMIN).await.unwrap().json().await.unwrap();
    assert_eq!(r["node"], "b", "the report comes from b: {r}");
    let r = call(reqwest::Method::POST, "undrain", ADMIN).await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(b.frontend.cluster.state(), NodeState::Ready);
    // a refuses a wrong key itself; b refuses one that a let through (here, handed to b's
    // side directly), in the Anthropic error shape.
    assert_eq!(call(reqwest::Method::POST, "drain", "sk-wrong").await.unwrap().status(), 401);
    use zerolayer_common::wire::AdminCall;
    use zerolayer_coordinator::frontend::api::admin::serve_peer;
    for key in ["", "sk-wrong"] {
        let (status, body) = serve_peer(b.frontend.clone(), AdminCall { origin_node: "a".into(), action: "drain".into(), key: key.into(), arg: String::new() }).await;
        let body: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!((status, body["error"]["type"].as_str()), (401, Some("authentication_error")), "key {key:?}: {body}");
    }
    assert_eq!(b.frontend.cluster.state(), NodeState::Ready, "a refused call changes nothing");
}

/// A job forwarded to a node runs under that node's terms for the tenant it claims: the cache
/// root the sender set is replaced by the claim's own scope (so a job claimed for alice with
/// bob's root reads nothing of bob's cache), and a tenant the node does not know is refused, as
/// are sampling parameters outside every API's bounds (a NaN, a huge penalty, a 1 MiB stop
/// sequence, a biased token outside the vocabulary).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forwarded_job_runs_under_the_receivers_terms() {
    use zerolayer_common::config::KeyConfig;
    use zerolayer_common::wire::{self, Open, Reply, Submit};
    use zerolayer_common::{Job, SamplingParams, SeqEvent, TenantClaim};
    use zerolayer_coordinator::cluster::tls;
    let _g = heavy();
    let cluster = TestCluster::start(2, |c| {
        c.auth.keys = ["alice", "bob"].iter().map(|n| KeyConfig { name: n.to_string(), key: format!("sk-{n}-0123456789"), ..Default::default() }).collect();
    })
    .await;
    cluster.wait_converged(&[0, 1], Duration::from_secs(15)).await;
    let b = &cluster.nodes[1];
    let mat = tls::TlsMaterial::load(&cluster.tls_dir, "a").unwrap();
    let secret = zerolayer_common::cluster_secret(&mat.ca);
    let client = tls::endpoint(std::net::UdpSocket::bind("127.0.0.1:0").unwrap(), &mat, Duration::from_secs(5)).unwrap();
    let conn = client.connect(b.frontend.cluster.quic_addr().unwrap(), tls::SERVER_NAME).unwrap().await.unwrap();
    let prompt: Vec<u32> = (0..64).map(|i| 100 + i * 7).collect();
    // As node a would send it: the claim, and the root the sender computed.
    let submit_with = |params: SamplingParams, tenant: &str, root_scope: &str, id: &str| {
        let job = Job { request_id: id.into(), ..Job::new(prompt.clone(), params) }
            .claimed(TenantClaim { tenant: tenant.into(), cache_salt: None })
            .scoped(zerolayer_common::scope_root(&secret, root_scope));
        let conn = conn.clone();
        async move {
            let (mut s, mut r) = conn.open_bi().await.unwrap();
            s.write_all(&wire::encode_open(&Open::Submit(Submit { origin_node: "a".into(), worker: "cpu0".into(), job, fetch: None })).unwrap()).await.unwrap();
            loop {
                match read_reply(&mut r).await.unwrap() {
                    Reply::Event(SeqEvent::Finished { usage, .. }) => return Ok(usage),
                    Reply::Refused { message, .. } => return Err(message),
                    _ => {}
                }
            }
        }
    };
    let submit = |tenant: &str, root_scope: &str, id: &str| submit_with(SamplingParams::greedy(1), tenant, root_scope, id);
    let first = submit("bob", "key:bob", "req_bob_1").await.unwrap();
    assert_eq!(first.prompt_tokens_cached, 0);
    let again = submit("bob", "key:bob", "req_bob_2").await.unwrap();
    assert!(again.prompt_tokens_cached >= 56, "bob reads his own prefix: {again:?}");
    let forged = submit("alice", "key:bob", "req_alice").await.unwrap();
    assert_eq!(forged.prompt_tokens_cached, 0, "a job claimed for alice reads nothing of bob's cache, whatever root it came with");
    let unknown = submit("mallory", "key:bob", "req_mallory").await.unwrap_err();
    assert!(unknown.contains("not configured"), "{unknown}");
    // Sampling parameters no API accepts are refused as a client's would be, and b serves on.
    let bad = [
        (SamplingParams { temperature: f32::NAN, ..SamplingParams::greedy(1) }, "temperature"),
        (SamplingParams { presence_penalty: 1e30, ..SamplingParams::greedy(1) }, "presence_penalty"),
        (SamplingParams { top_p: Some(0.0), temperature: 1.0, ..SamplingParams::greedy(1) }, "top_p"),
        (SamplingParams { stop_sequences: vec!["x".repeat(1 << 20)], ..SamplingParams::greedy(1) }, "stop_sequences"),
        (SamplingParams { logit_bias: vec![(u32::MAX, 1.0)], ..SamplingParams::greedy(1) }, "vocabulary"),
    ];
    for (i, (params, says)) in bad.into_iter().enumerate() {
        let refused = submit_with(params, "bob", "key:bob", &format!("req_bad_{i}")).await.unwrap_err();
        assert!(refused.contains(says), "{says}: {refused}");
    }
    assert!(submit("bob", "key:bob", "req_bob_3").await.is_ok(), "b still serves");
}

mod mtls {
    use super::*;
    use zerolayer_coordinator::cluster::{tls, Cluster};

    pub(super) fn config(ids: &[(&str, std::net::SocketAddr)], tls_dir: &std::path::Path) -> zerolayer_common::ClusterConfig {
        let mut c = zerolayer_common::ClusterConfig::default();
        c.cluster.tls_dir = Some(tls_dir.to_path_buf());
        let template = c.nodes[0].clone();
        c.nodes = ids
            .iter()
            .map(|(id, addr)| {
                let mut n = template.clone();
                n.id = id.to_string();
                n.quic = Some(addr.to_string());
                n
            })
            .collect();
        c
    }

    pub(super) fn sock() -> (std::net::UdpSocket, std::net::SocketAddr) {
        let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let a = s.local_addr().unwrap();
        (s, a)
    }

    /// A dial that means a node reaches that node or nobody: b's address, dialed as a, is
    /// refused even though b's certificate chains to the cluster CA and names the cluster's
    /// shared name (gossip still dials by address).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dial_reaches_the_node_it_means_or_nobody() {
        let _g = heavy();
        let dir = zerolayer_tests::temp_dir("ca-dial");
        tls::init(&dir, &["a".into(), "b".into()], false).unwrap();
        let ((sa, aa), (sb, ab)) = (sock(), sock());
        let cfg = config(&[("a", aa), ("b", ab)], &dir);
        let a = Cluster::start(&cfg, "a", &[], Some(sa), zerolayer_coordinator::quota::Quota::new(vec![])).await.unwrap();
        let b = Cluster::start(&cfg, "b", &[], Some(sb), zerolayer_coordinator::quota::Quota::new(vec![])).await.unwrap();
        let peers = &a.net.as_ref().unwrap().peers;
        peers.connect_node(ab, "b").await.expect("b is b");
        let e = peers.connect_node(ab, "a").await.expect_err("b's address dialed as a").to_string();
        assert!(e.contains("is not a"), "{e}");
        peers.connect(ab).await.expect("by address alone, as gossip dials");
        drop((a, b));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_node_from_another_ca_is_refused() {
        // Not beside the model-heavy cluster test: its timing must not depend on that load.
        let _g = heavy();
        let good = zerolayer_tests::temp_dir("ca-good");
        let evil = zerolayer_tests::temp_dir("ca-evil");
        tls::init(&good, &["a".into(), "b".into()], false).unwrap();
        tls::init(&evil, &["x".into()], false).unwrap();
        let ((sa, aa), (sb, ab), (sx, ax)) = (sock(), sock(), sock());
        // x claims to be part of the same cluster and seeds from a, with its own CA.
        let good_cfg = config(&[("a", aa), ("b", ab), ("x", ax)], &good);
        let evil_cfg = config(&[("a", aa), ("x", ax)], &evil);
        let a = Cluster::start(&good_cfg, "a", &[], Some(sa), zerolayer_coordinator::quota::Quota::new(vec![])).await.unwrap();
        let b = Cluster::start(&good_cfg, "b", &[], Some(sb), zerolayer_coordinator::quota::Quota::new(vec![])).await.unwrap();
        let x = Cluster::start(&evil_cfg, "x", &[], Some(sx), zerolayer_coordinator::quota::Quota::new(vec![])).await.unwrap();

        // The control: b (same CA) joins a.
        let deadline = Instant::now() + Duration::from_secs(10);
        while !(a.nodes().iter().any(|n| n.id == "b") && b.nodes().iter().any(|n| n.id == "a")) {
            assert!(Instant::now() < deadline, "a and b (same CA) must see each other");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // x keeps trying (it gossips every 100 ms); give it as long as b needed, and more.
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(!a.nodes().iter().any(|n| n.id == "x"), "a must not let x join");
        assert!(!b.nodes().iter().any(|n| n.id == "x"), "nor learn of x through a");
        assert!(!x.nodes().iter().any(|n| n.id == "a"), "x must not learn the cluster's state");

        // A real forwarded-request frame: with the cluster's own certificate it reaches a's
        // request handler and gets a `Reply` (a has no workers, so a refusal that names it);
        // with a foreign certificate, the same frame is refused at the TLS layer.
        let good_mat = tls::TlsMaterial::load(&good, "b").unwrap();
        let evil_mat = tls::TlsMaterial::load(&evil, "x").unwrap();
        let mixed = tls::TlsMaterial { ca: good_mat.ca.clone(), chain: evil_mat.chain.clone(), key: evil_mat.key.clone_key() };
        let frame = zerolayer_common::wire::encode_open(&zerolayer_common::wire::Open::Submit(zerolayer_common::wire::Submit {
            origin_node: "b".into(),
            worker: "cpu0".into(),
            job: zerolayer_common::Job { request_id: "req_mtls".into(), ..zerolayer_common::Job::new(vec![1, 2, 3], zerolayer_common::SamplingParams::greedy(4)) },
            fetch: None,
        }))
        .unwrap();
        let submit = |mat: tls::TlsMaterial| {
            let frame = frame.clone();
            async move {
                let client = tls::endpoint(std::net::UdpSocket::bind("127.0.0.1:0").unwrap(), &mat, Duration::from_secs(2)).unwrap();
                let conn = client.connect(aa, tls::SERVER_NAME)?.await?;
                // TLS 1.3 client auth fails after the client's handshake completes: the first
                // use of the connection fails.
                let (mut s, mut r) = conn.open_bi().await?;
                s.write_all(&frame).await?;
                read_reply(&mut r).await
            }
        };
        let refused = timeout(Duration::from_secs(10), submit(mixed)).await.expect("refusal must be prompt");
        assert!(refused.is_err(), "a frame under a certificate from another CA must be refused: {refused:?}");
        let reply = timeout(Duration::from_secs(10), submit(good_mat)).await.expect("an answer").expect("the cluster's own certificate gets a reply");
        assert!(
            matches!(&reply, zerolayer_common::wire::Reply::Refused { message, .. } if message.contains("node a")),
            "a decoded and answered the frame: {reply:?}"
        );

        for c in [a, b, x] {
            c.kill();
        }
    }

    /// A node with a certificate from the cluster's own CA, but configured with another
    /// `cluster.id`, never joins: chitchat drops gossip from another cluster.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn gossip_from_another_cluster_id_is_ignored() {
        let _g = heavy();
        let ca = zerolayer_tests::temp_dir("ca-ids");
        tls::init(&ca, &["a".into(), "b".into(), "y".into()], false).unwrap();
        let ((sa, aa), (sb, ab), (sy, ay)) = (sock(), sock(), sock());
        let cfg = config(&[("a", aa), ("b", ab), ("y", ay)], &ca);
        let mut other = config(&[("a", aa), ("y", ay)], &ca);
        other.cluster.id = "another-cluster".into();
        let a = Cluster::start(&cfg, "a", &[], Some(sa), zerolayer_coordinator::quota::Quota::new(vec![])).await.unwrap();
        let b = Cluster::start(&cfg, "b", &[], Some(sb), zerolayer_coordinator::quota::Quota::new(vec![])).await.unwrap();
        let y = Cluster::start(&other, "y", &[], Some(sy), zerolayer_coordinator::quota::Quota::new(vec![])).await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !(a.nodes().iter().any(|n| n.id == "b") && b.nodes().iter().any(|n| n.id == "a")) {
            assert!(Instant::now() < deadline, "a and b (same cluster id) must see each other");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(!a.nodes().iter().any(|n| n.id == "y"), "a must ignore y's gossip");
        assert!(!b.nodes().iter().any(|n| n.id == "y"));
        assert!(!y.nodes().iter().any(|n| n.id == "a"), "y must not learn a's cluster");
        for c in [a, b, y] {
            c.kill();
        }
    }
}

/// Identity: a certificate holder cannot speak for another node, gossip cannot crash a node,
/// and restarts leave nothing behind. Links without a model.
mod identity {
    use super::*;
    use zerolayer_coordinator::cluster::{tls, Cluster};
    use zerolayer_coordinator::view::NodeState;
    use super::mtls::{config, sock};

    async fn until(what: &str, within: Duration, mut ok: impl FnMut() -> bool) {
        let deadline = Instant::now() + within;
        while !ok() {
            assert!(Instant::now() < deadline, "{what}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn entry(of: &Cluster, node: &str) -> Vec<(NodeState, u64, String)> {
        of.nodes().into_iter().filter(|n| n.id == node).map(|n| (n.state, n.generation, n.http)).collect()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn forged_identities_change_nothing_and_bad_gossip_is_refused() {
        let _g = heavy();
        let dir = zerolayer_tests::temp_dir("forgery");
        tls::init(&dir, &["a".into(), "b".into(), "c".into()], false).unwrap();
        let ((sa, aa), (sb, ab), (sc, ac), (sf, af)) = (sock(), sock(), sock(), sock());
        let cfg = config(&[("a", aa), ("b", ab), ("c", ac)], &dir);
        let a = Cluster::start(&cfg, "a", &[], Some(sa), zerolayer_coordinator::quota::Quota::new(vec![])).await.unwrap();
        let b = Cluster::start(&cfg, "b", &[], Some(sb), zerolayer_coordinator::quota::Quota::new(vec![])).await.unwrap();
        let c = Cluster::start(&cfg, "c", &[], Some(sc), zerolayer_coordinator::quota::Quota::new(vec![])).await.unwrap();
        for n in [&a, &b, &c] {
            n.set_state(NodeState::Ready);
        }
        until("a sees b and c ready", Duration::from_secs(10), || {
            ["b", "c"].iter().all(|id| entry(&a, id).iter().any(|(s, _, _)| *s == NodeState::Ready))
        })
        .await;
        let genuine = entry(&a, "b");

        // 1. c's certificate and key, running as "b" (a newer generation, another address),
        //    gossiping b's state, workers and cache digest.
        let forged_dir = zerolayer_tests::temp_dir("forger");
        for (from, to) in [("ca.pem", "ca.pem"), ("c.pem", "b.pem"), ("c.key", "b.key")] {
            std::fs::copy(dir.join(from), forged_dir.join(to)).unwrap();
        }
        let forger = Cluster::start(&config(&[("a", aa), ("b", af)], &forged_dir), "b", &[], Some(sf), zerolayer_coordinator::quota::Quota::new(vec![])).await.unwrap();
        forger.set_state(NodeState::Ready);
        forger.publish_for_tests("w:cpu0", r#"{"device":"cpu","max_waiting":64}"#).await;
        forger.publish_for_tests("sig:cpu0", r#"{"kv_blocks_total":100,"kv_blocks_free":100,"block_size":4}"#).await;
        forger.publish_for_tests("kv:cpu0:1", "1000000000000001").await;
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(entry(&a, "b"), genuine, "b's entry at a is unchanged");
        assert!(a.view().workers.iter().all(|w| w.node != "b"), "no worker appears for b");
        let refused = a.link_stats();
        eprintln!("a's link after the forgery: {refused:?}");

        // 2. A forwarded request that claims to come from b, over c's certificate.
        let c_mat = tls::TlsMaterial::load(&dir, "c").unwrap();
        let client = tls::endpoint(std::net::UdpSocket::bind("127.0.0.1:0").unwrap(), &c_mat, Duration::from_secs(2)).unwrap();
        let conn = client.connect(aa, tls::SERVER_NAME).unwrap().await.unwrap();
        let (mut s, mut r) = conn.open_bi().await.unwrap();
        let sub = zerolayer_common::wire::Submit {
            origin_node: "b".into(),
            worker: "cpu0".into(),
            job: zerolayer_common::Job { request_id: "req_forged".into(), ..zerolayer_common::Job::new(vec![1, 2, 3], zerolayer_common::SamplingParams::greedy(4)) },
            fetch: None,
        };
        s.write_all(&zerolayer_common::wire::encode_open(&zerolayer_common::wire::Open::Submit(sub)).unwrap()).await.unwrap();
        let reply = read_reply(&mut r).await.unwrap();
        assert!(
            matches!(&reply, zerolayer_common::wire::Reply::Refused { message, .. } if message.contains("does not name node \"b\"")),
            "a frame as b over c's certificate is refused: {reply:?}"
        );

        // 3. c, as itself, gossips a malformed and a non-ASCII value: refused, and a keeps
        //    updating its view of c.
        c.publish_for_tests("w:cpu0", r#"{"device":"cpu","max_waiting":64}"#).await;
        c.publish_for_tests("sig:cpu0", "é{{not json").await;
        c.publish_for_tests("kv:cpu0:2", "zzzzzzzzzzzzzzzzé").await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        c.set_state(NodeState::Draining);
        until("a keeps updating its view of c", Duration::from_secs(10), || entry(&a, "c").iter().any(|(s, _, _)| *s == NodeState::Draining)).await;
        assert!(a.view().workers.iter().all(|w| w.node != "c"), "c's worker with malformed signals is not in the view");
        for n in [a, b, c, forger] {
            n.kill();
        }
    }

    /// A certified peer sends gossip built to hurt: the chitchat delta that trips chitchat's
    /// assert (a key at version u64::MAX under a max version one lower), a zstd bomb, a node id
    /// that is no name, and junk: the screen drops each one (and nothing else). A delta that
    /// speaks for the target itself is cut out of its message. The target's own state is
    /// unchanged, and its gossip still runs: it sees b drain afterwards.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn hostile_gossip_cannot_stop_a_node() {
        use zerolayer_coordinator::cluster::screen::wire::{write::{bomb, encode}, Id, Kv, Message, Op};
        let _g = heavy();
        let dir = zerolayer_tests::temp_dir("hostile-gossip");
        tls::init(&dir, &["a".into(), "b".into(), "c".into()], false).unwrap();
        let ((sa, aa), (sb, ab), (_, ac)) = (sock(), sock(), sock());
        let cfg = config(&[("a", aa), ("b", ab), ("c", ac)], &dir);
        let a = Cluster::start(&cfg, "a", &[], Some(sa), zerolayer_coordinator::quota::Quota::new(vec![])).await.unwrap();
        let b = Cluster::start(&cfg, "b", &[], Some(sb), zerolayer_coordinator::quota::Quota::new(vec![])).await.unwrap();
        for n in [&a, &b] {
            n.set_state(NodeState::Ready);
        }
        until("a sees b ready", Duration::from_secs(10), || entry(&a, "b").iter().any(|(s, _, _)| *s == NodeState::Ready)).await;
        let id = |c: &Cluster| Id { node: c.node_id.clone(), generation: c.net.as_ref().unwrap().generation, addr: c.net.as_ref().unwrap().addr };
        let node = |i: Id| Op::Node { id: i, last_gc_version: 0, from_version_excluded: 0 };
        let kv = |key: &str, value: &str, version: u64| Op::Kv(Kv { key: key.into(), value: value.into(), version, status: 0 });
        let named = |name: &str| Id { node: name.into(), ..id(&b) };
        let hostile = [
            encode(&Message::Ack { delta: vec![node(id(&b)), kv("state", "draining", u64::MAX), Op::SetMaxVersion(u64::MAX - 1)] }),
            bomb(60_000),
            encode(&Message::Ack { delta: vec![node(named("b\u{0}")), kv("state", "ready", 1)] }),
            b"\x53\xb0\x00\x09 not chitchat".to_vec(),
        ];
        // Cut out of their messages: a node the config does not name, and a delta that speaks
        // for a itself.
        let cut = [
            encode(&Message::Ack { delta: vec![node(named("mallory")), kv("state", "ready", 1)] }),
            encode(&Message::Ack { delta: vec![node(id(&a)), kv("state", "draining", u64::MAX - 1)] }),
        ];
        let c_mat = tls::TlsMaterial::load(&dir, "c").unwrap();
        let client = tls::endpoint(std::net::UdpSocket::bind("127.0.0.1:0").unwrap(), &c_mat, Duration::from_secs(2)).unwrap();
        let conn = client.connect(aa, tls::SERVER_NAME).unwrap().await.unwrap();
        for m in hostile.iter().chain(&cut) {
            let mut s = conn.open_uni().await.unwrap();
            s.write_all(m).await.unwrap();
            s.finish().unwrap();
        }
        until("a's screen drops all four", Duration::from_secs(10), || a.link_stats().gossip_refused >= hostile.len() as u64).await;
        b.set_state(NodeState::Draining);
        until("a's gossip still runs: it sees b drain", Duration::from_secs(10), || entry(&a, "b").iter().any(|(s, _, _)| *s == NodeState::Draining)).await;
        assert!(entry(&b, "a").iter().all(|(s, _, _)| *s == NodeState::Ready), "a's state, as b sees it, is a's own: {:?}", entry(&b, "a"));
        assert_eq!(a.link_stats().gossip_refused, hostile.len() as u64, "only the hostile messages were refused: {:?}", a.link_stats());
        assert!(!a.nodes().iter().any(|n| n.id == "mallory"));
        for n in [a, b] {
            n.kill();
        }
    }

    /// Eviction by replay: a certificate holder runs as "b" under a newer generation and
    /// gossips b's own (public) certificate and b's signed state. Neither proves the newer
    /// generation (the signature covers b's generation and address), so a keeps b's entry.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_replayed_certificate_evicts_nobody() {
        let _g = heavy();
        let dir = zerolayer_tests::temp_dir("replay");
        tls::init(&dir, &["a".into(), "b".into(), "c".into()], false).unwrap();
        let ((sa, aa), (sb, ab), (_, ac), (sf, af)) = (sock(), sock(), sock(), sock());
        // c is a node of the cluster, so its certificate may connect (the forger holds it).
        let cfg = config(&[("a", aa), ("b", ab), ("c", ac)], &dir);
        let a = Cluster::start(&cfg, "a", &[], Some(sa), zerolayer_coordinator::quota::Quota::new(vec![])).await.unwrap();
        let b = Cluster::start(&cfg, "b", &[], Some(sb), zerolayer_coordinator::quota::Quota::new(vec![])).await.unwrap();
        for n in [&a, &b] {
            n.set_state(NodeState::Ready);
        }
        until("a sees b ready", Duration::from_secs(10), || entry(&a, "b").iter().any(|(s, _, _)| *s == NodeState::Ready)).await;
        let genuine = entry(&a, "b");
        let forged_dir = zerolayer_tests::temp_dir("replayer");
        for (from, to) in [("ca.pem", "ca.pem"), ("c.pem", "b.pem"), ("c.key", "b.key")] {
            std::fs::copy(dir.join(from), forged_dir.join(to)).unwrap();
        }
        tokio::time::sleep(Duration::from_millis(5)).await; // a later generation (ms)
        let forger = Cluster::start(&config(&[("a", aa), ("b", af)], &forged_dir), "b", &[], Some(sf), zerolayer_coordinator::quota::Quota::new(vec![])).await.unwrap();
        assert!(forger.net.as_ref().unwrap().generation > genuine[0].1);
        tokio::time::sleep(Duration::from_millis(500)).await; // its publisher has described itself once
        for key in ["cert", "state", "http"] {
            let v = b.own_gossip_for_tests(key).await.unwrap();
            forger.gossip_raw_for_tests(key, &v).await;
        }
        // The control: a holds the forger's newer generation of b, with b's certificate.
        until("a holds the forged generation", Duration::from_secs(10), || a.link_stats().gossip_node_states >= 3).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(entry(&a, "b"), genuine, "b's entry at a is b's own generation and address");
        b.set_state(NodeState::Draining);
        until("a follows b itself", Duration::from_secs(10), || entry(&a, "b").iter().any(|(s, _, _)| *s == NodeState::Draining)).await;
        for n in [a, b, forger] {
            n.kill();
        }
    }

    /// KV is taken only from a node that is draining: c's import, over c's own certificate, is
    /// refused until c drains; then it passes that check (and meets the next: a has no such
    /// worker).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn kv_comes_only_from_a_draining_node() {
        use zerolayer_common::wire::{self, BlockHeader, ImportHeader, Open, Reply};
        let _g = heavy();
        let dir = zerolayer_tests::temp_dir("imports");
        tls::init(&dir, &["a".into(), "c".into()], false).unwrap();
        let ((sa, aa), (sc, ac)) = (sock(), sock());
        let cfg = config(&[("a", aa), ("c", ac)], &dir);
        let a = Cluster::start(&cfg, "a", &[], Some(sa), zerolayer_coordinator::quota::Quota::new(vec![])).await.unwrap();
        let c = Cluster::start(&cfg, "c", &[], Some(sc), zerolayer_coordinator::quota::Quota::new(vec![])).await.unwrap();
        for n in [&a, &c] {
            n.set_state(NodeState::Ready);
        }
        until("a sees c ready", Duration::from_secs(10), || entry(&a, "c").iter().any(|(s, _, _)| *s == NodeState::Ready)).await;
        let mat = tls::TlsMaterial::load(&dir, "c").unwrap();
        let client = tls::endpoint(std::net::UdpSocket::bind("127.0.0.1:0").unwrap(), &mat, Duration::from_secs(2)).unwrap();
        let conn = client.connect(aa, tls::SERVER_NAME).unwrap().await.unwrap();
        let import = || async {
            let h = ImportHeader {
                request_id: "req_import".into(),
                origin_node: "c".into(),
                worker: "cpu0".into(),
                block_size: 4,
                block_bytes: 8,
                tokens: vec![1, 2, 3, 4],
                cache_root: 1,
                blocks: vec![BlockHeader { hash: 1, checksum: 2, sent: true }],
            };
            let (mut s, mut r) = conn.open_bi().await.unwrap();
            s.write_all(&wire::encode_open(&Open::Import(h)).unwrap()).await.unwrap();
            match read_reply(&mut r).await.unwrap() {
                Reply::Refused { message, .. } => message,
                other => panic!("an import with no worker to take it: {other:?}"),
            }
        };
        let t0 = Instant::now();
        let refused = import().await;
        assert!(refused.contains("c is not draining"), "{refused}");
        assert!(t0.elapsed() >= Duration::from_secs(2), "a waits for gossip before it refuses");
        c.set_state(NodeState::Draining);
        let refused = import().await;
        assert!(refused.contains("has no worker"), "draining, c's import passes that check: {refused}");
        for n in [a, c] {
            n.kill();
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn fifty_restarts_leave_nothing_behind() {
        let _g = heavy();
        let dir = zerolayer_tests::temp_dir("churn");
        tls::init(&dir, &["a".into(), "b".into()], false).unwrap();
        let (sa, aa) = sock();
        let (_, ab) = sock();
        let mut cfg = config(&[("a", aa), ("b", ab)], &dir);
        cfg.cluster.dead_node_grace_secs = 2;
        let a = Cluster::start(&cfg, "a", &[], Some(sa), zerolayer_coordinator::quota::Quota::new(vec![])).await.unwrap();
        a.set_state(NodeState::Ready);
        let mut peak = zerolayer_coordinator::cluster::LinkStats::default();
        for round in 0..50 {
            let (sb, _) = sock(); // a new process: a new address and a new generation
            let b = Cluster::start(&cfg, "b", &[], Some(sb), zerolayer_coordinator::quota::Quota::new(vec![])).await.unwrap();
            b.set_state(NodeState::Ready);
            let generation = b.nodes()[0].generation;
            let seen = || a.nodes().iter().any(|n| n.id == "b" && n.generation == generation && n.state == NodeState::Ready);
            let deadline = Instant::now() + Duration::from_secs(10);
            while !seen() {
                assert!(Instant::now() < deadline, "round {round}: a sees the new b (generation {generation}); a sees {:?}, holds {:?}", a.nodes(), a.link_stats());
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let s = a.link_stats();
            peak = zerolayer_coordinator::cluster::LinkStats {
                gossip_node_states: peak.gossip_node_states.max(s.gossip_node_states),
                relay_sockets: peak.relay_sockets.max(s.relay_sockets),
                connections: peak.connections.max(s.connections),
                certificates: peak.certificates.max(s.certificates),
                ..peak
            };
            b.kill();
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Dead generations are dropped after the grace period; the link keeps what the one
        // remaining (dead) b needs, at most.
        until("a forgets the old generations", Duration::from_secs(30), || {
            let s = a.link_stats();
            s.gossip_node_states <= 2 && s.relay_sockets <= 2 && s.connections <= 2 && s.certificates <= 2 && s.digests <= 1 && s.nodes <= 1
        })
        .await;
        eprintln!("after 50 restarts: {:?}; peak during them: {peak:?}", a.link_stats());
        // During the churn a dead generation lives for its grace period (2 s, plus chitchat's
        // deletion grace): the peak follows the restart rate, not the number of restarts.
        assert!(
            peak.gossip_node_states < 40 && peak.relay_sockets < 40 && peak.connections < 40 && peak.certificates < 40,
            "state is collected during the churn, not only after it: {peak:?}"
        );
        a.kill();
    }
}
