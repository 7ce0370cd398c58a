//! The official `anthropic` and `openai` Python SDKs against a live node on the real model.
//! `scripts/client-venv` installs them (once) into `.venv-clients`.

use std::process::Command;
use std::time::Duration;

use zerolayer_tests::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_sdks_work_unmodified() {
    let _g = heavy();
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let venv = Command::new(root.join("scripts/client-venv")).output().expect("run scripts/client-venv");
    assert!(venv.status.success(), "client venv: {}", String::from_utf8_lossy(&venv.stderr));
    let venv = String::from_utf8(venv.stdout).unwrap().trim().to_string();
    let s = TestServer::start(|_| {}).await;
    let base = s.base.clone();
    let script = root.join("tests/clients/sdk_test.py");
    let out = tokio::time::timeout(
        Duration::from_secs(600),
        tokio::process::Command::new(format!("{venv}/bin/python")).arg(&script).env("ZEROLAYER_BASE_URL", &base).output(),
    )
    .await
    .expect("SDK tests finish within 10 minutes")
    .expect("run python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "SDK tests failed:\n{stdout}");
    // Every test the script defines ran and passed: "0 passed, 0 failed" is a failure.
    let source = std::fs::read_to_string(&script).unwrap();
    let defined: Vec<&str> = source.lines().filter_map(|l| l.strip_prefix("def test_")).map(|l| l.split('(').next().unwrap()).collect();
    assert!(defined.len() >= 10, "the SDK script defines its tests ({})", defined.len());
    assert!(stdout.contains(&format!("\n{} passed, 0 failed", defined.len())), "expected {} passed:\n{stdout}", defined.len());
    for t in defined {
        assert!(stdout.contains(&format!("ok   test_{t}\n")), "test_{t} did not pass:\n{stdout}");
    }
    s.stop().await.unwrap();
}
