//! The OpenAI routes' sampling on the real model: usage, finish reasons, errors and seeds;
//! penalties, `logit_bias` and `top_k` against the greedy answer; and `n` choices (distinct
//! and repeatable at a seed, the prompt computed once, streamed interleaved).

use serde_json::{json, Value};
use zerolayer_tests::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_usage_finish_reasons_errors_and_seeds() {
    let _g = heavy();
    let s = TestServer::start(|_| {}).await;
    let c = http_client(120);
    let url = s.url("/v1/chat/completions");
    let body = |max: u32, stream: bool| {
        json!({"model": "smollm2-135m-instruct", "temperature": 0, "max_tokens": max, "stream": stream,
               "stream_options": {"include_usage": true},
               "messages": [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "What is the capital of France?"}]})
    };
    // Cut short: "length"; ends on its own: "stop".
    let v: Value = c.post(&url).json(&body(3, false)).send().await.unwrap().json().await.unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 3);
    let total = v["usage"]["prompt_tokens"].as_u64().unwrap() + 3;
    assert_eq!(v["usage"]["total_tokens"].as_u64(), Some(total));
    let v: Value = c.post(&url).json(&body(200, false)).send().await.unwrap().json().await.unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    // Streamed: the finish chunk, then one usage chunk with no choices, then [DONE].
    let raw = c.post(&url).json(&body(3, true)).send().await.unwrap().text().await.unwrap();
    let ev = parse_sse(&raw);
    let n = ev.len();
    assert_eq!(ev[n - 1].1, json!("[DONE]"));
    assert_eq!(ev[n - 2].1["choices"], json!([]), "{raw}");
    assert_eq!(ev[n - 2].1["usage"]["completion_tokens"], 3);
    assert_eq!(ev[n - 2].1["usage"]["total_tokens"].as_u64(), Some(total));
    assert_eq!(ev[n - 3].1["choices"][0]["finish_reason"], "length");
    let mut no_usage = body(3, true);
    no_usage.as_object_mut().unwrap().remove("stream_options");
    let raw = c.post(&url).json(&no_usage).send().await.unwrap().text().await.unwrap();
    assert!(!raw.contains("\"usage\""), "usage only when asked for: {raw}");
    // Errors in OpenAI's shape.
    let r = c.post(&url).json(&json!({"model": "smollm2-135m-instruct", "messages": []})).send().await.unwrap();
    assert_eq!(r.status(), 400);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["type"], "invalid_request_error", "{e}");
    assert!(e["error"]["message"].as_str().unwrap().contains("messages"), "{e}");
    assert!(e["error"].get("param").is_some() && e["error"].get("code").is_some(), "{e}");
    assert!(e.get("type").is_none(), "not the Anthropic shape: {e}");
    // Seeded sampling at temperature 0.9 repeats exactly.
    let seeded = |seed: u64| json!({"model": "smollm2-135m-instruct", "temperature": 0.9, "seed": seed, "max_tokens": 24,
                                    "messages": [{"role": "user", "content": "Invent a name for a cat."}]});
    let mut texts = vec![];
    for seed in [1234u64, 1234, 1234, 77] {
        let v: Value = c.post(&url).json(&seeded(seed)).send().await.unwrap().json().await.unwrap();
        texts.push(v["choices"][0]["message"]["content"].as_str().unwrap().to_string());
    }
    assert!(texts[0] == texts[1] && texts[1] == texts[2], "the same seed, the same text: {texts:?}");
    eprintln!("seed 1234: {:?}; seed 77: {:?}", texts[0], texts[3]);
    s.stop().await.unwrap();
}

