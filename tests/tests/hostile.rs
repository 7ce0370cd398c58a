//! Hostile and malformed input, auth, rate limits and overload, against a live node on the real
//! model. Every bad request gets the right status and the Anthropic error shape, and the node
//! keeps serving.

use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::{json, Value};
use zerolayer_tests::*;

const MODEL: &str = "smollm2-135m-instruct";

fn client() -> reqwest::Client {
    reqwest::Client::builder().timeout(Duration::from_secs(120)).build().unwrap()
}

fn ok_body() -> Value {
    json!({"model": MODEL, "max_tokens": 1, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]})
}

fn with(mut base: Value, f: impl FnOnce(&mut Value)) -> Value {
    f(&mut base);
    base
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forty_plus_bad_requests_get_precise_errors_and_the_node_keeps_serving() {
    let _g = heavy();
    let limit = 256 * 1024;
    let s = TestServer::start(|c| c.server.max_body_bytes = limit).await;
    let c = client();
    let msg = |content: Value| json!({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": content}]});
    let mut nested = String::new();
    for _ in 0..5000 {
        nested.push('[');
    }
    let huge_prompt = "word ".repeat(20_000);
    // (name, raw body, extra header, expected status, expected error type)
    let mut cases: Vec<(&str, Vec<u8>, Option<(&str, &str)>, u16, &str)> = vec![];
    let mut j = |name: &'static str, v: Value, status: u16, ty: &'static str| cases.push((name, v.to_string().into_bytes(), None, status, ty));
    j("json array", json!([]), 400, "invalid_request_error");
    j("json string", json!("hi"), 400, "invalid_request_error");
    j("json null", Value::Null, 400, "invalid_request_error");
    j("missing model", with(ok_body(), |b| drop(b.as_object_mut().unwrap().remove("model"))), 400, "invalid_request_error");
    j("model is a number", with(ok_body(), |b| b["model"] = json!(7)), 400, "invalid_request_error");
    j("model is empty", with(ok_body(), |b| b["model"] = json!("")), 400, "invalid_request_error");
    j("unknown model", with(ok_body(), |b| b["model"] = json!("gpt-17")), 404, "not_found_error");
    j("missing max_tokens", with(ok_body(), |b| drop(b.as_object_mut().unwrap().remove("max_tokens"))), 400, "invalid_request_error");
    j("negative max_tokens", with(ok_body(), |b| b["max_tokens"] = json!(-1)), 400, "invalid_request_error");
    j("fractional max_tokens", with(ok_body(), |b| b["max_tokens"] = json!(1.5)), 400, "invalid_request_error");
    j("string max_tokens", with(ok_body(), |b| b["max_tokens"] = json!("5")), 400, "invalid_request_error");
    j("astronomical max_tokens", with(ok_body(), |b| b["max_tokens"] = json!(1_000_000_000_000u64)), 400, "invalid_request_error");
    j("max_tokens beyond the context", with(ok_body(), |b| b["max_tokens"] = json!(100_000)), 400, "invalid_request_error");
    j("missing messages", with(ok_body(), |b| drop(b.as_object_mut().unwrap().remove("messages"))), 400, "invalid_request_error");
    j("messages is an object", with(ok_body(), |b| b["messages"] = json!({"role": "user"})), 400, "invalid_request_error");
    j("messages is empty", with(ok_body(), |b| b["messages"] = json!([])), 400, "invalid_request_error");
    j("message is a string", with(ok_body(), |b| b["messages"] = json!(["hi"])), 400, "invalid_request_error");
    j("role missing", with(ok_body(), |b| b["messages"] = json!([{"content": "hi"}])), 400, "invalid_request_error");
    j("role system", with(ok_body(), |b| b["messages"][0]["role"] = json!("system")), 400, "invalid_request_error");
    j("role tool", with(ok_body(), |b| b["messages"][0]["role"] = json!("tool")), 400, "invalid_request_error");
    j("role is a number", with(ok_body(), |b| b["messages"][0]["role"] = json!(1)), 400, "invalid_request_error");
    j("content missing", with(ok_body(), |b| b["messages"] = json!([{"role": "user"}])), 400, "invalid_request_error");
    j("content is a number", msg(json!(42)), 400, "invalid_request_error");
    j("content is empty", msg(json!("")), 400, "invalid_request_error");
    j("block without type", msg(json!([{"text": "hi"}])), 400, "invalid_request_error");
    j("unknown block type", msg(json!([{"type": "hologram"}])), 400, "invalid_request_error");
    j("image block", msg(json!([{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}])), 400, "invalid_request_error");
    j("document block", msg(json!([{"type": "document", "source": {"type": "text", "data": "x"}}])), 400, "invalid_request_error");
    j("thinking block", msg(json!([{"type": "thinking", "thinking": "hmm", "signature": "x"}])), 400, "invalid_request_error");
    j("tool_use block", msg(json!([{"type": "tool_use", "id": "t", "name": "n", "input": {}}])), 400, "invalid_request_error");
    j("text block with number text", msg(json!([{"type": "text", "text": 5}])), 400, "invalid_request_error");
    j("extra key on a message", with(ok_body(), |b| b["messages"][0]["name"] = json!("bob")), 400, "invalid_request_error");
    j("unknown top-level field", with(ok_body(), |b| b["frobnicate"] = json!(true)), 400, "invalid_request_error");
    j("temperature above 1", with(ok_body(), |b| b["temperature"] = json!(1.5)), 400, "invalid_request_error");
    j("negative temperature", with(ok_body(), |b| b["temperature"] = json!(-0.1)), 400, "invalid_request_error");
    j("temperature is a string", with(ok_body(), |b| b["temperature"] = json!("hot")), 400, "invalid_request_error");
    j("top_p zero", with(ok_body(), |b| b["top_p"] = json!(0)), 400, "invalid_request_error");
    j("top_p above 1", with(ok_body(), |b| b["top_p"] = json!(1.5)), 400, "invalid_request_error");
    j("top_k zero", with(ok_body(), |b| b["top_k"] = json!(0)), 400, "invalid_request_error");
    j("negative top_k", with(ok_body(), |b| b["top_k"] = json!(-5)), 400, "invalid_request_error");
    j("stop_sequences is a string", with(ok_body(), |b| b["stop_sequences"] = json!("stop")), 400, "invalid_request_error");
    j("stop_sequences holds a number", with(ok_body(), |b| b["stop_sequences"] = json!(["a", 1])), 400, "invalid_request_error");
    j("too many stop_sequences", with(ok_body(), |b| b["stop_sequences"] = json!((0..17).map(|i| format!("s{i}")).collect::<Vec<_>>())), 400, "invalid_request_error");
    j("absurdly long stop sequence", with(ok_body(), |b| b["stop_sequences"] = json!(["x".repeat(300)])), 400, "invalid_request_error");
    j("empty stop sequence", with(ok_body(), |b| b["stop_sequences"] = json!([""])), 400, "invalid_request_error");
    j("stream is a string", with(ok_body(), |b| b["stream"] = json!("yes")), 400, "invalid_request_error");
    j("tools", with(ok_body(), |b| b["tools"] = json!([{"name": "get_weather", "input_schema": {"type": "object"}}])), 400, "invalid_request_error");
    j("tool_choice any", with(ok_body(), |b| b["tool_choice"] = json!({"type": "any"})), 400, "invalid_request_error");
    j("thinking enabled", with(ok_body(), |b| b["thinking"] = json!({"type": "enabled", "budget_tokens": 1024})), 400, "invalid_request_error");
    j("system is a number", with(ok_body(), |b| b["system"] = json!(3)), 400, "invalid_request_error");
    j("system image block", with(ok_body(), |b| b["system"] = json!([{"type": "image"}])), 400, "invalid_request_error");
    j("metadata is a string", with(ok_body(), |b| b["metadata"] = json!("m")), 400, "invalid_request_error");
    j("metadata extra key", with(ok_body(), |b| b["metadata"] = json!({"user_id": "u", "ssn": "x"})), 400, "invalid_request_error");
    j("bad cache_control", with(ok_body(), |b| b["cache_control"] = json!({"type": "forever"})), 400, "invalid_request_error");
    j("structured output", with(ok_body(), |b| b["output_config"] = json!({"format": {"type": "json_schema", "schema": {}}})), 400, "invalid_request_error");
    j(
        "final assistant turn ends in whitespace",
        with(ok_body(), |b| b["messages"] = json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure "}])),
        400,
        "invalid_request_error",
    );
    j("prompt longer than the context", msg(json!(huge_prompt)), 400, "invalid_request_error");
    cases.push(("empty body", vec![], None, 400, "invalid_request_error"));
    cases.push(("truncated JSON", b"{\"model\": \"smollm2".to_vec(), None, 400, "invalid_request_error"));
    cases.push(("invalid UTF-8", b"{\"model\": \"\xff\xfe\", \"max_tokens\": 1}".to_vec(), None, 400, "invalid_request_error"));
    cases.push(("deeply nested JSON", nested.into_bytes(), None, 400, "invalid_request_error"));
    cases.push(("body over the limit", vec![b' '; limit + 1], None, 413, "request_too_large"));
    cases.push(("malformed anthropic-version", ok_body().to_string().into_bytes(), Some(("anthropic-version", "yesterday")), 400, "invalid_request_error"));
    assert!(cases.len() >= 40, "{} cases", cases.len());

    for (name, body, header, status, ty) in cases {
        let mut rq = c.post(s.url("/v1/messages")).header("content-type", "application/json").body(body);
        if let Some((k, v)) = header {
            rq = rq.header(k, v);
        }
        let r = rq.send().await.unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(r.status().as_u16(), status, "{name}");
        let rid = r.headers().get("request-id").unwrap_or_else(|| panic!("{name}: request-id")).to_str().unwrap().to_string();
        let v: Value = r.json().await.unwrap_or_else(|e| panic!("{name}: JSON error body: {e}"));
        assert_eq!(v["type"], "error", "{name}: {v}");
        assert_eq!(v["error"]["type"], ty, "{name}: {v}");
        assert!(v["error"]["message"].as_str().is_some_and(|m| m.len() > 5), "{name}: {v}");
        assert_eq!(v["request_id"], rid.as_str(), "{name}");
        // The node still serves a valid request after each bad one.
        let ok = c.post(s.url("/v1/messages")).json(&ok_body()).send().await.unwrap();
        assert_eq!(ok.status(), 200, "valid request after {name}");
    }
    s.stop().await.unwrap();
}

fn peak_rss_bytes() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: u64 = s.lines().find(|l| l.starts_with("VmHWM:")).unwrap().split_whitespace().nth(1).unwrap().parse().unwrap();
    kb * 1024
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_gets_fast_529_and_admitted_streams_complete() {
    let _g = heavy();
    let s = TestServer::start(|c| c.server.max_inflight = 4).await;
    let c = client();
    let mut tasks = vec![];
    for i in 0..16 {
        let c = c.clone();
        let url = s.url("/v1/messages");
        tasks.push(tokio::spawn(async move {
            let t0 = Instant::now();
            let body = json!({"model": MODEL, "max_tokens": 24, "stream": true, "temperature": 0,
                              "messages": [{"role": "user", "content": format!("Count to {i}.")}]});
            let r = c.post(url).json(&body).send().await.unwrap();
            let st = r.status().as_u16();
            if st != 200 {
                let v: Value = r.json().await.unwrap();
                return (st, t0.elapsed(), v.to_string());
            }
            let mut body = String::new();
            let mut stream = r.bytes_stream();
            while let Some(ch) = stream.next().await {
                body.push_str(&String::from_utf8_lossy(&ch.unwrap()));
            }
            (st, t0.elapsed(), body)
        }));
    }
    let mut ok = 0;
    let mut overloaded = 0;
    for t in tasks {
        let (st, took, body) = tokio::time::timeout(Duration::from_secs(300), t).await.unwrap().unwrap();
        match st {
            200 => {
                assert!(body.contains("event: message_stop"), "{body}");
                ok += 1;
            }
            529 => {
                assert!(body.contains("overloaded_error"), "{body}");
                assert!(took < Duration::from_secs(2), "529 came fast ({took:?})");
                overloaded += 1;
            }
            other => panic!("unexpected status {other}: {body}"),
        }
    }
    assert!(ok >= 4, "the admitted streams complete ({ok})");
    assert!(overloaded >= 8, "the excess is refused ({overloaded})");
    // Bound: the model (≈100 MB) and a 256 MB KV cache, plus runtime and test overhead.
    let peak = peak_rss_bytes();
    assert!(peak < 1_500_000_000, "peak RSS {peak} bytes");
    s.stop().await.unwrap();
}

fn rss_bytes() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: u64 = s.lines().find(|l| l.starts_with("VmRSS:")).unwrap().split_whitespace().nth(1).unwrap().parse().unwrap();
    kb * 1024
}

/// 2,000 mixed requests (generations, streams cut short, errors, token counts) leave the KV
/// cache back at baseline and the process's memory flat.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_thousand_mixed_requests_leak_nothing() {
    let _g = heavy();
    let s = TestServer::start(|_| {}).await;
    let c = client();
    let sys = "You are a helpful assistant. Answer in one word.";
    let one = |c: reqwest::Client, url: String, i: usize| async move {
        match i % 10 {
            // Generations (prefix-cached system prompt, a few tokens each).
            0..=3 => {
                let b = json!({"model": MODEL, "max_tokens": 1 + (i % 3), "temperature": 0, "system": sys,
                               "messages": [{"role": "user", "content": format!("Item {i}?")}]});
                let r = c.post(format!("{url}/v1/messages")).json(&b).send().await.unwrap();
                assert_eq!(r.status(), 200);
                r.bytes().await.unwrap();
            }
            // A stream the client abandons after the first bytes.
            4 => {
                let b = json!({"model": MODEL, "max_tokens": 64, "stream": true, "system": sys,
                               "messages": [{"role": "user", "content": format!("Tell a story {i}.")}]});
                let r = c.post(format!("{url}/v1/messages")).json(&b).send().await.unwrap();
                assert_eq!(r.status(), 200);
                let mut st = r.bytes_stream();
                let _ = st.next().await;
            }
            // Errors of several kinds.
            5 => {
                let r = c.post(format!("{url}/v1/messages")).body("{nope").header("content-type", "application/json").send().await.unwrap();
                assert_eq!(r.status(), 400);
            }
            6 => {
                let b = json!({"model": "missing", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]});
                assert_eq!(c.post(format!("{url}/v1/messages")).json(&b).send().await.unwrap().status(), 404);
            }
            7 => {
                let b = json!({"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "image"}]}]});
                assert_eq!(c.post(format!("{url}/v1/messages")).json(&b).send().await.unwrap().status(), 400);
            }
            // Token counting and the OpenAI path.
            8 => {
                let b = json!({"model": MODEL, "system": sys, "messages": [{"role": "user", "content": format!("Count {i}")}]});
                assert_eq!(c.post(format!("{url}/v1/messages/count_tokens")).json(&b).send().await.unwrap().status(), 200);
            }
            _ => {
                let b = json!({"model": MODEL, "max_tokens": 1, "temperature": 0,
                               "messages": [{"role": "system", "content": sys}, {"role": "user", "content": format!("Q{i}")}]});
                let r = c.post(format!("{url}/v1/chat/completions")).json(&b).send().await.unwrap();
                assert_eq!(r.status(), 200);
                r.bytes().await.unwrap();
            }
        }
    };
    let run = |from: usize, to: usize| {
        let c = c.clone();
        let base = s.base.clone();
        async move {
            let mut next = from;
            let mut inflight = futures::stream::FuturesUnordered::new();
            while next < to || !inflight.is_empty() {
                while next < to && inflight.len() < 8 {
                    inflight.push(tokio::spawn(one(c.clone(), base.clone(), next)));
                    next += 1;
                }
                if let Some(r) = inflight.next().await {
                    r.unwrap();
                }
            }
        }
    };
    // Warm-up, then the baseline.
    tokio::time::timeout(Duration::from_secs(300), run(0, 200)).await.expect("warm-up finishes");
    let rss0 = rss_bytes();
    tokio::time::timeout(Duration::from_secs(900), run(200, 2000)).await.expect("2,000 requests finish");
    // KV blocks all free again (cached blocks count as free).
    tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let page = c.get(s.url("/metrics")).send().await.unwrap().text().await.unwrap();
            if metric(&page, "zerolayer_kv_blocks_free") == metric(&page, "zerolayer_kv_blocks_total") {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await
    .expect("KV blocks back at baseline");
    let rss1 = rss_bytes();
    eprintln!("RSS after warm-up {rss0} bytes, after 2,000 requests {rss1} bytes");
    assert!((rss1 as f64) < rss0 as f64 * 1.10, "RSS grew more than 10%: {rss0} -> {rss1}");
    s.stop().await.unwrap();
}

/// Past the grace period, an open stream ends with an SSE `error` event, never a silent cut.
/// The stream is kept busy deterministically: a long prompt prefilled 8 tokens per step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_past_the_grace_period_end_with_an_error_event() {
    let _g = heavy();
    let s = TestServer::start(|c| {
        c.server.shutdown_grace_secs = 1;
        c.server.ping_interval_ms = 200;
        // A prefill of ~1,350 tokens at 2 per step: hundreds of steps, well past the 1 s grace
        // period however fast the kernels get.
        c.nodes[0].workers[0].max_batch_tokens = 2;
    })
    .await;
    let c = client();
    let body = json!({"model": MODEL, "max_tokens": 16, "stream": true, "temperature": 0,
                      "messages": [{"role": "user", "content": format!("{}\nSummarize.", LOREM.repeat(8))}]});
    let r = c.post(s.url("/v1/messages")).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let mut st = r.bytes_stream();
    let mut raw = String::new();
    while !raw.contains("message_start") {
        raw.push_str(&String::from_utf8_lossy(&st.next().await.unwrap().unwrap()));
    }
    let stopping = tokio::spawn(s.stop());
    let t0 = Instant::now();
    while let Some(chunk) = tokio::time::timeout(Duration::from_secs(30), st.next()).await.expect("stream ends") {
        raw.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
    }
    assert!(t0.elapsed() < Duration::from_secs(10), "ended soon after the 1 s grace period");
    let events = parse_sse(&raw);
    let (name, data) = events.last().unwrap();
    assert_eq!(name, "error", "last event: {raw}");
    assert_eq!(data["error"]["type"], "overloaded_error");
    assert!(!raw.contains("message_stop"), "the prompt was still being prefilled: {raw}");
    stopping.await.unwrap().unwrap();
}
