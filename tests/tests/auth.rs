//! Auth and rate limits against a live node. In its own test binary: it installs a global
//! trace-level log capture (to prove keys never reach the logs), which must not affect other
//! tests' timing or memory.

use std::time::Duration;

use serde_json::{json, Value};
use zerolayer_tests::*;

const MODEL: &str = "smollm2-135m-instruct";

fn ok_body() -> Value {
    json!({"model": MODEL, "max_tokens": 1, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_rate_limits_and_keys_never_logged() {
    let _g = heavy();
    // Captures everything the process logs, to check that keys never appear.
    let logs = LogCapture::default();
    let _ = tracing_subscriber::fmt().with_env_filter("trace").with_writer(logs.clone()).try_init();
    let user = "sk-user-0123456789abcdef";
    let heavy_user = "sk-heavy-0123456789abcdef";
    let admin = "sk-admin-fedcba9876543210";
    // Keys from a file (comments and blank lines skipped) as well as inline.
    let dir = temp_dir("keys");
    let keys_file = dir.join("keys.txt");
    std::fs::write(&keys_file, format!("# user keys\n{user}\n\n  {heavy_user}  \n")).unwrap();
    let s = TestServer::start(|c| {
        c.auth.api_keys_file = Some(keys_file.clone());
        c.auth.admin_key = Some(admin.into());
        c.limits.requests_per_minute = 6;
        c.limits.tokens_per_minute = 2000;
    })
    .await;
    let c = http_client(120);
    let status = |r: &reqwest::Response| r.status().as_u16();

    // 401 without or with a wrong key, in the Anthropic shape.
    let r = c.post(s.url("/v1/messages")).json(&ok_body()).send().await.unwrap();
    assert_eq!(status(&r), 401);
    assert_eq!(r.json::<Value>().await.unwrap()["error"]["type"], "authentication_error");
    let r = c.post(s.url("/v1/messages")).header("x-api-key", "sk-wrong-key-000000").json(&ok_body()).send().await.unwrap();
    assert_eq!(status(&r), 401);
    // 403 for a user key on the admin API; the admin key works there.
    let r = c.get(s.url("/admin/status")).header("x-api-key", user).send().await.unwrap();
    assert_eq!(status(&r), 403);
    assert_eq!(r.json::<Value>().await.unwrap()["error"]["type"], "permission_error");
    assert_eq!(status(&c.get(s.url("/admin/status")).send().await.unwrap()), 401);
    let r = c.get(s.url("/admin/status")).header("x-api-key", admin).send().await.unwrap();
    assert_eq!(status(&r), 200);

    // Rate limit: 6 requests a minute. Remaining counts down; the 7th gets 429 + retry-after.
    let mut remaining = vec![];
    for i in 0..6 {
        let r = c.post(s.url("/v1/messages")).header("authorization", format!("Bearer {user}")).json(&ok_body()).send().await.unwrap();
        assert_eq!(status(&r), 200, "request {i}");
        let h = r.headers();
        assert_eq!(h["anthropic-ratelimit-requests-limit"], "6");
        assert_eq!(h["anthropic-ratelimit-tokens-limit"], "2000");
        assert!(h["anthropic-ratelimit-requests-reset"].to_str().unwrap().ends_with('Z'));
        remaining.push(h["anthropic-ratelimit-requests-remaining"].to_str().unwrap().parse::<u32>().unwrap());
        let tokens_left: u32 = h["anthropic-ratelimit-tokens-remaining"].to_str().unwrap().parse().unwrap();
        assert!(tokens_left < 2000);
    }
    assert!(remaining.windows(2).all(|w| w[1] < w[0]), "remaining decreases: {remaining:?}");
    let r = c.post(s.url("/v1/messages")).header("x-api-key", user).json(&ok_body()).send().await.unwrap();
    assert_eq!(status(&r), 429);
    let retry: u64 = r.headers()["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((1..=10).contains(&retry), "retry-after {retry}");
    assert_eq!(r.headers()["anthropic-ratelimit-requests-remaining"], "0");
    assert_eq!(r.json::<Value>().await.unwrap()["error"]["type"], "rate_limit_error");
    // After the advertised wait, requests succeed again.
    tokio::time::sleep(Duration::from_secs(retry)).await;
    let r = c.post(s.url("/v1/messages")).header("x-api-key", user).json(&ok_body()).send().await.unwrap();
    assert_eq!(status(&r), 200);
    // The reset header names when the bucket is full again: within the next minute.
    let reset = r.headers()["anthropic-ratelimit-requests-reset"].to_str().unwrap().to_string();
    let now = std::time::SystemTime::now();
    let in_a_minute = zerolayer_coordinator::clock::rfc3339_system(now + Duration::from_secs(61));
    let now = zerolayer_coordinator::clock::rfc3339_system(now - Duration::from_secs(1));
    assert!(reset.len() == 20 && reset > now && reset <= in_a_minute, "reset {reset} between {now} and {in_a_minute}");

    // The token limit (2,000 prompt tokens a minute) on the second key from the file: a
    // ~1,550-token prompt fits once, not twice. The bucket refills at 33 tokens a second, so
    // the second would fit only after about 33 s: far more than the first one's prefill takes,
    // even on a loaded 2-core machine (a ~1,200-token prompt, which needed 12 s, once passed).
    let big = json!({"model": MODEL, "max_tokens": 1, "temperature": 0, "messages": [{"role": "user", "content": LOREM.repeat(9)}]});
    let r = c.post(s.url("/v1/messages")).header("x-api-key", heavy_user).json(&big).send().await.unwrap();
    assert_eq!(status(&r), 200);
    let v: Value = r.json().await.unwrap();
    let prompt = v["usage"]["input_tokens"].as_u64().unwrap() + v["usage"]["cache_read_input_tokens"].as_u64().unwrap();
    assert!((1400..2000).contains(&prompt), "prompt tokens {prompt}");
    let r = c.post(s.url("/v1/messages")).header("x-api-key", heavy_user).json(&big).send().await.unwrap();
    assert_eq!(status(&r), 429);
    assert!(r.headers()["retry-after"].to_str().unwrap().parse::<u64>().unwrap() >= 1);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["type"], "rate_limit_error");
    assert!(e["error"]["message"].as_str().unwrap().contains("tokens per minute"), "{e}");

    // The OpenAI route answers auth failures in OpenAI's shape.
    let chat = json!({"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]});
    let r = c.post(s.url("/v1/chat/completions")).header("authorization", "Bearer sk-nobody").json(&chat).send().await.unwrap();
    assert_eq!(status(&r), 401);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["type"], "authentication_error", "{e}");
    assert!(e.get("type").is_none() && e["error"].get("code").is_some(), "OpenAI's shape: {e}");
    s.stop().await.unwrap();

    let logged = logs.text();
    assert!(logged.contains("zerolayer") || !logged.is_empty(), "logs were captured");
    assert!(!logged.contains(user) && !logged.contains(admin), "a key appeared in the logs");
}

