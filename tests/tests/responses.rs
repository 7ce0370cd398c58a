//! The Responses API with the official `openai` SDKs (Python: tests/clients/responses_test.py;
//! TypeScript: responses_test.mjs)
//! against a two-node cluster on Qwen2.5-Coder-0.5B-Instruct (real QUIC, mutual TLS): create
//! and stream (events in order, deltas that add up), forced and streamed function calls whose
//! arguments validate, a `function_call_output` round trip, `previous_response_id` made on one
//! node and continued on the other, retrieve and delete across nodes, and tenants that cannot
//! see each other's responses.

use std::time::Duration;

use serde_json::json;
use zerolayer_common::config::KeyConfig;
use zerolayer_tests::*;

const ALICE: &str = "sk-alice-0123456789";
const BOB: &str = "sk-bob-0123456789";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_sdk_speaks_responses_across_the_cluster() {
    let _g = heavy();
    let venv = client_setup("scripts/client-venv");
    let cluster = TestCluster::start(2, |c| {
        c.model.path = qwen_model_path();
        c.model.id = "qwen".into();
        c.model.aliases = vec![];
        c.auth.keys = [("alice", ALICE), ("bob", BOB)].map(|(name, key)| KeyConfig { name: name.into(), key: key.into(), ..Default::default() }).to_vec();
        for n in &mut c.nodes {
            n.workers[0].kv_cache_mb = 256;
        }
    })
    .await;
    cluster.wait_converged(&[0, 1], Duration::from_secs(30)).await;
    let (a, b) = (cluster.nodes[0].base.clone(), cluster.nodes[1].base.clone());
    let env = [("ZEROLAYER_BASE_URL", a.as_str()), ("ZEROLAYER_OTHER_URL", b.as_str()), ("ALICE_KEY", ALICE), ("BOB_KEY", BOB)];
    let script = repo_root().join("tests/clients/responses_test.py");
    run_client_script(&format!("{venv}/bin/python"), &script, "def test_", &env, 8, Duration::from_secs(900)).await;
    // The TypeScript SDK: create and stream agree, a forced call continued on the other node.
    let node_dir = client_setup("scripts/client-node");
    let env = [env.as_slice(), &[("ZEROLAYER_CLIENTS_NODE", node_dir.as_str())]].concat();
    let script = repo_root().join("tests/clients/responses_test.mjs");
    run_client_script("node", &script, "  async ", &env, 2, Duration::from_secs(600)).await;

    // Without a key: the API's own 401, in OpenAI's shape.
    let http = http_client(60);
    let r = http.post(format!("{a}/v1/responses")).json(&json!({"model": "qwen", "input": "Hi"})).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let body: serde_json::Value = r.json().await.unwrap();
    assert!(body["error"]["message"].is_string(), "{body}");
    // Each node keeps only the responses it made, within its bounds.
    let (kept_a, bytes_a) = cluster.nodes[0].frontend.responses.usage();
    assert!(kept_a >= 2 && bytes_a > 0, "node a stored its responses ({kept_a}, {bytes_a} bytes)");
    assert!(cluster.nodes[1].frontend.responses.usage().0 >= 1, "node b stored the continued response");
}
