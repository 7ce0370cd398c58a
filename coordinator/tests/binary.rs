//! The `zerolayer` binary as a user runs it: `zerolayer up` with a config file, the ready log
//! line, real requests, and SIGTERM during 8 active streams (they finish; exit code 0).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use futures::StreamExt;

fn model_path() -> std::path::PathBuf {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(p.exists(), "the real model is required at {}: run scripts/fetch-model", p.display());
    p.canonicalize().unwrap()
}

/// Starts `zerolayer` (already given its arguments) with its logs on stdout, and waits for its
/// one ready line, which carries the bound address. Returns the process, that line and the
/// node's base URL.
fn start(cmd: &mut Command) -> (std::process::Child, String, String) {
    let mut child = cmd
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start zerolayer");
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let line = rx.recv_timeout(deadline.saturating_duration_since(Instant::now())).expect("zerolayer logs its ready line");
        if let Some(i) = line.find("zerolayer ready:") {
            let url = line[i..].split_whitespace().find(|w| w.starts_with("http://")).expect("address in the ready line").to_string();
            return (child, line, url);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_serves_and_sigterm_drains_active_streams() {
    let dir = std::env::temp_dir().join(format!("zerolayer-bin-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("cluster.toml");
    std::fs::write(
        &cfg,
        format!(
            "[model]\npath = {:?}\nid = \"smollm2-135m-instruct\"\n[server]\nshutdown_grace_secs = 120\n\
             [[nodes]]\nid = \"n1\"\nhttp = \"127.0.0.1:0\"\n[[nodes.workers]]\nid = \"cpu0\"\nthreads = 2\nkv_cache_mb = 128\n",
            model_path().display().to_string()
        ),
    )
    .unwrap();
    let (mut child, _, base) = start(Command::new(env!("CARGO_BIN_EXE_zerolayer")).args(["up", "--config"]).arg(&cfg));
    let c = reqwest::Client::builder().timeout(Duration::from_secs(180)).build().unwrap();
    assert_eq!(c.get(format!("{base}/ready")).send().await.unwrap().status(), 200);

    // 8 active streams.
    let mut streams = vec![];
    let (started_tx, mut started_rx) = tokio::sync::mpsc::channel::<()>(8);
    for i in 0..8 {
        let c = c.clone();
        let url = format!("{base}/v1/messages");
        let started_tx = started_tx.clone();
        streams.push(tokio::spawn(async move {
            let body = serde_json::json!({"model": "smollm2-135m-instruct", "max_tokens": 48, "stream": true, "temperature": 0,
                "messages": [{"role": "user", "content": format!("Tell me a story about the number {i}.")}]});
            let resp = c.post(url).json(&body).send().await.unwrap();
            assert_eq!(resp.status(), 200);
            let mut s = resp.bytes_stream();
            let mut raw = String::new();
            let mut signalled = false;
            while let Some(chunk) = s.next().await {
                raw.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
                if !signalled && raw.contains("content_block_delta") {
                    signalled = true;
                    let _ = started_tx.send(()).await;
                }
            }
            raw
        }));
    }
    for _ in 0..8 {
        tokio::time::timeout(Duration::from_secs(120), started_rx.recv()).await.expect("all 8 streams active").unwrap();
    }
    let status = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    assert!(status.success());
    // While draining, readiness is 503 and new work is refused.
    let mut saw_503 = false;
    for _ in 0..50 {
        match c.get(format!("{base}/ready")).send().await {
            Ok(r) if r.status() == 503 => {
                saw_503 = true;
                break;
            }
            Ok(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            Err(_) => break,
        }
    }
    assert!(saw_503, "/ready turns 503 during the drain");
    for s in streams {
        let raw = tokio::time::timeout(Duration::from_secs(120), s).await.expect("stream finishes in the grace period").unwrap();
        assert!(raw.contains("event: message_stop"), "stream completed normally: {raw}");
        assert!(!raw.contains("event: error"), "no error event: {raw}");
    }
    let t0 = Instant::now();
    let code = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "process exits after draining");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(code.code(), Some(0), "exit code 0 after SIGTERM");
    let _ = std::fs::remove_dir_all(&dir);
}

/// How a user starts a node without writing a config: in a directory with no `cluster.toml`
/// the binary uses its embedded default; `--node` and `--http` override it, and so do
/// `ZEROLAYER_*` variables; the default's model alias is accepted. An unknown `--node` is
/// refused with a clear message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_default_flags_env_and_aliases() {
    let dir = std::env::temp_dir().join(format!("zerolayer-bin-default-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    assert!(!dir.join("cluster.toml").exists());
    let bad = Command::new(env!("CARGO_BIN_EXE_zerolayer")).args(["up", "--node", "n9"]).current_dir(&dir).output().unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("\"n9\" is not in the config"), "{}", String::from_utf8_lossy(&bad.stderr));
    let (mut child, ready, base) = start(
        Command::new(env!("CARGO_BIN_EXE_zerolayer"))
            .args(["up", "--node", "n1", "--http", "127.0.0.1:0"])
            .current_dir(&dir)
            .env("ZEROLAYER_MODEL__PATH", model_path())
            .env("ZEROLAYER_MODEL__ID", "zl-renamed")
            .env("ZEROLAYER_MODEL__DISPLAY_NAME", "Renamed by the environment"),
    );
    assert!(ready.contains("node n1 serving zl-renamed"), "{ready}");
    assert!(!base.ends_with(":8080"), "--http replaced the default address: {base}");
    let c = reqwest::Client::builder().timeout(Duration::from_secs(120)).build().unwrap();
    let models: serde_json::Value = c.get(format!("{base}/v1/models")).send().await.unwrap().json().await.unwrap();
    assert_eq!(models["data"][0]["id"], "zl-renamed", "the environment overrode the model id: {models}");
    assert_eq!(models["data"][0]["display_name"], "Renamed by the environment");
    let ask = |model: &str| {
        let body = serde_json::json!({"model": model, "max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]});
        c.post(format!("{base}/v1/messages")).json(&body).send()
    };
    assert_eq!(ask("SmolLM2-135M-Instruct").await.unwrap().status(), 200, "the default's alias");
    assert_eq!(ask("zl-renamed").await.unwrap().status(), 200);
    assert_eq!(ask("smollm2-135m-instruct").await.unwrap().status(), 404, "the old id was overridden");
    Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    let t0 = Instant::now();
    while child.try_wait().unwrap().is_none() {
        assert!(t0.elapsed() < Duration::from_secs(60), "exits after SIGTERM");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `zerolayer up --model FILE` serves FILE under its own name (the GGUF's `general.name` as an
/// id), or under `--served-model-name`; `--model` again serves a second file from the same node
/// (a worker each). The default model's id and alias then name nothing (404), and `/v1/models`
/// gives each model's `max_model_len`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_serves_each_model_file_under_its_own_name() {
    let dir = std::env::temp_dir().join(format!("zerolayer-bin-models-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let qwen = model_path().with_file_name("Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf");
    assert!(qwen.exists(), "run scripts/fetch-model qwen2.5-coder-0.5b");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_zerolayer"));
    cmd.args(["up", "--http", "127.0.0.1:0", "--model"]).arg(model_path()).args(["--served-model-name", "tiny", "--model"]).arg(&qwen);
    let (mut child, ready, base) = start(cmd.current_dir(&dir));
    assert!(ready.contains("serving tiny, qwen2.5-coder-0.5b-instruct-awq") && ready.contains("(2 workers)"), "{ready}");
    let c = reqwest::Client::builder().timeout(Duration::from_secs(120)).build().unwrap();
    let models: serde_json::Value = c.get(format!("{base}/v1/models")).send().await.unwrap().json().await.unwrap();
    let listed: Vec<(String, u64)> =
        models["data"].as_array().unwrap().iter().map(|m| (m["id"].as_str().unwrap().to_string(), m["max_model_len"].as_u64().unwrap())).collect();
    assert_eq!(listed, [("tiny".to_string(), 8192), ("qwen2.5-coder-0.5b-instruct-awq".to_string(), 32768)], "{models}");
    let ask = |model: &str| {
        let body = serde_json::json!({"model": model, "max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]});
        c.post(format!("{base}/v1/messages")).json(&body).send()
    };
    assert_eq!(ask("tiny").await.unwrap().status(), 200);
    let r = ask("qwen2.5-coder-0.5b-instruct-awq").await.unwrap();
    assert_eq!(r.status(), 200);
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["model"], "qwen2.5-coder-0.5b-instruct-awq");
    for old in ["smollm2-135m-instruct", "SmolLM2-135M-Instruct"] {
        let r = ask(old).await.unwrap();
        assert_eq!(r.status(), 404, "the default model's name {old} names nothing now");
        let v: serde_json::Value = r.json().await.unwrap();
        assert_eq!(v["error"]["type"], "not_found_error", "{v}");
    }
    Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    let t0 = Instant::now();
    while child.try_wait().unwrap().is_none() {
        assert!(t0.elapsed() < Duration::from_secs(60), "exits after SIGTERM");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // More names than files is refused before anything loads.
    let bad = Command::new(env!("CARGO_BIN_EXE_zerolayer"))
        .args(["up", "--served-model-name", "a", "--served-model-name", "b", "--model"])
        .arg(model_path())
        .current_dir(&dir)
        .output()
        .unwrap();
    assert!(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("2 --served-model-name for 1 --model"), "{}", String::from_utf8_lossy(&bad.stderr));
    let _ = std::fs::remove_dir_all(&dir);
}

/// The cluster.toml the Kubernetes manifests ship is a valid config of three nodes addressed by
/// their pods' DNS names.
#[test]
fn the_kubernetes_config_is_valid() {
    let manifest = std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/kubernetes/zerolayer.yaml")).unwrap();
    let start = manifest.find("cluster.toml: |\n").expect("the ConfigMap holds cluster.toml") + "cluster.toml: |\n".len();
    let toml: String = manifest[start..].lines().take_while(|l| l.starts_with("    ") || l.is_empty()).map(|l| format!("{}\n", l.strip_prefix("    ").unwrap_or(l))).collect();
    let cfg = zerolayer_common::ClusterConfig::from_toml(&toml).expect("parses");
    cfg.validate().expect("valid");
    let ids: Vec<&str> = cfg.nodes.iter().map(|n| n.id.as_str()).collect();
    assert_eq!(ids, ["zerolayer-0", "zerolayer-1", "zerolayer-2"]);
    assert!(cfg.nodes.iter().all(|n| n.quic.as_deref().is_some_and(|q| q.ends_with(".zerolayer-peers:7080"))));
}
