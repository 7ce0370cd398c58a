//! Anthropic prompt-caching semantics on the prefix cache, through HTTP on the real model:
//! `cache_control` breakpoints decide how `usage` splits the prompt into tokens read from the
//! cache, written to it (by TTL), and plain input; and the prefixes they name stay pinned in the
//! worker's prefix cache for their TTL.

use std::time::Duration;

use serde_json::{json, Value};
use zerolayer_tests::*;

const MODEL: &str = "smollm2-135m-instruct";

fn body(system: &str, ttl: Option<&str>, user: &str) -> Value {
    let mut cc = json!({"type": "ephemeral"});
    if let Some(t) = ttl {
        cc["ttl"] = json!(t);
    }
    json!({
        "model": MODEL, "max_tokens": 2, "temperature": 0,
        "system": [{"type": "text", "text": "You are a careful reader."}, {"type": "text", "text": system, "cache_control": cc}],
        "messages": [{"role": "user", "content": user}],
    })
}

/// POSTs `b` to `/v1/messages`: the status and the JSON body.
fn messages(c: &reqwest::Client, s: &TestServer, b: Value) -> impl std::future::Future<Output = (u16, Value)> {
    let req = c.post(s.url("/v1/messages")).json(&b);
    async move {
        let r = req.send().await.unwrap();
        let status = r.status().as_u16();
        (status, r.json::<Value>().await.unwrap())
    }
}

