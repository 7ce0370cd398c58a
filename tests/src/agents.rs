//! What the agent tests (`claude_code.rs`, `codex.rs`) share: installing a pinned agent, the
//! node's counters around a turn, and the check that no request of a turn was refused.

use std::path::Path;
use std::process::Command;

use crate::metric;

/// Runs an install script of `scripts/` (`claude-code`, `codex`) and returns the path of the
/// agent's binary it prints.
pub fn install_agent(script: &str) -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = Command::new(root.join("scripts").join(script)).output().unwrap_or_else(|e| panic!("run scripts/{script}: {e}"));
    assert!(out.status.success(), "scripts/{script}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// The node's `/metrics` page.
pub async fn metrics_page(http: &reqwest::Client, url: String) -> String {
    http.get(url).send().await.unwrap().text().await.unwrap()
}

/// A counter's value on a page (0 when absent).
pub fn counter(page: &str, name: &str) -> f64 {
    metric(page, name).unwrap_or(0.0)
}

/// Requests answered with `status` on the endpoints whose series contain `filter` (`""`: all).
pub fn answered(page: &str, filter: &str, status: &str) -> f64 {
    page.lines()
        .filter(|l| l.starts_with("zerolayer_requests_total{") && l.contains(filter) && l.contains(&format!("status=\"{status}\"")))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

/// No request between the pages `before` and `after` got a 4xx or 5xx.
pub fn assert_none_refused(turn: &str, before: &str, after: &str) {
    for status in ["400", "401", "403", "404", "413", "429", "500", "529"] {
        assert_eq!(answered(after, "", status) - answered(before, "", status), 0.0, "a {status} answered the {turn}");
    }
}

/// How an agent's run ended: exit status 0, its output, and how long it took.
pub struct AgentRun {
    pub ok: bool,
    pub stdout: String,
    pub stderr: String,
    pub secs: f64,
}

/// Runs agent `bin` with `args` in `dir`, with only `PATH`, `HOME` (`dir/.home`) and `env` in
/// its environment and no input; at most 15 minutes.
pub async fn run_agent(bin: &str, dir: &Path, args: &[&str], env: &[(&str, &str)]) -> AgentRun {
    let t0 = std::time::Instant::now();
    let out = tokio::time::timeout(
        std::time::Duration::from_secs(900),
        tokio::process::Command::new(bin)
            .args(args)
            .current_dir(dir)
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("HOME", dir.join(".home"))
            .envs(env.iter().copied())
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true)
            .output(),
    )
    .await
    .unwrap_or_else(|_| panic!("{bin} finishes within 15 minutes"))
    .unwrap_or_else(|e| panic!("run {bin}: {e}"));
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    AgentRun { ok: out.status.success(), stdout: text(&out.stdout), stderr: text(&out.stderr), secs: t0.elapsed().as_secs_f64() }
}
