//! The official `anthropic` and `openai` Python SDKs against a live node on the real model.
//! `scripts/client-venv` installs them (once) into `.venv-clients`.

use std::time::Duration;

use zerolayer_tests::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_sdks_work_unmodified() {
    let _g = heavy();
    let venv = client_setup("scripts/client-venv");
    let s = TestServer::start(|_| {}).await;
    let script = repo_root().join("tests/clients/sdk_test.py");
    run_client_script(&format!("{venv}/bin/python"), &script, "def test_", &[("ZEROLAYER_BASE_URL", s.base.as_str())], 10, Duration::from_secs(600)).await;
    s.stop().await.unwrap();
}