fn total(u: &Value) -> u64 {
    ["input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens"].iter().map(|k| u[k].as_u64().unwrap()).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn breakpoints_split_usage_into_written_read_and_input() {
    let _g = heavy();
    let s = TestServer::start(|_| {}).await;
    let c = http_client(120);
    let post = |b: Value| messages(&c, &s, b);
    let system = LOREM.repeat(2);

    // First call: the system prompt up to its breakpoint is written, nothing is read.
    let (st, v) = post(body(&system, None, "Summarise the text in one word.")).await;
    assert_eq!(st, 200, "{v}");
    let u = &v["usage"];
    let written = u["cache_creation_input_tokens"].as_u64().unwrap();
    assert_eq!(u["cache_read_input_tokens"], 0, "{u}");
    assert!(written > 300, "the ~{}-byte system prompt was written: {u}", system.len());
    assert_eq!(u["cache_creation"]["ephemeral_5m_input_tokens"].as_u64().unwrap(), written);
    assert_eq!(u["cache_creation"]["ephemeral_1h_input_tokens"], 0);
    let input = u["input_tokens"].as_u64().unwrap();
    assert!(input > 0 && input < 40, "only the user turn and the scaffolding after the breakpoint are input: {u}");
    let prompt = total(u);

    // The same request again: the reverse. Read from the cache, nothing written.
    let (st, v) = post(body(&system, None, "Summarise the text in one word.")).await;
    assert_eq!(st, 200);
    let u = &v["usage"];
    assert_eq!(u["cache_creation_input_tokens"], 0, "{u}");
    assert!(u["cache_read_input_tokens"].as_u64().unwrap() >= written, "{u}");
    assert_eq!(total(u), prompt, "the three parts always add up to the prompt");

    // A new question after the cached system prompt: still read, and the breakpoint's prefix
    // is all cached, so nothing is written.
    let (_, v) = post(body(&system, None, "Which century does it mention?")).await;
    let u = &v["usage"];
    assert!(u["cache_read_input_tokens"].as_u64().unwrap() >= written - 4, "{u}");
    assert_eq!(u["cache_creation_input_tokens"], 0, "{u}");

    // A one-hour breakpoint on new text, streamed: message_start reports it under 1h.
    let mut b = body(&format!("{system} Second edition."), Some("1h"), "Hi");
    b["stream"] = json!(true);
    let raw = c.post(s.url("/v1/messages")).json(&b).send().await.unwrap().text().await.unwrap();
    let events = parse_sse(&raw);
    let start = &events.iter().find(|(e, _)| e == "message_start").unwrap().1["message"]["usage"];
    let h = start["cache_creation"]["ephemeral_1h_input_tokens"].as_u64().unwrap();
    assert!(h > 0 && h == start["cache_creation_input_tokens"].as_u64().unwrap(), "{start}");
    assert!(start["cache_read_input_tokens"].as_u64().unwrap() > 0, "the shared start of the system prompt is read: {start}");

    // Top-level cache_control (automatic caching): the breakpoint is the end of the last
    // message, so all but the assistant scaffolding is written.
    let (_, v) = post(json!({"model": MODEL, "max_tokens": 2, "temperature": 0, "cache_control": {"type": "ephemeral"},
        "messages": [{"role": "user", "content": format!("Third: {system}")}]}))
    .await;
    let u = &v["usage"];
    assert!(u["cache_creation_input_tokens"].as_u64().unwrap() > 300 && u["input_tokens"].as_u64().unwrap() < 10, "{u}");

    // Without a breakpoint nothing counts as written, whatever the prefix cache holds.
    let (_, v) = post(json!({"model": MODEL, "max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": format!("Fourth: {system}")}]})).await;
    assert_eq!(v["usage"]["cache_creation_input_tokens"], 0, "{v}");

    // At most four breakpoints, as the official API.
    let block = json!({"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}});
    let (st, v) = post(json!({"model": MODEL, "max_tokens": 2, "system": [block, block, block],
        "messages": [{"role": "user", "content": [block, block]}]}))
    .await;
    assert_eq!(st, 400, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("A maximum of 4 blocks with cache_control"), "{v}");
    s.stop().await.unwrap();
}

/// A `cache_control` prefix is pinned for its TTL: a flood of unrelated prompts, several times
/// the KV cache, evicts an unpinned prefix under LRU, and the pinned one is still read from the
/// cache afterwards. (With `pinned_kv_share = 0` the pinned prefix is evicted too: checked by
/// hand, 0 tokens read.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pinned_prefix_survives_a_flood_that_evicts_an_unpinned_one() {
    let _g = heavy();
    // About 1,000 tokens of KV (SmolLM2 keeps 45 KiB a token), half of it open to pins.
    let s = TestServer::start(|c| c.nodes[0].workers[0].kv_cache_mb = 44).await;
    let c = http_client(120);
    let post = |b: Value| {
        let r = messages(&c, &s, b);
        async move {
            let (status, v) = r.await;
            assert_eq!(status, 200, "{v}");
            v["usage"].clone()
        }
    };
    let text = &LOREM[..LOREM.len().min(700)];
    let pinned = body(&format!("Reference A. {text}"), None, "One word?");
    let unpinned = json!({"model": MODEL, "max_tokens": 2, "temperature": 0, "system": format!("Reference B. {text}"),
                          "messages": [{"role": "user", "content": "One word?"}]});
    let written = post(pinned.clone()).await["cache_creation_input_tokens"].as_u64().unwrap();
    assert!(written > 100, "the pinned system prompt was written: {written}");
    // Every full block up to the breakpoint is pinned (block size 4), as the signals say once
    // they are next published.
    let mut pinned_blocks = 0;
    for _ in 0..50 {
        pinned_blocks = s.frontend.worker_signals()[0].1.kv_blocks_pinned as u64;
        if pinned_blocks == written / 4 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(pinned_blocks, written / 4, "pinned blocks in the worker's signals");
    let u = post(unpinned.clone()).await;
    assert_eq!(u["cache_creation_input_tokens"], 0, "no breakpoint, nothing written: {u}");
    // Both are in the cache now.
    assert!(post(unpinned.clone()).await["cache_read_input_tokens"].as_u64().unwrap() > 100);

    // The flood: 16 prompts of ~180 tokens, none sharing more than the template's first tokens.
    for i in 0..16 {
        let flood = json!({"model": MODEL, "max_tokens": 1, "temperature": 0, "system": format!("Flood {i}: {text}"),
                           "messages": [{"role": "user", "content": format!("Item {i}?")}]});
        post(flood).await;
    }
    let a = post(pinned).await;
    let read = a["cache_read_input_tokens"].as_u64().unwrap();
    assert!(read + 4 >= written, "the pinned prefix ({written} tokens, all but its last partial block) survived the flood: {a}");
    let b = post(unpinned).await;
    assert!(b["cache_read_input_tokens"].as_u64().unwrap() < 16, "the unpinned prefix was evicted under LRU (only shared scaffolding is read): {b}");
    s.stop().await.unwrap();
}

/// Tenants share only what an operator says: a named key's prefixes (the default scope, `key`)
/// are read from the cache by that key alone, so another key sending the very same prompt reads
/// none of it (and cannot learn that it was sent); keys with `cache_scope = "shared"` share;
/// a request's `cache_salt` isolates within a scope; cache-miss diagnostics find only the same
/// scope's messages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_scopes_keep_tenants_apart() {
    use zerolayer_common::config::{CacheScope, KeyConfig};
    let _g = heavy();
    let key = |name: &str, scope| KeyConfig { name: name.into(), key: format!("sk-{name}-0123456789"), cache_scope: scope, ..Default::default() };
    let s = TestServer::start(|c| {
        c.auth.keys = vec![key("alice", CacheScope::Key), key("bob", CacheScope::Key), key("carol", CacheScope::Shared), key("dave", CacheScope::Shared)];
    })
    .await;
    let c = http_client(120);
    let system = format!("You are the archivist of the northern library. {}", "Catalogue every scroll twice. ".repeat(20));
    let ask = |who: &str, extra: Value| {
        let mut b = json!({"model": MODEL, "max_tokens": 1, "temperature": 0, "system": system, "messages": [{"role": "user", "content": "Which scroll?"}]});
        b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let req = c.post(s.url("/v1/messages")).header("x-api-key", format!("sk-{who}-0123456789")).json(&b);
        async move {
            let r = req.send().await.unwrap();
            let status = r.status().as_u16();
            (status, r.json::<Value>().await.unwrap())
        }
    };
    let read = |v: &Value| v["usage"]["cache_read_input_tokens"].as_u64().unwrap();
    let (st, first) = ask("alice", json!({})).await;
    assert_eq!((st, read(&first)), (200, 0), "{first}");
    let (_, again) = ask("alice", json!({})).await;
    assert!(read(&again) > 100, "a key reads its own prefix from the cache: {again}");
    let (_, bob) = ask("bob", json!({})).await;
    assert_eq!(read(&bob), 0, "another key with the default scope reads nothing of alice's prefix: {bob}");
    let (_, carol) = ask("carol", json!({})).await;
    assert_eq!(read(&carol), 0, "the shared scope is not alice's: {carol}");
    let (_, dave) = ask("dave", json!({})).await;
    assert!(read(&dave) > 100, "keys of the shared scope share: {dave}");
    let (_, salted) = ask("dave", json!({"cache_salt": "project-x"})).await;
    assert_eq!(read(&salted), 0, "a salt isolates within the scope: {salted}");
    let (_, salted_again) = ask("carol", json!({"cache_salt": "project-x"})).await;
    assert!(read(&salted_again) > 100, "the same salt in the same scope shares: {salted_again}");
    let (st, bad) = ask("carol", json!({"cache_salt": 7})).await;
    assert_eq!((st, bad["error"]["type"].as_str()), (400, Some("invalid_request_error")), "{bad}");
    // Diagnostics: alice's message is found by alice, and by no one else.
    let id = first["id"].as_str().unwrap();
    let (_, own) = ask("alice", json!({"diagnostics": {"previous_message_id": id}})).await;
    assert_eq!(own["diagnostics"], json!({"cache_miss_reason": null}), "{own}");
    let (_, other) = ask("bob", json!({"diagnostics": {"previous_message_id": id}})).await;
    assert_eq!(other["diagnostics"]["cache_miss_reason"]["type"], "previous_message_not_found", "{other}");
    s.stop().await.unwrap();
}
