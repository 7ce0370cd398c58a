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
    let mut child = Command::new(env!("CARGO_BIN_EXE_zerolayer"))
        .args(["up", "--config"])
        .arg(&cfg)
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start zerolayer");
    // The one ready line carries the bound address.
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let deadline = Instant::now() + Duration::from_secs(120);
    let base = loop {
        let line = rx.recv_timeout(deadline.saturating_duration_since(Instant::now())).expect("zerolayer logs its ready line");
        if let Some(i) = line.find("zerolayer ready:") {
            let url = line[i..].split_whitespace().find(|w| w.starts_with("http://")).expect("address in the ready line");
            break url.to_string();
        }
    };
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
