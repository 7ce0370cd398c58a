//! What an operator or a client sees of where time goes, without a proxy: the `server-timing`
//! header and the streams' final split on the real model, the phase histograms, and the Grafana
//! dashboard (`scripts/grafana/zerolayer.json`), whose every query must name a metric that
//! `/metrics` really exposes.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use zerolayer_tests::*;

/// `server-timing`'s entries, name → milliseconds.
fn parse_server_timing(h: &str) -> Vec<(String, f64)> {
    h.split(',')
        .map(|part| {
            let mut it = part.trim().split(';');
            let name = it.next().unwrap().trim().to_string();
            let dur = it.find_map(|p| p.trim().strip_prefix("dur=")).unwrap_or_else(|| panic!("no dur in {part:?}"));
            (name, dur.parse::<f64>().unwrap())
        })
        .collect()
}

fn get(entries: &[(String, f64)], name: &str) -> f64 {
    entries.iter().find(|(n, _)| n == name).unwrap_or_else(|| panic!("{name} missing from {entries:?}")).1
}

/// The phases add up to `total` (within 5 ms), every one is there, and `total` is real time: at
/// most the client's own measure of the request, and most of it.
fn check_split(entries: &[(String, f64)], client: Duration, what: &str) {
    let parts: f64 = ["prepare", "queue", "prefill", "decode"].iter().map(|n| get(entries, n)).sum();
    let total = get(entries, "total");
    assert!((parts - total).abs() <= 5.0, "{what}: the phases add up to {parts} ms, total is {total} ms ({entries:?})");
    let client_ms = client.as_secs_f64() * 1e3;
    assert!(total <= client_ms + 1.0 && total >= client_ms * 0.5, "{what}: total {total} ms against {client_ms} ms seen by the client");
    assert!(get(entries, "decode") > 0.0 && get(entries, "prefill") > 0.0, "{what}: {entries:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_timing_splits_every_generation_response() {
    let _g = heavy();
    let s = TestServer::start(|_| {}).await;
    let c = http_client(120);
    let before = c.get(s.url("/metrics")).send().await.unwrap().text().await.unwrap();

    // Anthropic, whole.
    let t0 = Instant::now();
    let r = c.post(s.url("/v1/messages")).json(&messages_body("Count from one to ten.", 24, false)).send().await.unwrap();
    let elapsed = t0.elapsed();
    assert_eq!(r.status(), 200);
    let header = r.headers()["server-timing"].to_str().unwrap().to_string();
    let v: Value = r.json().await.unwrap();
    assert!(v["usage"]["output_tokens"].as_u64().unwrap() > 1);
    let split = parse_server_timing(&header);
    check_split(&split, elapsed, "messages");
    // The prompt's compute is prefill, not queue: the worker says how long ago it admitted it
    // (a forward of ~30 prompt tokens takes well over a millisecond; arriving with the first
    // token, the admission would leave prefill near zero).
    assert!(get(&split, "prefill") >= 1.0, "{header}");
    assert!(!header.contains("migrate"), "nothing moved: {header}");

    // Anthropic, streamed: the header says what was over when it left, the final event the rest.
    let t0 = Instant::now();
    let r = c.post(s.url("/v1/messages")).json(&messages_body("Count from one to ten.", 24, true)).send().await.unwrap();
    let header = r.headers()["server-timing"].to_str().unwrap().to_string();
    let raw = r.text().await.unwrap();
    let elapsed = t0.elapsed();
    let head = parse_server_timing(&header);
    assert_eq!(head.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(), ["prepare"]);
    let events = parse_sse(&raw);
    let delta = &events.iter().find(|(n, _)| n == "message_delta").unwrap().1;
    let split = split_of(&delta["usage"]["server_timing"]);
    check_split(&split, elapsed, "messages stream");
    assert!(get(&split, "prepare") <= get(&head, "prepare") + 0.001);

    // OpenAI chat, whole and streamed (the usage chunk carries it).
    let body = json!({"model": "smollm2-135m-instruct", "temperature": 0, "max_tokens": 12, "messages": [{"role": "user", "content": "Name a color."}]});
    let t0 = Instant::now();
    let r = c.post(s.url("/v1/chat/completions")).json(&body).send().await.unwrap();
    let elapsed = t0.elapsed();
    check_split(&parse_server_timing(r.headers()["server-timing"].to_str().unwrap()), elapsed, "chat completions");
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    sb["stream_options"] = json!({"include_usage": true});
    let t0 = Instant::now();
    let raw = c.post(s.url("/v1/chat/completions")).json(&sb).send().await.unwrap().text().await.unwrap();
    let usage = parse_sse(&raw).into_iter().find_map(|(_, d)| d.get("usage").filter(|u| u.is_object()).cloned()).unwrap();
    check_split(&split_of(&usage["server_timing"]), t0.elapsed(), "chat completions stream");

    // The Responses API, whole.
    let t0 = Instant::now();
    let r = c.post(s.url("/v1/responses")).json(&json!({"model": "smollm2-135m-instruct", "input": "Name a fruit.", "max_output_tokens": 12, "temperature": 0})).send().await.unwrap();
    let elapsed = t0.elapsed();
    assert_eq!(r.status(), 200);
    check_split(&parse_server_timing(r.headers()["server-timing"].to_str().unwrap()), elapsed, "responses");

    // The same phases land in the histograms: one observation per phase per request.
    let after = c.get(s.url("/metrics")).send().await.unwrap().text().await.unwrap();
    let count = |page: &str, phase: &str| metric_with(page, "zerolayer_request_phase_seconds_count", &[("phase", phase)]).unwrap_or(0.0);
    for phase in ["prepare", "queue", "prefill", "decode"] {
        assert_eq!(count(&after, phase) - count(&before, phase), 5.0, "{phase}");
    }
    let total = |page: &str| metric(page, "zerolayer_request_duration_seconds_count").unwrap_or(0.0);
    assert_eq!(total(&after) - total(&before), 5.0);
    s.stop().await.unwrap();
}

/// A stream's `usage.server_timing` object as `server-timing` entries.
fn split_of(v: &Value) -> Vec<(String, f64)> {
    let o = v.as_object().unwrap_or_else(|| panic!("no server_timing: {v}"));
    o.iter().map(|(k, v)| (k.trim_end_matches("_ms").to_string(), v.as_f64().unwrap())).collect()
}

/// Every metric name a PromQL expression uses (ours and vLLM's names).
fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let b = expr.as_bytes();
    let mut i = 0;
    while i < b.len() {
        let rest = &expr[i..];
        let starts = rest.starts_with("zerolayer_") || rest.starts_with("vllm:");
        let boundary = i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_' || b[i - 1] == b':');
        if starts && boundary {
            let end = rest.find(|ch: char| !(ch.is_ascii_alphanumeric() || ch == '_' || ch == ':')).unwrap_or(rest.len());
            out.insert(rest[..end].to_string());
            i += end;
        } else {
            i += 1;
        }
    }
    out
}