/// The sampling fields beyond OpenAI's core change the output as documented (here on
/// `/v1/completions`, which parses them as the chat route does): the frequency and repetition
/// penalties break a greedy repetition, `logit_bias` forces a token, `top_k: 1`
/// is greedy, and values out of range (or a token id outside the vocabulary) are 400s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_penalties_bias_and_top_k_change_the_output() {
    let _g = heavy();
    let s = TestServer::start(|_| {}).await;
    let c = http_client(120);
    // A raw prompt that greedy decoding continues by repeating it.
    let url = s.url("/v1/completions");
    let ask = |extra: Value| {
        let mut b = json!({"model": "smollm2-135m-instruct", "temperature": 0, "max_tokens": 24,
                           "prompt": "hello, hello, hello, hello, hello, hello, hello, hello,"});
        b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let (c, url) = (c.clone(), url.clone());
        async move {
            let r = c.post(&url).json(&b).send().await.unwrap();
            let status = r.status().as_u16();
            let v: Value = r.json().await.unwrap();
            (status, v["choices"][0]["text"].as_str().unwrap_or_default().to_string(), v)
        }
    };
    let hellos = |t: &str| t.to_lowercase().matches("hello").count();
    let (_, plain, _) = ask(json!({})).await;
    assert!(hellos(&plain) >= 10, "the greedy answer repeats itself: {plain:?}");
    for extra in [json!({"frequency_penalty": 2.0}), json!({"repetition_penalty": 2.0}), json!({"presence_penalty": 2.0, "frequency_penalty": 1.0})] {
        let (st, text, v) = ask(extra.clone()).await;
        assert_eq!(st, 200, "{v}");
        assert!(hellos(&text) < hellos(&plain), "{extra}: {text:?} repeats no less than {plain:?}");
    }
    let (_, greedy_k, _) = ask(json!({"temperature": 1.0, "top_k": 1, "seed": 5})).await;
    assert_eq!(greedy_k, plain, "top_k 1 is greedy");
    let banana = s.frontend.models[0].tokenizer.encode_text(" banana").unwrap()[0];
    let (_, forced, _) = ask(json!({"logit_bias": {banana.to_string(): 100}, "max_tokens": 3})).await;
    let word = s.frontend.models[0].tokenizer.decode(&[banana]).unwrap();
    assert_eq!(forced.trim(), word.repeat(3).trim(), "a +100 bias makes the token certain");
    for (extra, field) in [
        (json!({"presence_penalty": 3}), "presence_penalty"),
        (json!({"repetition_penalty": 0}), "repetition_penalty"),
        (json!({"min_p": 1.5}), "min_p"),
        (json!({"top_k": 1.5}), "top_k"),
        (json!({"logit_bias": {"x": 1}}), "logit_bias"),
        (json!({"logit_bias": {"7": 101}}), "logit_bias"),
        (json!({"logit_bias": {"10000000": 1}}), "vocabulary"),
    ] {
        let (st, _, v) = ask(extra.clone()).await;
        assert_eq!(st, 400, "{extra}: {v}");
        assert!(v["error"]["message"].as_str().unwrap().contains(field), "{extra}: {v}");
    }
    s.stop().await.unwrap();
}

