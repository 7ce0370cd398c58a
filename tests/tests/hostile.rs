//! Hostile and malformed input, auth, rate limits and overload, against a live node on the real
//! model. Every bad request gets the right status and the Anthropic error shape, and the node
//! keeps serving.

use std::time::Duration;

use futures::StreamExt;
use serde_json::{json, Value};
use zerolayer_tests::*;

const MODEL: &str = "smollm2-135m-instruct";

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
    let c = http_client(120);
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
    // max_tokens beyond the context is clamped to the room left (agents send 32000), but a
    // prompt that leaves no room is refused.
    j("prompt beyond the context", with(ok_body(), |b| b["messages"][0]["content"] = json!("word ".repeat(9000))), 400, "invalid_request_error");
    j("missing messages", with(ok_body(), |b| drop(b.as_object_mut().unwrap().remove("messages"))), 400, "invalid_request_error");
    j("messages is an object", with(ok_body(), |b| b["messages"] = json!({"role": "user"})), 400, "invalid_request_error");
    j("messages is empty", with(ok_body(), |b| b["messages"] = json!([])), 400, "invalid_request_error");
    j("message is a string", with(ok_body(), |b| b["messages"] = json!(["hi"])), 400, "invalid_request_error");
    j("role missing", with(ok_body(), |b| b["messages"] = json!([{"content": "hi"}])), 400, "invalid_request_error");
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
    j("output format without a schema", with(ok_body(), |b| b["output_config"] = json!({"format": {"type": "json_schema"}})), 400, "invalid_request_error");
    j("output format of a regex", with(ok_body(), |b| b["output_config"] = json!({"format": {"type": "regex", "schema": {}}})), 400, "invalid_request_error");
    j(
        "output schema with look-around",
        with(ok_body(), |b| b["output_config"] = json!({"format": {"type": "json_schema", "schema": {"type": "string", "pattern": "(?=a)"}}})),
        400,
        "invalid_request_error",
    );
    // A schema nested 30 objects deep (90 JSON levels, under the body's nesting limit):
    // compiled within llguidance's fuel limits and answered, or refused, never a stalled node.
    let mut deep = json!({"type": "integer"});
    for _ in 0..30 {
        deep = json!({"type": "object", "properties": {"a": deep}, "required": ["a"]});
    }
    let nested_schema = with(ok_body(), |b| b["output_config"] = json!({"format": {"type": "json_schema", "schema": deep}}));
    let st = c.post(s.url("/v1/messages")).json(&nested_schema).send().await.unwrap().status().as_u16();
    assert!(st == 200 || st == 400, "a deeply nested schema: {st}");
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

