//! Tool use through HTTP on Qwen2.5-Coder-0.5B-Instruct (a model whose chat template renders
//! tools): Anthropic `tool_use` blocks and `stop_reason: "tool_use"`, streamed as
//! `content_block_start` + `input_json_delta`; OpenAI `tool_calls` and `finish_reason:
//! "tool_calls"`, streamed as `delta.tool_calls`; a round trip with the results; forced calls;
//! and the errors for what is not allowed. Greedy decoding, so every answer here is the model's own
//! (llama.cpp gives the same tokens for these prompts; `tests/tests/qwen.rs` checks prompts and
//! greedy tokens against it).

use serde_json::{json, Value};
use zerolayer_tests::*;

fn weather() -> Value {
    json!({"name": "get_weather", "description": "Get the current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"},
                                                              "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                            "required": ["city"]}})
}

fn question(stream: bool) -> Value {
    json!({"model": "qwen", "max_tokens": 200, "temperature": 0, "stream": stream, "tools": [weather()],
           "messages": [{"role": "user", "content": "What is the weather in Paris right now?"}]})
}

async fn post(c: &reqwest::Client, url: String, body: &Value) -> (u16, String) {
    let r = c.post(url).json(body).send().await.unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_tool_use_streamed_and_not_and_a_round_trip() {
    let _g = heavy();
    let s = TestServer::qwen().await;
    let c = http_client(180);

    let (st, body) = post(&c, s.url("/v1/messages"), &question(false)).await;
    assert_eq!(st, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["stop_reason"], "tool_use", "{v}");
    let blocks = v["content"].as_array().unwrap();
    let call = blocks.iter().find(|b| b["type"] == "tool_use").expect("a tool_use block");
    assert!(call["id"].as_str().unwrap().starts_with("toolu_"));
    assert_eq!(call["name"], "get_weather");
    assert_eq!(call["input"]["city"], "Paris", "{v}");

    // Streamed: the same call as content_block_start (input {}), input_json_delta, stop.
    let (st, raw) = post(&c, s.url("/v1/messages"), &question(true)).await;
    assert_eq!(st, 200, "{raw}");
    let events = parse_sse(&raw);
    let start = events.iter().find(|(n, d)| n == "content_block_start" && d["content_block"]["type"] == "tool_use").expect("tool_use start");
    let index = start.1["index"].clone();
    assert_eq!(start.1["content_block"]["name"], "get_weather");
    assert_eq!(start.1["content_block"]["input"], json!({}));
    let partial: String = events
        .iter()
        .filter(|(n, d)| n == "content_block_delta" && d["index"] == index)
        .map(|(_, d)| {
            assert_eq!(d["delta"]["type"], "input_json_delta");
            d["delta"]["partial_json"].as_str().unwrap().to_string()
        })
        .collect();
    let input: Value = serde_json::from_str(&partial).unwrap();
    assert_eq!(input, call["input"], "streamed and not, the same call");
    assert!(events.iter().any(|(n, d)| n == "content_block_stop" && d["index"] == index));
    let delta = &events.iter().find(|(n, _)| n == "message_delta").unwrap().1;
    assert_eq!(delta["delta"]["stop_reason"], "tool_use");

    // A round trip: the call and its result in the history, answered without tools.
    let mut rt = question(false);
    rt["tool_choice"] = json!({"type": "none"});
    rt["messages"] = json!([
        {"role": "user", "content": "What is the weather in Paris right now?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": call["id"], "name": "get_weather", "input": call["input"]}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"], "content": "18 degrees celsius, sunny"}]}]);
    let (st, body) = post(&c, s.url("/v1/messages"), &rt).await;
    assert_eq!(st, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["stop_reason"], "end_turn", "{v}");
    assert!(v["content"].as_array().unwrap().iter().all(|b| b["type"] == "text"), "no calls with tool_choice none: {v}");
    // The result reached the prompt: the answer reports it.
    let answer: String = v["content"].as_array().unwrap().iter().filter_map(|b| b["text"].as_str()).collect();
    assert!(answer.contains("18"), "the answer does not use the tool result: {answer:?}");

    // What is not allowed is the API's 400.
    for (field, value) in [
        ("tool_choice", json!({"type": "tool", "name": "get_time"})),
        ("tool_choice", json!({"type": "tool"})),
        ("tools", json!([{"name": "bad name", "input_schema": {"type": "object"}}])),
        ("tools", json!([{"type": "web_search_20250305", "name": "web_search"}])),
        ("tools", json!([weather(), weather()])),
    ] {
        let mut b = question(false);
        b[field] = value;
        let (st, body) = post(&c, s.url("/v1/messages"), &b).await;
        assert_eq!(st, 400, "{field}: {body}");
        assert!(body.contains(field), "{body}");
    }
    s.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_tool_calls_streamed_and_not() {
    let _g = heavy();
    let s = TestServer::qwen().await;
    let c = http_client(180);
    let body = |stream: bool| {
        json!({"model": "qwen", "max_tokens": 100, "temperature": 0, "stream": stream,
               "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}],
               "messages": [{"role": "user", "content": "What is the weather in Paris right now?"}]})
    };
    let (st, text) = post(&c, s.url("/v1/chat/completions"), &body(false)).await;
    assert_eq!(st, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    let call = &choice["message"]["tool_calls"][0];
    assert!(call["id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(call["type"], "function");
    assert_eq!(call["function"]["name"], "get_weather");
    let args: Value = serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args["city"], "Paris");

    let (st, raw) = post(&c, s.url("/v1/chat/completions"), &body(true)).await;
    assert_eq!(st, 200, "{raw}");
    let chunks: Vec<Value> = raw
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let calls: Vec<&Value> = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array()).flatten().collect();
    assert_eq!(calls.len(), 1, "{raw}");
    assert_eq!(calls[0]["index"], 0);
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    assert_eq!(serde_json::from_str::<Value>(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap(), args);
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "tool_calls");

    // History: an assistant message with tool_calls and a tool message are accepted.
    let mut rt = body(false);
    rt["tool_choice"] = json!("none");
    rt["messages"] = json!([
        {"role": "user", "content": "What is the weather in Paris right now?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees celsius, sunny"}]);
    let (st, text) = post(&c, s.url("/v1/chat/completions"), &rt).await;
    assert_eq!(st, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    // A forced call: the arguments hold to the function's schema (constrained decoding). The
    // prompt is one the model answers in text when the call is not forced, so only the
    // constraint can make this a call.
    let mut free = body(false);
    free["messages"] = json!([{"role": "user", "content": "Say hello in French."}]);
    let (st, text) = post(&c, s.url("/v1/chat/completions"), &free).await;
    assert_eq!(st, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "unforced, this prompt gets text: {v}");
    let mut forced = free.clone();
    forced["tool_choice"] = json!("required");
    let (st, text) = post(&c, s.url("/v1/chat/completions"), &forced).await;
    assert_eq!(st, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
    let args: Value = serde_json::from_str(v["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"].as_str().unwrap()).unwrap();
    assert!(args["city"].is_string(), "{v}");
    forced["tool_choice"] = json!({"type": "function", "function": {"name": "get_time"}});
    assert_eq!(post(&c, s.url("/v1/chat/completions"), &forced).await.0, 400);
    s.stop().await.unwrap();
}

/// The default model's template has no tools: offering some is a clear 400, not a silent drop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_without_tools_in_its_template_refuses_them() {
    let _g = heavy();
    let s = TestServer::start(|_| {}).await;
    let b = json!({"model": "smollm2-135m-instruct", "max_tokens": 5, "tools": [weather()], "messages": [{"role": "user", "content": "hi"}]});
    let (st, body) = post(&http_client(180), s.url("/v1/messages"), &b).await;
    assert_eq!(st, 400, "{body}");
    assert!(body.contains("not taught to call functions"), "{body}");
    s.stop().await.unwrap();
}
