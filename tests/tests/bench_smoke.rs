//! A smoke run of the HTTP benchmark harness at tiny sizes, so the harness keeps working (the
//! full sweep runs in `scripts/bench`, not in CI). It checks the shape, not the speed.

use zerolayer_tests::{heavy, TestServer};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_bench_smoke_run() {
    let _g = heavy();
    let server = TestServer::start(|_| {}).await;
    let dir = zerolayer_tests::temp_dir("bench");
    let (json, md) = (dir.join("http.json"), dir.join("http.md"));
    let base = server.base.clone();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_http_bench"))
            .args(["--url", &base, "--concurrency", "1,2", "--prompts", "short,long", "--output-tokens", "4", "--requests", "2", "--time-limit-s", "60"])
            .arg("--json")
            .arg(&json)
            .arg("--md")
            .arg(&md)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(out.status.success(), "http_bench failed: {}", String::from_utf8_lossy(&out.stderr));
    let results: Vec<serde_json::Value> = serde_json::from_str(&std::fs::read_to_string(dir.join("http.json")).unwrap()).unwrap();
    assert_eq!(results.len(), 4, "2 prompt kinds × 2 concurrency levels");
    for r in &results {
        assert_eq!(r["requests_ok"], 2, "{r}");
        assert_eq!(r["requests_failed"], 0, "{r}");
        assert_eq!(r["output_tokens"], 8, "ignore_eos makes every request generate exactly 4: {r}");
        assert!(r["ttft_ms_p50"].as_f64().unwrap() > 0.0 && r["itl_ms_p50"].as_f64().unwrap() > 0.0, "{r}");
    }
    // One stream: the steady window runs from its first token to its last (3 more tokens).
    for r in [&results[0], &results[2]] {
        assert!(r["steady_decode_tokens_per_s"].as_f64().is_some_and(|v| v > 0.0), "{r}");
    }
    let short = results[0]["prompt_tokens_mean"].as_f64().unwrap();
    let long = results[2]["prompt_tokens_mean"].as_f64().unwrap();
    assert!((80.0..160.0).contains(&short) && (1300.0..1800.0).contains(&long), "prompt sizes: {short} {long}");
    let md = std::fs::read_to_string(dir.join("http.md")).unwrap();
    assert!(md.starts_with("| prompt | concurrency |") && md.lines().count() == 6, "{md}");
    // Non-loopback targets are refused.
    let refused = std::process::Command::new(env!("CARGO_BIN_EXE_http_bench")).args(["--url", "http://10.0.0.1:80"]).output().unwrap();
    assert!(!refused.status.success());
    server.stop().await.unwrap();
}
