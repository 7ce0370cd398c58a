//! The multi-process cluster as the README runs it: `scripts/local-cluster 3` starts three
//! `zerolayer up` processes joined over QUIC with mutual TLS; `zerolayer status` shows three
//! ready nodes with their workers; a request to one node is served; SIGTERM stops them all.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_cluster_script_and_status() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..").canonicalize().unwrap();
    let dir = std::env::temp_dir().join(format!("zerolayer-lc-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut child = Command::new(root.join("scripts/local-cluster"))
        .arg("3")
        .env("ZEROLAYER_BIN", env!("CARGO_BIN_EXE_zerolayer"))
        .env("ZEROLAYER_CLUSTER_DIR", &dir)
        .env("KV_MB", "64")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("run scripts/local-cluster");
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let deadline = Instant::now() + Duration::from_secs(180);
    let mut https = vec![];
    loop {
        let line = rx.recv_timeout(deadline.saturating_duration_since(Instant::now())).expect("local-cluster prints its nodes");
        if let Some(url) = line.split_whitespace().find(|w| w.starts_with("http://")) {
            if line.starts_with('n') {
                https.push(url.to_string());
            }
        }
        if line.starts_with("cluster up: 3 nodes") {
            break;
        }
    }
    assert_eq!(https.len(), 3, "{https:?}");

    // `zerolayer status` against any node: three ready nodes, one worker row each.
    let status_deadline = Instant::now() + Duration::from_secs(20);
    let v: serde_json::Value = loop {
        let out = Command::new(env!("CARGO_BIN_EXE_zerolayer")).args(["status", "--json", "--addr", &https[1]]).output().unwrap();
        assert!(out.status.success(), "status failed: {}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let ready = v["nodes"].as_array().unwrap().iter().filter(|n| n["state"] == "ready").count();
        if ready == 3 && v["workers"].as_array().unwrap().len() == 3 {
            break v;
        }
        assert!(Instant::now() < status_deadline, "3 ready nodes expected: {v}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(v["node"], "n2");
    // n1's view converges on its own schedule: poll it too (bounded).
    let table_deadline = Instant::now() + Duration::from_secs(20);
    let table = loop {
        let out = Command::new(env!("CARGO_BIN_EXE_zerolayer")).args(["status", "--addr", &https[0]]).output().unwrap();
        let table = String::from_utf8(out.stdout).unwrap();
        if table.contains("3 nodes, 3 ready") {
            break table;
        }
        assert!(Instant::now() < table_deadline, "n1 must see 3 ready nodes: {table}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    println!("{table}");
    for n in ["n1", "n2", "n3"] {
        assert!(table.lines().any(|l| l.contains(&format!(" {n} ")) && l.contains("ready") && l.contains("cpu0")), "{n} row: {table}");
    }

    // A request to n3 is served (wherever placement puts it).
    let body = serde_json::json!({"model": "smollm2-135m-instruct", "max_tokens": 8, "temperature": 0,
                                  "messages": [{"role": "user", "content": "Say hello."}]});
    let r = reqwest::Client::new().post(format!("{}/v1/messages", https[2])).json(&body).timeout(Duration::from_secs(60)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.headers().get("zerolayer-worker").is_some());

    // SIGTERM to the script stops every node, and it exits 0.
    Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let code = loop {
        if let Some(code) = child.try_wait().unwrap() {
            break code;
        }
        assert!(Instant::now() < deadline, "local-cluster must stop within 60 s of SIGTERM");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(code.code(), Some(0), "every node exits 0");
    for u in &https {
        let gone = reqwest::Client::new().get(format!("{u}/health")).timeout(Duration::from_secs(2)).send().await;
        assert!(gone.is_err(), "{u} still answers after the stop");
    }
}
