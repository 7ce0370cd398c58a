//! Model fallback as a placement outcome: two nodes over real QUIC, each serving a different
//! model id, the first model's `fallback` the second. While the first model's only worker can
//! take requests they run on it; once its node drains, a request naming it is served by the
//! fallback, says so in `zerolayer-fallback-from` and in the body's `model`, and is counted. A
//! key that opted out gets the error it would have had.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use zerolayer_common::config::{KeyConfig, ModelSection};
use zerolayer_coordinator::view::NodeState;
use zerolayer_tests::*;

const PRIMARY: &str = "smollm2-135m-instruct";
const BACKUP: &str = "backup-135m";
const AGENT: &str = "sk-agent-0123456789";
const STRICT: &str = "sk-strict-0123456789";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_models_requests_go_to_its_fallback() {
    let _g = heavy();
    let cluster = TestCluster::start(2, |c| {
        // The same weights under another id: a second model, as the cluster sees it.
        c.models.push(ModelSection { path: model_path(), id: BACKUP.into(), ..Default::default() });
        c.model.fallback = Some(BACKUP.into());
        c.nodes[1].workers[0].model = Some(BACKUP.into());
        c.auth.keys = vec![
            KeyConfig { name: "agent".into(), key: AGENT.into(), ..Default::default() },
            KeyConfig { name: "strict".into(), key: STRICT.into(), allow_fallback: false, ..Default::default() },
        ];
    })
    .await;
    cluster.wait_converged(&[0, 1], Duration::from_secs(60)).await;
    let http = http_client(120);
    let b = &cluster.nodes[1];
    let post = |key: &'static str, body: Value, path: &'static str| http.post(b.url(path)).header("x-api-key", key).json(&body).send();

    // The primary can take it: it serves, and no fallback is named.
    let r = post(AGENT, messages_body("Name a color.", 8, false), "/v1/messages").await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["zerolayer-worker"], "a/cpu0");
    assert!(r.headers().get("zerolayer-fallback-from").is_none());
    assert_eq!(r.json::<Value>().await.unwrap()["model"], PRIMARY);

    cluster.nodes[0].frontend.drain().await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !b.frontend.cluster.nodes().iter().any(|n| n.id == "a" && n.state == NodeState::Draining) {
        assert!(Instant::now() < deadline, "b never saw a drain");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Now the fallback serves it: whole, streamed, and on the OpenAI route.
    let r = post(AGENT, messages_body("Name a color.", 8, false), "/v1/messages").await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!((r.headers()["zerolayer-worker"].to_str().unwrap(), r.headers()["zerolayer-fallback-from"].to_str().unwrap()), ("b/cpu0", PRIMARY));
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["model"], BACKUP, "{v}");
    assert!(!v["content"][0]["text"].as_str().unwrap().is_empty());
    let r = post(AGENT, messages_body("Name a color.", 8, true), "/v1/messages").await.unwrap();
    assert_eq!(r.headers()["zerolayer-fallback-from"], PRIMARY);
    let events = parse_sse(&r.text().await.unwrap());
    assert_eq!(events[0].1["message"]["model"], BACKUP);
    assert_eq!(events.last().unwrap().0, "message_stop");
    let chat = json!({"model": PRIMARY, "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": "Name a color."}]});
    let r = post(AGENT, chat.clone(), "/v1/chat/completions").await.unwrap();
    assert_eq!(r.headers()["zerolayer-fallback-from"], PRIMARY);
    assert_eq!(r.json::<Value>().await.unwrap()["model"], BACKUP);

    // A key that opted out gets the error it would have had without a fallback.
    let r = post(STRICT, messages_body("Name a color.", 8, false), "/v1/messages").await.unwrap();
    assert_eq!(r.status(), 529);
    assert!(r.headers().get("zerolayer-fallback-from").is_none());
    assert_eq!(r.json::<Value>().await.unwrap()["error"]["type"], "overloaded_error");

    // Counted by the pair of models.
    let page = http.get(b.url("/metrics")).send().await.unwrap().text().await.unwrap();
    assert_eq!(metric_with(&page, "zerolayer_fallbacks_total", &[("node", "b"), ("from", PRIMARY), ("to", BACKUP)]), Some(3.0), "{page}");

    // Undrained, the primary serves again.
    cluster.nodes[0].frontend.undrain().await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = post(AGENT, messages_body("Name a color.", 8, false), "/v1/messages").await.unwrap();
        if r.headers().get("zerolayer-fallback-from").is_none() {
            assert_eq!(r.headers()["zerolayer-worker"], "a/cpu0");
            break;
        }
        assert!(Instant::now() < deadline, "the primary never served again");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