/// The sum of every series of `name` on a metrics page.
fn total(page: &str, name: &str) -> f64 {
    page.lines()
        .filter(|l| l.split(['{', ' ']).next() == Some(name))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

/// `n` choices: at a seed, 4 different samples and the same 4 again, choice 0 the answer of
/// the same request with one choice; the prompt computed once (the other choices read it from
/// the prefix cache); usage counting the prompt once; a stream interleaving the choices by
/// `index` with one usage chunk at the end, each choice's text the whole answer's; greedy
/// choices alike; and `n` out of 1..=8 a 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_share_the_prompt_and_repeat_at_a_seed() {
    let _g = heavy();
    let s = TestServer::start(|_| {}).await;
    let c = http_client(300);
    let url = s.url("/v1/chat/completions");
    // Longer than one step's prefill (512 tokens): choices started at once would each compute
    // the part of the prompt choice 0 had not finished.
    let system = "You are a naming assistant for a pet shop. ".repeat(120);
    let ask = |n: u32, temperature: f32, stream: bool| {
        json!({"model": "smollm2-135m-instruct", "temperature": temperature, "seed": 99, "max_tokens": 24, "n": n, "stream": stream,
               "stream_options": {"include_usage": true},
               "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Invent a name for a cat."}]})
    };
    let texts = |v: &Value| -> Vec<String> {
        v["choices"].as_array().unwrap().iter().map(|c| c["message"]["content"].as_str().unwrap().to_string()).collect()
    };
    let metrics = || async { c.get(s.url("/metrics")).send().await.unwrap().text().await.unwrap() };
    let before = metrics().await;
    let v: Value = c.post(&url).json(&ask(4, 1.0, false)).send().await.unwrap().json().await.unwrap();
    let after = metrics().await;
    let four = texts(&v);
    let indexes: Vec<u64> = v["choices"].as_array().unwrap().iter().map(|c| c["index"].as_u64().unwrap()).collect();
    assert_eq!(indexes, vec![0, 1, 2, 3], "{v}");
    let distinct: std::collections::HashSet<&String> = four.iter().collect();
    assert_eq!(distinct.len(), 4, "4 different samples: {four:?}");
    // The prompt once: the three later choices read it from the prefix cache.
    let prompt = v["usage"]["prompt_tokens"].as_f64().unwrap();
    let read = total(&after, "zerolayer_input_tokens_total") - total(&before, "zerolayer_input_tokens_total");
    let cached = total(&after, "zerolayer_cached_input_tokens_total") - total(&before, "zerolayer_cached_input_tokens_total");
    eprintln!("n = 4: {prompt} prompt tokens; {read} read by the 4 sequences, {cached} of them from cache; {four:?}");
    assert!(prompt > 1200.0, "{v}");
    assert_eq!(read, 4.0 * prompt);
    assert!(read - cached <= prompt + 3.0 * 8.0, "the prompt was computed more than once: {cached} of {read} cached");
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0, "choice 0 computed it: {v}");
    let completion = v["usage"]["completion_tokens"].as_u64().unwrap();
    assert!((4..=96).contains(&completion) && v["usage"]["total_tokens"].as_f64() == Some(prompt + completion as f64), "{v}");
    // The same 4 again; choice 0 is the one-choice answer.
    let again: Value = c.post(&url).json(&ask(4, 1.0, false)).send().await.unwrap().json().await.unwrap();
    assert_eq!(texts(&again), four);
    let one: Value = c.post(&url).json(&ask(1, 1.0, false)).send().await.unwrap().json().await.unwrap();
    assert_eq!(texts(&one), vec![four[0].clone()]);
    // Streamed: chunks of the 3 choices by index, each ending with its finish reason, then one
    // usage chunk and [DONE]; each choice's text is the whole answer's.
    let raw = c.post(&url).json(&ask(3, 1.0, true)).send().await.unwrap().text().await.unwrap();
    let ev = parse_sse(&raw);
    assert_eq!(ev.last().unwrap().1, json!("[DONE]"));
    let usage_chunks: Vec<&Value> = ev.iter().filter(|(_, d)| d.get("usage").is_some_and(|u| !u.is_null())).map(|(_, d)| d).collect();
    assert_eq!(usage_chunks.len(), 1, "{raw}");
    assert_eq!(usage_chunks[0]["usage"]["prompt_tokens"].as_f64(), Some(prompt));
    let mut streamed = vec![String::new(); 3];
    let mut finished = [0; 3];
    for (_, d) in &ev {
        for ch in d["choices"].as_array().into_iter().flatten() {
            let i = ch["index"].as_u64().unwrap() as usize;
            streamed[i] += ch["delta"]["content"].as_str().unwrap_or_default();
            finished[i] += ch["finish_reason"].is_string() as usize;
        }
    }
    assert_eq!(finished, [1, 1, 1], "{raw}");
    assert_eq!(streamed, four[..3].to_vec(), "{raw}");
    // Greedy choices are alike; Completions has `n` too.
    let greedy: Value = c.post(&url).json(&ask(2, 0.0, false)).send().await.unwrap().json().await.unwrap();
    assert_eq!(texts(&greedy)[0], texts(&greedy)[1]);
    let comp = json!({"model": "smollm2-135m-instruct", "prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0, "seed": 3, "n": 3, "logprobs": 1});
    let v: Value = c.post(s.url("/v1/completions")).json(&comp).send().await.unwrap().json().await.unwrap();
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3, "{v}");
    for ch in choices {
        assert_eq!(ch["logprobs"]["tokens"].as_array().map(Vec::len), ch["logprobs"]["token_logprobs"].as_array().map(Vec::len), "{v}");
    }
    let mut streamed = comp.clone();
    streamed["stream"] = json!(true);
    let raw = c.post(s.url("/v1/completions")).json(&streamed).send().await.unwrap().text().await.unwrap();
    let mut texts3 = vec![String::new(); 3];
    for (_, d) in parse_sse(&raw) {
        for ch in d["choices"].as_array().into_iter().flatten() {
            texts3[ch["index"].as_u64().unwrap() as usize] += ch["text"].as_str().unwrap_or_default();
        }
    }
    let whole: Vec<String> = choices.iter().map(|c| c["text"].as_str().unwrap().to_string()).collect();
    assert_eq!(texts3, whole, "{raw}");
    for n in [0, 9] {
        let r = c.post(&url).json(&ask(n, 1.0, false)).send().await.unwrap();
        assert_eq!(r.status(), 400);
        let e: Value = r.json().await.unwrap();
        assert!(e["error"]["message"].as_str().unwrap().starts_with("n:"), "{e}");
    }
    s.stop().await.unwrap();
}
