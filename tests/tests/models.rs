//! Several models in one cluster: each worker loads one, `/v1/models` lists them all, placement
//! only puts a request on a worker that serves the model it names (each rendered through its
//! own model's template), and an unknown model is the API's 404.

use std::time::Duration;

use serde_json::{json, Value};
use zerolayer_common::config::ModelSection;
use zerolayer_tests::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_models_one_node_each_request_on_a_worker_of_its_model() {
    let _g = heavy();
    let s = TestServer::start(|c| {
        c.models.push(ModelSection {
            path: qwen_model_path(),
            id: "qwen".into(),
            aliases: vec!["Qwen2.5-Coder-0.5B-Instruct".into()],
            display_name: "Qwen2.5 Coder 0.5B Instruct (Q4_K_M)".into(),
            ..Default::default()
        });
        let mut second = c.nodes[0].workers[0].clone();
        second.id = "cpu1".into();
        second.model = Some("qwen".into());
        second.kv_cache_mb = 256;
        c.nodes[0].workers[0].threads = 1;
        second.threads = 1;
        c.nodes[0].workers.push(second);
    })
    .await;
    let c = reqwest::Client::builder().timeout(Duration::from_secs(120)).build().unwrap();

    let list: Value = c.get(s.url("/v1/models")).send().await.unwrap().json().await.unwrap();
    let ids: Vec<&str> = list["data"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["smollm2-135m-instruct", "qwen"], "{list}");
    assert_eq!((list["first_id"].as_str(), list["last_id"].as_str()), (Some("smollm2-135m-instruct"), Some("qwen")));
    for name in ["qwen", "Qwen2.5-Coder-0.5B-Instruct", "SmolLM2-135M-Instruct"] {
        assert_eq!(c.get(s.url(&format!("/v1/models/{name}"))).send().await.unwrap().status(), 200, "{name}");
    }

    // Each model's requests land on its own worker, every time, whatever the load balance says.
    for round in 0..3 {
        for (model, worker) in [("qwen", "n1/cpu1"), ("smollm2-135m-instruct", "n1/cpu0"), ("Qwen2.5-Coder-0.5B-Instruct", "n1/cpu1")] {
            let body = json!({"model": model, "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": format!("Say hi ({round}).")}]});
            let r = c.post(s.url("/v1/messages")).json(&body).send().await.unwrap();
            assert_eq!(r.status(), 200, "{model}");
            assert_eq!(r.headers()["zerolayer-worker"], worker, "{model}");
            let v: Value = r.json().await.unwrap();
            assert_eq!(v["model"], model, "{v}");
            let r = c.post(s.url("/v1/chat/completions")).json(&body).send().await.unwrap();
            assert_eq!(r.headers()["zerolayer-worker"], worker, "{model} (OpenAI)");
        }
    }

    // Each prompt goes through its own model's template: Qwen's renders tools, SmolLM2's does not.
    let tools = json!([{"name": "get_time", "description": "The time", "input_schema": {"type": "object", "properties": {}}}]);
    let ask = |model: &str| json!({"model": model, "max_tokens": 64, "temperature": 0, "tools": tools, "tool_choice": {"type": "any"},
                                   "messages": [{"role": "user", "content": "What time is it?"}]});
    let v: Value = c.post(s.url("/v1/messages")).json(&ask("qwen")).send().await.unwrap().json().await.unwrap();
    assert_eq!(v["stop_reason"], "tool_use", "{v}");
    assert_eq!(c.post(s.url("/v1/messages")).json(&ask("smollm2-135m-instruct")).send().await.unwrap().status(), 400);

    // A model the cluster does not serve is a 404 in each API's shape.
    let unknown = json!({"model": "gpt-4o", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]});
    let r = c.post(s.url("/v1/messages")).json(&unknown).send().await.unwrap();
    assert_eq!(r.status(), 404);
    assert_eq!(r.json::<Value>().await.unwrap()["error"]["type"], "not_found_error");
    assert_eq!(c.post(s.url("/v1/chat/completions")).json(&unknown).send().await.unwrap().status(), 404);
    assert_eq!(c.get(s.url("/v1/models/gpt-4o")).send().await.unwrap().status(), 404);
    s.stop().await.unwrap();
}