/// Overload is refused at once, without waiting for any work: the engine is held in a step
/// while the burst arrives, so every 529 must come back while nothing at all can finish. Then
/// the admitted streams complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_gets_fast_529_and_admitted_streams_complete() {
    let _g = heavy();
    // The peak is this test's own: reset the high-water mark other tests in this binary left.
    std::fs::write("/proc/self/clear_refs", "5").expect("reset VmHWM");
    let s = TestServer::start(|c| c.server.max_inflight = 4).await;
    let gate = s.hold_steps().await;
    let c = http_client(120);
    let stream_body = |i: usize| {
        json!({"model": MODEL, "max_tokens": 24, "stream": true, "temperature": 0,
               "messages": [{"role": "user", "content": format!("Count to {i}.")}]})
    };
    // One stream takes the engine into a step, where the gate holds it.
    gate.hold();
    let first = tokio::spawn(c.post(s.url("/v1/messages")).json(&stream_body(0)).send());
    gate.wait_blocked(Duration::from_secs(60)).await;
    let (tx, mut rx) = tokio::sync::mpsc::channel(16);
    for i in 1..=16 {
        let (c, url, tx) = (c.clone(), s.url("/v1/messages"), tx.clone());
        let body = stream_body(i);
        tokio::spawn(async move {
            let r = c.post(url).json(&body).send().await.unwrap();
            let st = r.status().as_u16();
            let text = r.text().await.unwrap();
            let _ = tx.send((st, text)).await;
        });
    }
    drop(tx);
    // 3 more fit the in-flight cap of 4 (and wait for the engine); the other 13 are refused
    // while the engine is still held.
    let mut overloaded = 0;
    while overloaded < 13 {
        let (st, body) = tokio::time::timeout(Duration::from_secs(60), rx.recv()).await.expect("529s arrive while the engine is held").unwrap();
        assert_eq!(st, 529, "only refusals can arrive while the engine is held: {body}");
        assert!(body.contains("overloaded_error"), "{body}");
        overloaded += 1;
    }
    assert_eq!(gate.steps(), 1, "no step ran past the gate while the 529s came back");
    gate.release();
    let first = first.await.unwrap().unwrap();
    assert_eq!(first.status(), 200);
    assert!(first.text().await.unwrap().contains("event: message_stop"));
    let mut ok = 0;
    while let Some((st, body)) = tokio::time::timeout(Duration::from_secs(300), rx.recv()).await.expect("the admitted streams finish") {
        assert_eq!(st, 200, "{body}");
        assert!(body.contains("event: message_stop"), "{body}");
        ok += 1;
    }
    assert_eq!(ok, 3, "the admitted streams complete");
    // Bound: the model (≈100 MB) and a 256 MB KV cache, plus runtime and test overhead.
    let peak = peak_rss_bytes();
    eprintln!("peak RSS during the overload test: {} MB", peak >> 20);
    assert!(peak < 1_000_000_000, "peak RSS {peak} bytes");
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
    let c = http_client(120);
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
    // Warm-up, then N requests, then N more: what a leak adds grows with the count, so the
    // second N must add (almost) nothing on top of the first.
    let idle = |label: &'static str| {
        let (c, s2) = (c.clone(), s.frontend.clone());
        let url = s.url("/metrics");
        async move {
            tokio::time::timeout(Duration::from_secs(30), async {
                loop {
                    let page = c.get(&url).send().await.unwrap().text().await.unwrap();
                    let blocks_free = metric(&page, "zerolayer_kv_blocks_free") == metric(&page, "zerolayer_kv_blocks_total");
                    let sig = s2.workers[0].handle.signals();
                    if blocks_free && sig.running == 0 && sig.waiting == 0 && s2.in_flight() == 0 && s2.placement_marks().0 == 0 {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            })
            .await
            .unwrap_or_else(|_| panic!("{label}: blocks, sequences, in-flight slots and placement marks back to zero"));
            assert_eq!(s2.cluster.serving_remote.load(std::sync::atomic::Ordering::Acquire), 0);
        }
    };
    tokio::time::timeout(Duration::from_secs(300), run(0, 200)).await.expect("warm-up finishes");
    idle("after the warm-up").await;
    let rss0 = rss_bytes();
    tokio::time::timeout(Duration::from_secs(900), run(200, 1100)).await.expect("N requests finish");
    idle("after N").await;
    let rss1 = rss_bytes();
    tokio::time::timeout(Duration::from_secs(900), run(1100, 2000)).await.expect("2N requests finish");
    idle("after 2N").await;
    let rss2 = rss_bytes();
    let (first, second) = (rss1 as i64 - rss0 as i64, rss2 as i64 - rss1 as i64);
    eprintln!("RSS after warm-up {} MB; growth over the first 900 requests {} KB, over the next 900 {} KB", rss0 >> 20, first >> 10, second >> 10);
    // 900 requests: a leak of 4 KB per request would add 3.5 MB.
    assert!(second < 3_500_000, "RSS grew by {second} bytes over 900 requests after the first 900 (first 900: {first})");
    s.stop().await.unwrap();
}

/// Past the grace period, an open stream ends with an SSE `error` event, never a silent cut.
/// The stream is kept busy by an event, not a speed: the engine is held in a step until the
/// error has arrived.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_past_the_grace_period_end_with_an_error_event() {
    let _g = heavy();
    let s = TestServer::start(|c| {
        c.server.shutdown_grace_secs = 1;
        c.server.ping_interval_ms = 200;
    })
    .await;
    let gate = s.hold_steps().await;
    let c = http_client(120);
    let body = json!({"model": MODEL, "max_tokens": 16, "stream": true, "temperature": 0,
                      "messages": [{"role": "user", "content": "Tell me a story."}]});
    // The first step (its events carry message_start) passes; the next is held.
    gate.hold_after(1);
    let r = c.post(s.url("/v1/messages")).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let mut st = r.bytes_stream();
    let mut raw = String::new();
    read_stream_until(&mut st, &mut raw, 60, "message_start", |r| r.contains("message_start")).await;
    gate.wait_blocked(Duration::from_secs(60)).await;
    let stopping = tokio::spawn(s.stop());
    while let Some(chunk) = tokio::time::timeout(Duration::from_secs(30), st.next()).await.expect("stream ends") {
        raw.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
    }
    let events = parse_sse(&raw);
    let (name, data) = events.last().unwrap();
    assert_eq!(name, "error", "last event: {raw}");
    assert_eq!(data["error"]["type"], "overloaded_error");
    assert!(!raw.contains("message_stop"), "the engine was held: {raw}");
    // The engine thread can stop once it is let go.
    gate.release();
    stopping.await.unwrap().unwrap();
}
