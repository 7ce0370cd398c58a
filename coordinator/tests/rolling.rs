//! Replacing and losing node processes under load, as an operator does it: `scripts/local-cluster
//! 3` (three `zerolayer up` processes joined over QUIC with mutual TLS), `scripts/rolling-restart`
//! while a steady load runs (an agent session's next turn still reads its prefix from cache
//! afterwards), then `kill -9` of a node with requests in flight.
//!
//! The load behaves like a client behind a load balancer: each request goes to one node, and
//! only a connection that is refused (a node between processes, accepting nothing) is tried on
//! the next node. A request a node accepted must succeed, with exactly its undisturbed output.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// A request no other node has seen (its prompt is cached only where it was first sent).
fn fresh(k: usize, stream: bool) -> Value {
    let mut b = body(k, stream);
    b["messages"][0]["content"] = json!(format!("Story number {k}, told by a tired sailor: {}", b["messages"][0]["content"].as_str().unwrap()));
    b
}

/// Stops `scripts/local-cluster` (and with it every node) however the test ends.
struct Stop(std::process::Child);

impl Drop for Stop {
    fn drop(&mut self) {
        let _ = Command::new("kill").args(["-TERM", &self.0.id().to_string()]).status();
        for _ in 0..600 {
            if self.0.try_wait().ok().flatten().is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

fn body(k: usize, stream: bool) -> Value {
    let topics = ["the sea", "a lighthouse", "a mountain village", "a clockmaker", "the first snow", "a long train journey"];
    let mut b = json!({"model": "smollm2-135m-instruct", "max_tokens": 40, "ignore_eos": true, "stream": stream, "temperature": 0,
                       "messages": [{"role": "user", "content": format!("Write a few sentences about {}.", topics[k % topics.len()])}]});
    if k % 4 == 3 {
        // Seeded sampling continues exactly too.
        b["temperature"] = json!(0.8);
        b["seed"] = json!(77 + k % topics.len());
    }
    b
}

/// One request: (status, text). Connection refusals try the next node.
async fn ask(http: &reqwest::Client, nodes: &[String], first: usize, b: &Value) -> (u16, String) {
    let (status, text, _) = ask_where(http, nodes, first, b).await;
    (status, text)
}

/// As [`ask`], with the worker that served the request first (`zerolayer-worker`).
async fn ask_where(http: &reqwest::Client, nodes: &[String], first: usize, b: &Value) -> (u16, String, String) {
    for n in 0..nodes.len() {
        let url = format!("{}/v1/chat/completions", nodes[(first + n) % nodes.len()]);
        let r = match http.post(&url).json(b).send().await {
            Ok(r) => r,
            Err(e) if e.is_connect() => continue,
            Err(e) => return (0, format!("{url}: {e}"), String::new()),
        };
        let status = r.status().as_u16();
        let by = r.headers().get("zerolayer-worker").map(|v| v.to_str().unwrap_or("").to_string()).unwrap_or_default();
        let raw = r.text().await.unwrap_or_else(|e| format!("body error: {e}"));
        if status != 200 {
            return (status, raw, by);
        }
        let text = if b["stream"] == true {
            let mut t = String::new();
            let mut done = false;
            for line in raw.lines() {
                let Some(d) = line.strip_prefix("data: ") else { continue };
                if d == "[DONE]" {
                    done = true;
                    continue;
                }
                let v: Value = serde_json::from_str(d).unwrap_or(Value::Null);
                if v.get("error").is_some() {
                    return (500, raw, by);
                }
                t.push_str(v["choices"][0]["delta"]["content"].as_str().unwrap_or(""));
            }
            if !done {
                return (500, raw, by);
            }
            t
        } else {
            let v: Value = serde_json::from_str(&raw).unwrap_or(Value::Null);
            v["choices"][0]["message"]["content"].as_str().unwrap_or_default().to_string()
        };
        return (200, text, by);
    }
    (0, "every node refused the connection".into(), String::new())
}

/// One turn of an agent session through the Messages API: a ~1,400-token system prompt with a
/// `cache_control` breakpoint, the earlier turns (user text, assistant answer), then a new
/// question. Returns ((prompt tokens, answer), prompt tokens read from cache).
async fn session_turn(http: &reqwest::Client, node: &str, earlier: &[(&str, &str)]) -> ((u64, String), u64) {
    let rules: String = (0..60).map(|i| format!("Rule {i}: keep every change small, test it, and explain why it is needed before you make it. ")).collect();
    let mut messages = vec![];
    for (user, assistant) in earlier {
        messages.push(json!({"role": "user", "content": user}));
        messages.push(json!({"role": "assistant", "content": assistant}));
    }
    messages.push(json!({"role": "user", "content": format!("Turn {}: what is rule 7?", earlier.len() + 1)}));
    let body = json!({"model": "smollm2-135m-instruct", "max_tokens": 6, "temperature": 0, "messages": messages,
                      "system": [{"type": "text", "text": format!("You are a careful coding agent. {rules}"), "cache_control": {"type": "ephemeral"}}]});
    let v: Value = http.post(format!("{node}/v1/messages")).json(&body).send().await.unwrap().json().await.unwrap();
    let u = &v["usage"];
    let n = |k: &str| u[k].as_u64().unwrap_or_else(|| panic!("usage.{k} in {v}"));
    let prompt = n("input_tokens") + n("cache_read_input_tokens") + n("cache_creation_input_tokens");
    ((prompt, v["content"][0]["text"].as_str().unwrap_or_default().to_string()), n("cache_read_input_tokens"))
}

async fn generations(http: &reqwest::Client, nodes: &[String]) -> Vec<u64> {
    let mut out = vec![];
    for n in nodes {
        let v: Value = http.get(format!("{n}/admin/cluster")).send().await.unwrap().json().await.unwrap();
        let me = v["nodes"].as_array().unwrap().iter().find(|x| x["local"] == true).unwrap().clone();
        out.push(me["generation"].as_u64().unwrap());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rolling_restart_and_a_killed_process_fail_no_request() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..").canonicalize().unwrap();
    let dir = std::env::temp_dir().join(format!("zerolayer-rolling-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut cluster = Command::new(root.join("scripts/local-cluster"))
        .arg("3")
        .env("ZEROLAYER_BIN", env!("CARGO_BIN_EXE_zerolayer"))
        .env("ZEROLAYER_CLUSTER_DIR", &dir)
        .env("KV_MB", "128")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("run scripts/local-cluster");
    let stdout = cluster.stdout.take().unwrap();
    let mut cluster = Stop(cluster);
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let deadline = Instant::now() + Duration::from_secs(180);
    let mut nodes = vec![];
    loop {
        let line = rx.recv_timeout(deadline.saturating_duration_since(Instant::now())).expect("local-cluster prints its nodes");
        if line.starts_with('n') {
            if let Some(url) = line.split_whitespace().find(|w| w.starts_with("http://")) {
                nodes.push(url.to_string());
            }
        }
        if line.starts_with("cluster up: 3 nodes") {
            break;
        }
    }
    let http = reqwest::Client::builder().pool_max_idle_per_host(0).timeout(Duration::from_secs(300)).build().unwrap();
    // Every node sees three ready nodes.
    let t0 = Instant::now();
    loop {
        let v: Value = http.get(format!("{}/admin/cluster", nodes[0])).send().await.unwrap().json().await.unwrap();
        if v["nodes"].as_array().unwrap().iter().filter(|n| n["state"] == "ready").count() == 3 && v["workers"].as_array().unwrap().len() == 3 {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "the cluster converges: {v}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Undisturbed outputs, one per distinct request.
    let mut reference = std::collections::HashMap::new();
    for k in 0..12 {
        let b = body(k, k % 2 == 0);
        let key = (b["messages"].to_string(), b["temperature"].to_string(), b["seed"].to_string());
        if !reference.contains_key(&key) {
            let (status, text) = ask(&http, &nodes, k, &b).await;
            assert_eq!(status, 200, "{text}");
            reference.insert(key, text);
        }
    }
    let reference = Arc::new(reference);
    // An agent session's first turn (a long system prompt under `cache_control`, as Claude Code
    // sends it), on n1.
    let (first_turn, first_cached) = session_turn(&http, &nodes[0], &[]).await;
    assert!(first_turn.0 > 1_000 && first_cached < first_turn.0 / 10, "a cold ~1,400-token prompt: {first_turn:?}");
    let before = generations(&http, &nodes).await;

    // 60 requests from 4 clients, while every node is replaced in turn.
    let next = Arc::new(AtomicUsize::new(0));
    let mut clients = vec![];
    for c in 0..4 {
        let (http, nodes, next, reference) = (http.clone(), nodes.clone(), next.clone(), reference.clone());
        clients.push(tokio::spawn(async move {
            let mut failures = vec![];
            loop {
                let k = next.fetch_add(1, Ordering::Relaxed);
                if k >= 60 {
                    return failures;
                }
                let b = body(k, k % 2 == 0);
                let (status, text) = ask(&http, &nodes, k + c, &b).await;
                let key = (b["messages"].to_string(), b["temperature"].to_string(), b["seed"].to_string());
                if status != 200 {
                    failures.push(format!("request {k}: {status} {text}"));
                } else if reference[&key] != text {
                    failures.push(format!("request {k}: output differs: {text:?} vs {:?}", reference[&key]));
                }
                tokio::time::sleep(Duration::from_millis(150)).await;
            }
        }));
    }
    let rolling = tokio::task::spawn_blocking({
        let (root, dir) = (root.clone(), dir.clone());
        move || Command::new(root.join("scripts/rolling-restart")).arg(&dir).output().expect("run scripts/rolling-restart")
    });
    let out = tokio::time::timeout(Duration::from_secs(600), rolling).await.expect("the rolling restart finishes").unwrap();
    println!("{}", String::from_utf8_lossy(&out.stdout));
    assert!(out.status.success(), "rolling-restart failed: {}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    // The drains moved what ran on the drained nodes (a drain that moved nothing would leave
    // the load above no way to tell).
    let moved = moved_by_drains(&String::from_utf8_lossy(&out.stdout));
    assert!(moved >= 1, "the three drains moved no sequence: the load never ran on a drained node");
    let mut failures = vec![];
    for c in clients {
        failures.extend(tokio::time::timeout(Duration::from_secs(600), c).await.expect("the load finishes").unwrap());
    }
    assert!(failures.is_empty(), "{} of 60 requests failed or differed: {failures:#?}", failures.len());
    let after = generations(&http, &nodes).await;
    for (i, n) in nodes.iter().enumerate() {
        assert_eq!(http.get(format!("{n}/ready")).send().await.unwrap().status(), 200, "{n} ends ready");
        assert!(after[i] > before[i], "{n} runs a new generation ({} -> {})", before[i], after[i]);
    }
    // Every process that held the session's prefix is gone, but each drain copied its hottest
    // cached prefixes to the nodes that stayed: the next turn still reads its prefix from cache.
    tokio::time::sleep(Duration::from_millis(500)).await; // the prefix digests gossip
    let ((prompt, _), cached) = session_turn(&http, &nodes[0], &[("Turn 1: what is rule 7?", &first_turn.1)]).await;
    println!("after the rolling restart, the session's next turn read {cached} of {prompt} prompt tokens from cache");
    assert!(cached * 10 >= first_turn.0 * 9, "the next turn reads its prefix from cache: {cached} of the first turn's {}", first_turn.0);

    // kill -9 of n3 while it runs requests that n1 and n2 accepted (streamed and not, greedy
    // and sampled): every one finishes on the survivors by exact replay. Each request is first
    // sent to n3 itself (its undisturbed output), so that n3 alone caches its prompt and
    // placement sends it back there.
    let mut undisturbed = vec![];
    for k in 0..8 {
        let (status, text) = ask(&http, &nodes[2..], 0, &fresh(k, k % 2 == 0)).await;
        assert_eq!(status, 200);
        undisturbed.push(text);
    }
    let undisturbed = Arc::new(undisturbed);
    tokio::time::sleep(Duration::from_millis(500)).await; // the prefix digests gossip
    let victim = std::fs::read_to_string(dir.join("pids/n3")).unwrap().trim().to_string();
    std::fs::write(dir.join("replacing/n3"), "").unwrap();
    let survivors = vec![nodes[0].clone(), nodes[1].clone()];
    let mut inflight = vec![];
    for k in 0..8 {
        let (http, survivors, undisturbed) = (http.clone(), survivors.clone(), undisturbed.clone());
        inflight.push(tokio::spawn(async move {
            let (status, text, by) = ask_where(&http, &survivors, k, &fresh(k, k % 2 == 0)).await;
            (k, status, text == undisturbed[k], text, by, Instant::now())
        }));
    }
    tokio::time::sleep(Duration::from_millis(400)).await;
    Command::new("kill").args(["-KILL", &victim]).status().unwrap();
    let killed_at = Instant::now();
    let mut on_victim = 0;
    for t in inflight {
        let (k, status, same, text, by, done) = tokio::time::timeout(Duration::from_secs(300), t).await.expect("finishes").unwrap();
        assert_eq!(status, 200, "request {k} after the kill: {text}");
        assert!(same, "request {k} (first on {by}): the replay gives the undisturbed output ({text:?})");
        // Started on n3 and done well after it died: it was running there, and was replayed. (One
        // done before the kill, as drafts make short answers quick, needed no replay.)
        on_victim += usize::from(by.starts_with("n3/") && done > killed_at + Duration::from_millis(100));
    }
    println!("{on_victim} of 8 requests were running on n3 when it was killed");
    assert!(on_victim >= 1, "some requests ran on the killed node");
    // Each of them continued by a replay that the survivor holding its client counted.
    let mut replays = 0.0;
    for n in &survivors {
        let text = http.get(format!("{n}/metrics")).send().await.unwrap().text().await.unwrap();
        replays += metric_sum(&text, "zerolayer_migrations_total", "kind=\"replay\"");
    }
    assert!(replays >= on_victim as f64, "{replays} replays counted for {on_victim} requests lost with n3");
    // The survivors keep serving.
    let (status, _) = ask(&http, &survivors, 0, &body(0, false)).await;
    assert_eq!(status, 200);

    Command::new("kill").args(["-TERM", &cluster.0.id().to_string()]).status().unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Some(code) = cluster.0.try_wait().unwrap() {
            assert_eq!(code.code(), Some(0));
            break;
        }
        assert!(Instant::now() < deadline, "local-cluster stops");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Sequences the drains of a `scripts/rolling-restart` run moved, with or without their KV, from
/// the `zerolayer drain --wait` lines it prints ("… drained: N sequences moved with their KV
/// (…), M without").
fn moved_by_drains(out: &str) -> u64 {
    out.lines()
        .filter(|l| l.contains(" drained: "))
        .map(|l| {
            let n = l.split(" drained: ").nth(1).and_then(|r| r.split_whitespace().next()).and_then(|n| n.parse::<u64>().ok()).unwrap_or(0);
            let m = l.rsplit("), ").next().and_then(|r| r.split_whitespace().next()).and_then(|m| m.parse::<u64>().ok()).unwrap_or(0);
            n + m
        })
        .sum()
}

/// The sum of a Prometheus counter's series whose labels contain `label` (`name{…} value`).
fn metric_sum(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[test]
fn drain_lines_and_metrics_are_read() {
    let out = "== n1\nn1 drained: 2 sequences moved with their KV (30 blocks, 100 bytes), 1 without\nn2 drained: 0 sequences moved with their KV (0 blocks, 0 bytes), 0 without\n";
    assert_eq!(moved_by_drains(out), 3);
    let m = "zerolayer_migrations_total{kind=\"replay\",node=\"n1\"} 2\nzerolayer_migrations_total{kind=\"kv\",node=\"n1\"} 5\nzerolayer_migrations_total{kind=\"replay\",node=\"n2\"} 1\n";
    assert_eq!(metric_sum(m, "zerolayer_migrations_total", "kind=\"replay\""), 3.0);
}