/// The series names of a Prometheus text page.
fn exposed(page: &str) -> BTreeSet<String> {
    page.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| l.split(|c| c == '{' || c == ' ').next().unwrap().to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_query_names_an_exposed_metric() {
    let _g = heavy();
    let path = repo_root().join("scripts/grafana/zerolayer.json");
    let dash: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let mut queries = Vec::new();
    for p in dash["panels"].as_array().unwrap() {
        if p["type"] == "row" {
            continue;
        }
        let targets = p["targets"].as_array().unwrap_or_else(|| panic!("panel {} has no targets", p["title"]));
        assert!(!targets.is_empty(), "panel {} has no queries", p["title"]);
        for t in targets {
            queries.push((p["title"].as_str().unwrap().to_string(), t["expr"].as_str().unwrap().to_string()));
        }
    }
    for v in dash["templating"]["list"].as_array().unwrap() {
        if let Some(q) = v["query"].as_str().filter(|_| v["type"] == "query") {
            queries.push((format!("variable {}", v["name"]), q.to_string()));
        }
    }
    assert!(queries.len() >= 20, "{} queries", queries.len());
    let named: BTreeSet<String> = queries.iter().flat_map(|(_, q)| metric_names(q)).collect();
    for needed in ["zerolayer_prefix_hit_ratio", "zerolayer_kv_fragmentation_ratio", "zerolayer_memory_used_bytes", "zerolayer_time_to_first_token_seconds_bucket", "zerolayer_inter_token_latency_seconds_bucket", "zerolayer_requests_total", "zerolayer_migrations_total", "zerolayer_fallbacks_total", "zerolayer_policy_matches_total"] {
        assert!(named.contains(needed), "the dashboard shows no {needed}");
    }

    // A node that served one request exposes every one of them (with a fallback and a policy
    // rule configured, as their panels assume).
    let s = TestServer::start(|c| {
        c.models.push(zerolayer_common::config::ModelSection { path: model_path(), id: "backup".into(), ..Default::default() });
        c.model.fallback = Some("backup".into());
        c.policy.rules = vec![zerolayer_common::config::PolicyRule { name: "r".into(), pattern: "never-said".into(), applies_to: zerolayer_common::config::AppliesTo::Both, keys: vec![] }];
    })
    .await;
    let c = http_client(120);
    let r = c.post(s.url("/v1/messages")).json(&messages_body("Count from one to ten.", 16, false)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let page = c.get(s.url("/metrics")).send().await.unwrap().text().await.unwrap();
    let have = exposed(&page);
    let missing: Vec<String> = queries
        .iter()
        .flat_map(|(title, q)| metric_names(q).into_iter().filter(|m| !have.contains(m)).map(move |m| format!("{m} (in \"{title}\")")))
        .collect();
    assert!(missing.is_empty(), "the dashboard queries metrics /metrics does not expose: {missing:?}");
    s.stop().await.unwrap();
}

#[test]
fn metric_names_are_found_in_promql() {
    let q = r#"histogram_quantile(0.5, sum by (le) (rate(zerolayer_time_to_first_token_seconds_bucket{node=~"$node"}[5m]))) / vllm:num_requests_running"#;
    assert_eq!(metric_names(q).into_iter().collect::<Vec<_>>(), ["vllm:num_requests_running", "zerolayer_time_to_first_token_seconds_bucket"]);
    assert_eq!(exposed("# HELP a x\na_total{n=\"1\"} 2\nb 3\n").into_iter().collect::<Vec<_>>(), ["a_total", "b"]);
}

/// With debug logging on, the process's own subscriber (the binary's, written to a buffer):
/// client text reaches log lines (the prompt's debug line, a refused request's error), and
/// no email address, phone number or operator pattern in it is written as sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_text_is_redacted_in_every_log_line() {
    let _g = heavy();
    let logs = LogCapture::default();
    zerolayer_coordinator::logs::init_with(false, "debug", logs.clone());
    let s = TestServer::start(|c| c.logging.patterns = vec![r"ACCT-\d{6}".into()]).await;
    let c = http_client(120);
    let email = "jane.doe@example.com";
    let phone = "+1 555 123 4567";
    let prompt = format!("Write to {email} or call {phone} about account ACCT-004217. Reply with one word.");
    let r = c.post(s.url("/v1/messages")).json(&messages_body(&prompt, 4, false)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let mut refused = messages_body("hello", 4, false);
    refused["model"] = json!(email);
    let r = c.post(s.url("/v1/messages")).json(&refused).send().await.unwrap();
    assert_eq!(r.status(), 404);
    let body = r.text().await.unwrap();
    assert!(body.contains(email), "the client's own error still names what it sent: {body}");
    s.stop().await.unwrap();

    let text = logs.text();
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines.iter().any(|l| l.contains("prompt prepared") && l.contains("[email]") && l.contains("[phone]") && l.contains("[redacted]")), "the prompt's debug line: {text}");
    assert!(lines.iter().any(|l| l.contains("request refused") && l.contains("[email]")), "the refusal's line");
    for l in &lines {
        for secret in [email, "555 123 4567", "ACCT-004217"] {
            assert!(!l.contains(secret), "{secret} in a log line: {l}");
        }
    }
}
