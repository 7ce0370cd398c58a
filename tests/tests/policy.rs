//! Policies with an audit trail, on two nodes over real QUIC and the real model: an input rule
//! refuses a matching prompt with 400 and names the rule, never the text; an output rule stops a
//! greedy answer before the matching text, so that no byte of it reaches the client, whole or
//! streamed; every match leaves an audit record that the other node reads through the cluster
//! link with the admin key.

use std::time::Duration;

use serde_json::{json, Value};
use zerolayer_common::config::{AppliesTo, KeyConfig, PolicyRule};
use zerolayer_tests::*;

const GUARDED: &str = "sk-guarded-0123456789";
const FREE: &str = "sk-free-0123456789";
const ADMIN: &str = "sk-admin-0123456789";
const QUESTION: &str = "What is the capital of France?";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_refuse_input_stop_output_and_leave_records_any_node_reads() {
    let _g = heavy();
    let cluster = TestCluster::start(2, |c| {
        c.auth.keys = vec![
            KeyConfig { name: "guarded".into(), key: GUARDED.into(), ..Default::default() },
            KeyConfig { name: "free".into(), key: FREE.into(), ..Default::default() },
        ];
        c.auth.admin_key = Some(ADMIN.into());
        c.policy.rules = vec![
            PolicyRule { name: "account".into(), pattern: r"ACCT-\d{6}".into(), applies_to: AppliesTo::Input, keys: vec![] },
            PolicyRule { name: "capital".into(), pattern: "Paris".into(), applies_to: AppliesTo::Output, keys: vec!["guarded".into()] },
        ];
    })
    .await;
    cluster.wait_converged(&[0, 1], Duration::from_secs(60)).await;
    let http = http_client(120);
    let (a, b) = (&cluster.nodes[0], &cluster.nodes[1]);
    let ask = |key: &'static str, body: Value, path: &'static str| http.post(a.url(path)).header("x-api-key", key).json(&body).send();
    let read = |path: String| http.get(b.url(&path)).header("x-api-key", ADMIN).send();

    // Input: 400 in the API's shape, naming the rule and not the text.
    let r = ask(FREE, messages_body("Move 10 dollars from ACCT-004217 to savings.", 8, false), "/v1/messages").await.unwrap();
    assert_eq!(r.status(), 400);
    let input_id = r.headers()["zerolayer-policy-audit-id"].to_str().unwrap().to_string();
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["type"], "invalid_request_error");
    let msg = e["error"]["message"].as_str().unwrap();
    assert!(msg.contains("\"account\"") && !msg.contains("004217"), "{msg}");
    let rec: Value = read(format!("/admin/policy/audit/{input_id}")).await.unwrap().json().await.unwrap();
    assert_eq!((rec["rule"].as_str(), rec["direction"].as_str(), rec["key"].as_str()), (Some("account"), Some("input"), Some("free")), "{rec}");
    assert_eq!(rec["span"], "A*********7 (11 characters)");
    assert_eq!(read(format!("/admin/policy/audit/{input_id}")).await.unwrap().status(), 200);
    let user = http.get(b.url(&format!("/admin/policy/audit/{input_id}"))).header("x-api-key", FREE).send().await.unwrap();
    assert_eq!(user.status(), 403, "a user key reads no audit record");

    // Output: the key the rule does not cover gets the whole answer; the guarded key gets the
    // text before the match, and not one byte of it, whole or streamed.
    let full: Value = ask(FREE, messages_body(QUESTION, 24, false), "/v1/messages").await.unwrap().json().await.unwrap();
    let full = full["content"][0]["text"].as_str().unwrap().to_string();
    let at = full.find("Paris").unwrap_or_else(|| panic!("the greedy answer names Paris: {full:?}"));
    let r = ask(GUARDED, messages_body(QUESTION, 24, false), "/v1/messages").await.unwrap();
    assert_eq!(r.status(), 200);
    let whole_id = r.headers()["zerolayer-policy-audit-id"].to_str().unwrap().to_string();
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["stop_reason"], "refusal", "{v}");
    let text: String = v["content"].as_array().unwrap().iter().filter_map(|c| c["text"].as_str()).collect();
    assert_eq!(text, full[..at], "the answer up to the match");
    let raw = ask(GUARDED, messages_body(QUESTION, 24, true), "/v1/messages").await.unwrap().text().await.unwrap();
    assert!(!raw.contains("Paris"), "{raw}");
    let events = parse_sse(&raw);
    let streamed: String = events.iter().filter_map(|(_, d)| d["delta"]["text"].as_str()).collect();
    assert_eq!(streamed, full[..at]);
    let delta = &events.iter().find(|(n, _)| n == "message_delta").unwrap().1;
    assert_eq!(delta["delta"]["stop_reason"], "refusal");
    assert_eq!(delta["policy"]["rule"], "capital");
    let stream_id = delta["policy"]["audit_id"].as_str().unwrap().to_string();
    let chat = json!({"model": "smollm2-135m-instruct", "max_tokens": 24, "temperature": 0, "messages": [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": QUESTION}]});
    let v: Value = ask(GUARDED, chat, "/v1/chat/completions").await.unwrap().json().await.unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "content_filter", "{v}");
    assert!(!v["choices"][0]["message"]["content"].as_str().unwrap_or_default().contains("Paris"));

    // Every match is on record, read through the other node.
    let rec: Value = read(format!("/admin/policy/audit/{whole_id}")).await.unwrap().json().await.unwrap();
    assert_eq!((rec["rule"].as_str(), rec["direction"].as_str(), rec["key"].as_str(), rec["span"].as_str()), (Some("capital"), Some("output"), Some("guarded"), Some("P***s (5 characters)")));
    let all: Value = read("/admin/policy/audit?since=0".into()).await.unwrap().json().await.unwrap();
    let ids: Vec<&str> = all["records"].as_array().unwrap().iter().filter_map(|r| r["id"].as_str()).collect();
    for id in [&input_id, &whole_id, &stream_id] {
        assert!(ids.contains(&id.as_str()), "{id} in {all}");
    }
    assert_eq!(all["nodes"]["a"], "ok");
    let page = http.get(a.url("/metrics")).send().await.unwrap().text().await.unwrap();
    assert_eq!(metric_with(&page, "zerolayer_policy_matches_total", &[("node", "a"), ("rule", "capital"), ("direction", "output")]), Some(3.0));
    assert_eq!(metric_with(&page, "zerolayer_policy_matches_total", &[("node", "a"), ("rule", "account"), ("direction", "input")]), Some(1.0));
}
