//! The HTTP API on the real model: stream shape on raw bytes, determinism against the engine,
//! errors, headers, concurrency and cancellation.

use std::time::Duration;

use futures::StreamExt;
use serde_json::{json, Value};
use zerolayer_common::SamplingParams;
use zerolayer_worker::chat::ChatMessage;
use zerolayer_worker::engine::{Engine, EngineConfig};
use zerolayer_tests::*;

fn client() -> reqwest::Client {
    reqwest::Client::builder().timeout(Duration::from_secs(120)).build().unwrap()
}

fn msg_body(text: &str, max_tokens: u32, stream: bool) -> Value {
    json!({"model": "smollm2-135m-instruct", "max_tokens": max_tokens, "stream": stream, "temperature": 0,
           "system": "You are a helpful assistant.", "messages": [{"role": "user", "content": text}]})
}

async fn within<T>(secs: u64, what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(secs), f).await.unwrap_or_else(|_| panic!("timed out: {what}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_shape_matches_the_contract_on_raw_bytes() {
    let _g = heavy();
    let s = TestServer::start(|_| {}).await;
    let c = client();
    let resp = within(120, "stream", c.post(s.url("/v1/messages")).header("anthropic-version", "2023-06-01").json(&msg_body("Name three colors.", 24, true)).send())
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(resp.headers()["content-type"].to_str().unwrap().starts_with("text/event-stream"));
    assert!(resp.headers().contains_key("request-id"));
    assert_eq!(resp.headers()["zerolayer-worker"], "n1/cpu0");
    let body = String::from_utf8(resp.bytes().await.unwrap().to_vec()).unwrap();
    let events = parse_sse(&body);
    for (name, data) in &events {
        assert_eq!(Some(name.as_str()), data["type"].as_str(), "event name equals type");
    }
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).filter(|n| *n != "ping").collect();
    assert_eq!(names[0], "message_start");
    assert_eq!(names[1], "content_block_start");
    assert_eq!(names[names.len() - 3], "content_block_stop");
    assert_eq!(names[names.len() - 2], "message_delta");
    assert_eq!(names[names.len() - 1], "message_stop");
    assert!(names[2..names.len() - 3].iter().all(|n| *n == "content_block_delta"));
    let start = &events[0].1["message"];
    assert!(start["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(start["role"], "assistant");
    assert_eq!(start["content"], json!([]));
    assert_eq!(start["stop_reason"], Value::Null);
    assert!(start["usage"]["input_tokens"].as_u64().unwrap() > 10);
    let mut text = String::new();
    for (name, d) in &events {
        match name.as_str() {
            "content_block_start" => {
                assert_eq!(d["index"], 0);
                assert_eq!(d["content_block"], json!({"type": "text", "text": ""}));
            }
            "content_block_delta" => {
                assert_eq!(d["index"], 0);
                assert_eq!(d["delta"]["type"], "text_delta");
                text.push_str(d["delta"]["text"].as_str().unwrap());
            }
            "content_block_stop" => assert_eq!(d["index"], 0),
            _ => {}
        }
    }
    let delta = &events.iter().find(|(n, _)| n == "message_delta").unwrap().1;
    assert!(["end_turn", "max_tokens"].contains(&delta["delta"]["stop_reason"].as_str().unwrap()));
    assert!(delta["usage"]["output_tokens"].as_u64().unwrap() > 0);

    // The same request without streaming gives the same text (temperature 0 is deterministic).
    let r: Value = c.post(s.url("/v1/messages")).json(&msg_body("Name three colors.", 24, false)).send().await.unwrap().json().await.unwrap();
    assert_eq!(r["content"][0]["text"].as_str().unwrap(), text);
    assert_eq!(r["usage"]["output_tokens"], delta["usage"]["output_tokens"]);
    s.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn temperature_zero_over_http_equals_the_engine() {
    let _g = heavy();
    let question = "Explain in one sentence why the sky is blue.";
    // Direct engine output for the same rendered prompt.
    let loaded = load_default();
    let prompt = loaded
        .template
        .render_for_generation(&[ChatMessage::new("system", "You are a helpful assistant."), ChatMessage::new("user", question)])
        .unwrap();
    let ids = loaded.tokenizer.encode(&prompt).unwrap();
    let tok = loaded.tokenizer.clone();
    let mut engine = Engine::new(loaded.model, loaded.tokenizer, &EngineConfig::default()).unwrap();
    engine.add(1, ids.clone(), SamplingParams::greedy(40)).unwrap();
    let mut toks = vec![];
    while engine.has_work() {
        for (_, ev) in engine.step().unwrap().events {
            if let zerolayer_common::SeqEvent::Delta { tokens, .. } = ev {
                toks.extend(tokens);
            }
        }
    }
    drop(engine);
    let direct = tok.decode(&toks).unwrap();

    let s = TestServer::start(|_| {}).await;
    let c = client();
    let mut texts = vec![];
    for _ in 0..2 {
        let r: Value = c.post(s.url("/v1/messages")).json(&msg_body(question, 40, false)).send().await.unwrap().json().await.unwrap();
        assert_eq!(r["usage"]["input_tokens"].as_u64().unwrap() + r["usage"]["cache_read_input_tokens"].as_u64().unwrap(), ids.len() as u64);
        texts.push(r["content"][0]["text"].as_str().unwrap_or("").to_string());
    }
    assert_eq!(texts[0], texts[1], "deterministic");
    assert_eq!(texts[0], direct, "HTTP output equals the engine's direct output");
    // count_tokens agrees with the prompt the engine saw.
    let n: Value = c
        .post(s.url("/v1/messages/count_tokens"))
        .json(&json!({"model": "smollm2-135m-instruct", "system": "You are a helpful assistant.", "messages": [{"role": "user", "content": question}]}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(n["input_tokens"].as_u64().unwrap(), ids.len() as u64);
    s.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_models_and_openai() {
    let _g = heavy();
    let s = TestServer::start(|c| c.server.max_body_bytes = 64 * 1024).await;
    let c = client();
    let check = |status: u16, ty: &'static str| {
        move |(st, body, rid): (u16, Value, String)| {
            assert_eq!(st, status, "{body}");
            assert_eq!(body["type"], "error");
            assert_eq!(body["error"]["type"], ty, "{body}");
            assert!(body["error"]["message"].as_str().unwrap().len() > 5);
            assert_eq!(body["request_id"].as_str().unwrap(), rid);
        }
    };
    async fn post(c: &reqwest::Client, url: String, body: reqwest::Body) -> (u16, Value, String) {
        let r = c.post(url).header("content-type", "application/json").body(body).send().await.unwrap();
        let rid = r.headers()["request-id"].to_str().unwrap().to_string();
        (r.status().as_u16(), r.json().await.unwrap(), rid)
    }
    let url = s.url("/v1/messages");
    check(400, "invalid_request_error")(post(&c, url.clone(), "{not json".into()).await);
    check(400, "invalid_request_error")(post(&c, url.clone(), json!({"model": "smollm2-135m-instruct", "messages": []}).to_string().into()).await);
    check(404, "not_found_error")(post(&c, url.clone(), json!({"model": "nope", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}).to_string().into()).await);
    check(413, "request_too_large")(post(&c, url.clone(), format!("{{\"pad\": \"{}\"}}", "x".repeat(100_000)).into()).await);
    check(400, "invalid_request_error")(
        post(&c, url.clone(), json!({"model": "smollm2-135m-instruct", "max_tokens": 5, "tools": [{"name": "t", "input_schema": {}}], "messages": [{"role": "user", "content": "hi"}]}).to_string().into()).await,
    );
    check(400, "invalid_request_error")(
        post(&c, url.clone(), json!({"model": "smollm2-135m-instruct", "max_tokens": 100000, "messages": [{"role": "user", "content": "hi"}]}).to_string().into()).await,
    );
    check(404, "not_found_error")({
        let r = c.get(s.url("/v1/nothing")).send().await.unwrap();
        let rid = r.headers()["request-id"].to_str().unwrap().to_string();
        (r.status().as_u16(), r.json().await.unwrap(), rid)
    });
    // Still serving.
    let ok = c.post(url.clone()).json(&msg_body("Say hi.", 4, false)).send().await.unwrap();
    assert_eq!(ok.status(), 200);
    let v: Value = ok.json().await.unwrap();
    assert_eq!(v["stop_reason"], "max_tokens");
    assert_eq!(v["usage"]["output_tokens"], 4);
    // max_tokens = 0 pre-warms: empty content.
    let v: Value = c.post(url.clone()).json(&msg_body("Say hi.", 0, false)).send().await.unwrap().json().await.unwrap();
    assert_eq!(v["content"], json!([]));
    assert_eq!(v["usage"]["output_tokens"], 0);

    // Models, both shapes in one.
    let m: Value = c.get(s.url("/v1/models")).send().await.unwrap().json().await.unwrap();
    assert_eq!(m["object"], "list");
    assert_eq!(m["data"][0]["id"], "smollm2-135m-instruct");
    assert_eq!(m["data"][0]["type"], "model");
    assert_eq!(m["data"][0]["object"], "model");
    assert_eq!(m["has_more"], false);
    let one = c.get(s.url("/v1/models/smollm2-135m-instruct")).send().await.unwrap();
    assert_eq!(one.status(), 200);
    assert_eq!(c.get(s.url("/v1/models/other")).send().await.unwrap().status(), 404);

    // OpenAI chat completions, plain and streamed.
    let body = json!({"model": "smollm2-135m-instruct", "temperature": 0, "max_tokens": 12,
                      "messages": [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "What is the capital of France?"}]});
    let v: Value = c.post(s.url("/v1/chat/completions")).json(&body).send().await.unwrap().json().await.unwrap();
    assert_eq!(v["object"], "chat.completion");
    let plain = v["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    assert!(plain.contains("Paris"), "{plain}");
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    let raw = c.post(s.url("/v1/chat/completions")).json(&sb).send().await.unwrap().text().await.unwrap();
    let ev = parse_sse(&raw);
    assert_eq!(ev.last().unwrap().1, json!("[DONE]"));
    let streamed: String = ev.iter().filter_map(|(_, d)| d["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(streamed, plain);
    let bad = c.post(s.url("/v1/chat/completions")).json(&json!({"model": "x", "messages": [{"role": "user", "content": "hi"}]})).send().await.unwrap();
    assert_eq!(bad.status(), 404);
    let bad: Value = bad.json().await.unwrap();
    assert!(bad["error"]["message"].is_string());

    // Health, readiness, metrics.
    assert_eq!(c.get(s.url("/health")).send().await.unwrap().status(), 200);
    assert_eq!(c.get(s.url("/ready")).send().await.unwrap().status(), 200);
    let page = c.get(s.url("/metrics")).send().await.unwrap().text().await.unwrap();
    for name in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
        "zerolayer_kv_blocks_free",
        "zerolayer_kv_fragmentation_ratio",
    ] {
        assert!(metric(&page, name).is_some(), "{name} missing from /metrics");
    }
    assert!(page.contains("vllm:time_to_first_token_seconds_bucket"), "TTFT histogram");
    assert!(page.contains("zerolayer_requests_total"), "request counter");
    s.stop().await.unwrap();
}

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
    let c = client();
    let worker = s.coordinator.workers[0].handle.clone();
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
                (s.url("/v1/messages"), msg_body(&format!("Write a short poem about the number {i}."), 32, true))
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

/// An idle stream (here: a long prompt prefilled in small chunks) gets `ping` events, and never
/// before `message_start`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_streams_get_pings_after_message_start() {
    let _g = heavy();
    let s = TestServer::start(|c| {
        c.server.ping_interval_ms = 100;
        c.nodes[0].workers[0].max_batch_tokens = 32;
    })
    .await;
    let long = LOREM.repeat(2);
    let body = json!({"model": "smollm2-135m-instruct", "max_tokens": 4, "stream": true, "temperature": 0,
                      "messages": [{"role": "user", "content": format!("{long}\nSummarize.")}]});
    let raw = client().post(s.url("/v1/messages")).json(&body).send().await.unwrap().text().await.unwrap();
    let events = parse_sse(&raw);
    assert_eq!(events[0].0, "message_start", "{raw}");
    assert!(events.iter().any(|(n, d)| n == "ping" && d["type"] == "ping"), "a ping while the prompt prefilled: {raw}");
    assert_eq!(events.last().unwrap().0, "message_stop");
    s.stop().await.unwrap();
}
