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
    let (child, line, url, _) = start_with_logs(cmd);
    (child, line, url)
}

/// [`start`], and the log lines that follow the ready line.
fn start_with_logs(cmd: &mut Command) -> (std::process::Child, String, String, std::sync::mpsc::Receiver<String>) {
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
            return (child, line, url, rx);
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

/// The flags of the field: `--host`/`--port`, `--model` with `--served-model-name`,
/// `--api-key` (required from then on, as `x-api-key` or a bearer token), `--threads`,
/// `--kv-cache-mb` and `--log-format json` (JSON lines; each request's carry its id and the
/// node). `zerolayer config` shows what the flags set; a typo in a config key stops startup,
/// naming the key and the nearest known one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_takes_the_flags_of_the_field() {
    let dir = std::env::temp_dir().join(format!("zerolayer-bin-flags-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    let flags = ["--host", "127.0.0.1", "--port", &port, "--served-model-name", "m", "--api-key", "secret-key-1", "--threads", "2", "--kv-cache-mb", "96"];
    let shown = Command::new(env!("CARGO_BIN_EXE_zerolayer")).arg("config").args(flags).arg("--model").arg(model_path()).current_dir(&dir).output().unwrap();
    let shown = String::from_utf8_lossy(&shown.stdout).to_string();
    for line in [
        format!("nodes[0].http = \"127.0.0.1:{port}\"    # --host"),
        "nodes[0].workers[0].kv_cache_mb = 96    # --kv-cache-mb".to_string(),
        "nodes[0].workers[0].threads = 2    # --threads".to_string(),
        "model.id = \"m\"    # --model".to_string(),
        "auth.api_keys = (set, hidden)    # --api-key".to_string(),
        "server.max_inflight = 256    # default".to_string(),
    ] {
        assert!(shown.lines().any(|l| l == line), "`zerolayer config` shows {line:?}:\n{shown}");
    }
    assert!(!shown.contains("secret-key-1"), "keys are never printed");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_zerolayer"));
    cmd.args(["--log-format", "json", "up"]).args(flags).arg("--model").arg(model_path()).current_dir(&dir);
    let (mut child, ready, base, logs) = start_with_logs(&mut cmd);
    assert_eq!(base, format!("http://127.0.0.1:{port}"), "{ready}");
    let ready: serde_json::Value = serde_json::from_str(&ready).expect("a JSON log line");
    assert!(ready["fields"]["message"].as_str().unwrap().contains("serving m on"), "{ready}");
    let c = reqwest::Client::builder().timeout(Duration::from_secs(120)).build().unwrap();
    let body = serde_json::json!({"model": "m", "max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]});
    let ask = |key: Option<&str>| {
        let r = c.post(format!("{base}/v1/messages")).json(&body);
        match key {
            Some(k) => r.bearer_auth(k),
            None => r,
        }
        .send()
    };
    assert_eq!(ask(None).await.unwrap().status(), 401, "--api-key makes a key required");
    assert_eq!(ask(Some("secret-key-2")).await.unwrap().status(), 401);
    let ok = ask(Some("secret-key-1")).await.unwrap();
    assert_eq!(ok.status(), 200);
    let rid = ok.headers()["request-id"].to_str().unwrap().to_string();
    let deadline = Instant::now() + Duration::from_secs(20);
    let access = loop {
        let line = logs.recv_timeout(deadline.saturating_duration_since(Instant::now())).expect("an access line for the request");
        let v: serde_json::Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("every log line is JSON ({e}): {line}"));
        if v["span"]["request_id"] == rid.as_str() && v["fields"]["message"] == "served" {
            break v;
        }
    };
    assert_eq!((access["span"]["node"].as_str(), access["fields"]["status"].as_u64()), (Some("n1"), Some(200)), "{access}");
    Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    let t0 = Instant::now();
    while child.try_wait().unwrap().is_none() {
        assert!(t0.elapsed() < Duration::from_secs(60), "exits after SIGTERM");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let short = Command::new(env!("CARGO_BIN_EXE_zerolayer")).current_dir(&dir).args(["up", "--api-key", "short"]).output().unwrap();
    assert!(!short.status.success() && String::from_utf8_lossy(&short.stderr).contains("at least 8 characters"));
    // A typo in a config key stops startup, naming the key and its likely meaning.
    let cfg = dir.join("cluster.toml");
    std::fs::write(&cfg, "[[nodes]]\nid = \"n1\"\n[[nodes.workers]]\nid = \"cpu0\"\nkv_cach_mb = 64\n").unwrap();
    let bad = Command::new(env!("CARGO_BIN_EXE_zerolayer")).args(["up", "--config"]).arg(&cfg).output().unwrap();
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(!bad.status.success() && err.contains("nodes[0].workers[0].kv_cach_mb") && err.contains("did you mean `kv_cache_mb`"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The cluster.toml each Kubernetes manifest ships is a valid config of nodes addressed by
/// their pods' DNS names; the GPU variant's workers are `cuda:0`.
#[test]
fn the_kubernetes_configs_are_valid() {
    let read = |file: &str| {
        let manifest = std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/kubernetes").join(file)).unwrap();
        let start = manifest.find("cluster.toml: |\n").expect("the ConfigMap holds cluster.toml") + "cluster.toml: |\n".len();
        let toml: String = manifest[start..].lines().take_while(|l| l.starts_with("    ") || l.is_empty()).map(|l| format!("{}\n", l.strip_prefix("    ").unwrap_or(l))).collect();
        zerolayer_common::ClusterConfig::from_toml(&toml).unwrap_or_else(|e| panic!("{file}: {e}"))
    };
    let cpu = read("zerolayer.yaml");
    let ids: Vec<&str> = cpu.nodes.iter().map(|n| n.id.as_str()).collect();
    assert_eq!(ids, ["zerolayer-0", "zerolayer-1", "zerolayer-2"]);
    assert!(cpu.nodes.iter().all(|n| n.quic.as_deref().is_some_and(|q| q.ends_with(".zerolayer-peers:7080"))));
    assert!(cpu.nodes.iter().flat_map(|n| &n.workers).all(|w| w.threads == 4 && w.gpu() == Ok(None)));
    let gpu = read("zerolayer-gpu.yaml");
    assert_eq!(gpu.nodes.len(), 2);
    assert!(gpu.nodes.iter().flat_map(|n| &n.workers).all(|w| w.gpu() == Ok(Some(0))), "one cuda:0 worker per pod");
}
