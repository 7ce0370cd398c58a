//! OpenAI's Codex CLI, the agent, end to end against a node serving Qwen2.5-Coder-0.5B-Instruct
//! over the Responses API. `scripts/codex` installs it, pinned, from npm. Codex runs with a
//! custom provider (`wire_api = "responses"`) in a temporary directory holding one small file:
//! - `codex exec` asks for the file's contents: Codex's shell tool runs `cat notes.txt`, the
//!   node gets its output back in the next request, and Codex exits 0 with no error;
//! - `codex exec resume --last` continues the session, exits 0, and reads at least 90% of its
//!   prompt from the prefix cache: nothing Codex sends per request changes the prompt's head.
//!
//! What the 0.5B model needs, and why (an operator with a bigger model needs none of it):
//! - Codex sends no temperature. Sampled, the model calls made-up commands at random, so the
//!   node's `default_temperature = 0` makes the run greedy, and so repeatable.
//! - Codex's own instructions (17,690 characters) and its tool list lose the model: it copies
//!   `sandbox_permissions: "require_escalated"` from the schema (which `codex exec`, never
//!   asking, rejects), or lists every tool as JSON until the length limit. The test gives
//!   Codex short instructions (its `model_instructions_file`) and turns off the goal, image,
//!   agent, app and plugin tools and web search (its `features`); the shell tool is
//!   `exec_command`, as by default.

use std::path::Path;

use zerolayer_tests::*;

/// Codex's instructions for the small model: the shell tool's call, and a plain answer after.
const INSTRUCTIONS: &str = r#"You are a coding agent in the Codex CLI. You run shell commands by calling the exec_command function with only its "cmd" argument:
<tool_call>
{"name": "exec_command", "arguments": {"cmd": "ls"}}
</tool_call>
When a command's output comes back, answer the user in one short sentence of plain text, with no tool call.
"#;

/// What the file says, which only the shell tool can tell.
const SECRET: &str = "PELICAN-42";

/// The options both turns give `codex exec` (before its prompt or `resume`).
fn options(home: &Path) -> Vec<String> {
    let mut args: Vec<String> = ["exec", "--skip-git-repo-check", "-s", "danger-full-access"].map(String::from).to_vec();
    let instructions = home.join("instructions.md");
    let settings = [
        format!("model_instructions_file={:?}", instructions.display().to_string()),
        "web_search=\"disabled\"".to_string(),
        "features.goals=false".into(),
        "features.view_image=false".into(),
        "features.multi_agent=false".into(),
        "features.apps=false".into(),
        "features.plugins=false".into(),
    ];
    for s in settings {
        args.push("-c".into());
        args.push(s);
    }
    args
}

/// Runs `codex` with `args` in `dir` (its home in `dir/.codex`); returns (status ok, stdout,
/// stderr, seconds).
async fn codex(bin: &str, dir: &Path, args: &[String]) -> (bool, String, String, f64) {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let home = dir.join(".codex").display().to_string();
    let r = run_agent(bin, dir, &args, &[("CODEX_HOME", &home), ("ZEROLAYER_API_KEY", "sk-zerolayer-test")]).await;
    (r.ok, r.stdout, r.stderr, r.secs)
}

/// Codex's home: a provider for the node at `base`, and the instructions.
fn codex_home(dir: &Path, base: &str) {
    let home = dir.join(".codex");
    std::fs::create_dir_all(&home).unwrap();
    std::fs::create_dir_all(dir.join(".home")).unwrap();
    let config = format!(
        "model = \"qwen\"\nmodel_provider = \"zerolayer\"\n\n[model_providers.zerolayer]\nname = \"zerolayer\"\nbase_url = \"{base}/v1\"\nenv_key = \"ZEROLAYER_API_KEY\"\nwire_api = \"responses\"\n"
    );
    std::fs::write(home.join("config.toml"), config).unwrap();
    std::fs::write(home.join("instructions.md"), INSTRUCTIONS).unwrap();
}

/// Responses requests answered 200.
fn responses_ok(page: &str) -> f64 {
    answered(page, "endpoint=\"responses\"", "200")
}

/// A turn's outcome: exit 0, no error printed, and no 4xx or 5xx from the node.
fn assert_clean(turn: &str, ok: bool, out: &str, err: &str, before: &str, after: &str) {
    assert!(ok, "{turn} failed:\n{out}\n{err}");
    assert!(!out.contains("ERROR") && !err.contains("ERROR"), "{turn} printed an error:\n{out}\n{err}");
    assert_none_refused(turn, before, after);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_runs_a_shell_tool_and_resumes_against_qwen() {
    let _g = heavy();
    let bin = install_agent("codex");

    let s = TestServer::qwen_with(|c| {
        c.model.default_temperature = Some(0.0);
        c.nodes[0].workers[0].kv_cache_mb = 1024;
    })
    .await;
    let dir = temp_dir("codex");
    codex_home(&dir, &s.base);
    std::fs::write(dir.join("notes.txt"), format!("The launch code is {SECRET}.\n")).unwrap();
    let c = reqwest::Client::new();
    let home = dir.join(".codex");

    let before = metrics_page(&c, s.url("/metrics")).await;
    let mut args = options(&home);
    args.push("Run the shell command: cat notes.txt".into());
    let (ok, out, err, first_secs) = codex(&bin, &dir, &args).await;
    let after_first = metrics_page(&c, s.url("/metrics")).await;
    eprintln!("turn 1 ({first_secs:.1} s):\nstdout: {out}\nstderr: {err}");
    assert_clean("first turn", ok, &out, &err, &before, &after_first);
    // The shell tool ran the command, and its output went back to the model: a second request.
    let both = format!("{out}\n{err}");
    assert!(both.contains("cat notes.txt") && both.contains("succeeded"), "Codex ran no `cat notes.txt`:\n{both}");
    assert!(both.contains(SECRET), "the file's contents came back from the shell tool:\n{both}");
    let requests_1 = responses_ok(&after_first) - responses_ok(&before);
    assert!(requests_1 >= 2.0, "the tool's output went back to the node ({requests_1} requests)");
    let prompt_1 = counter(&after_first, "zerolayer_input_tokens_total") - counter(&before, "zerolayer_input_tokens_total");

    let mut args = options(&home);
    args.extend(["resume".into(), "--last".into(), "What is the launch code?".into()]);
    let (ok, out, err, second_secs) = codex(&bin, &dir, &args).await;
    let after_second = metrics_page(&c, s.url("/metrics")).await;
    eprintln!("turn 2 ({second_secs:.1} s):\nstdout: {out}\nstderr: {err}");
    assert_clean("second turn", ok, &out, &err, &after_first, &after_second);
    let requests_2 = responses_ok(&after_second) - responses_ok(&after_first);
    assert!(requests_2 >= 1.0, "the resumed session asked the node ({requests_2} requests)");
    let prompt_2 = counter(&after_second, "zerolayer_input_tokens_total") - counter(&after_first, "zerolayer_input_tokens_total");
    let cached_2 = counter(&after_second, "zerolayer_cached_input_tokens_total") - counter(&after_first, "zerolayer_cached_input_tokens_total");
    eprintln!(
        "turn 1: {requests_1} requests, {prompt_1} prompt tokens, {first_secs:.1} s; turn 2: {requests_2} requests, {cached_2} of {prompt_2} prompt tokens from cache, {second_secs:.1} s"
    );
    assert!(cached_2 >= 0.9 * prompt_2, "the second turn read {cached_2} of {prompt_2} prompt tokens from cache");
    s.stop().await.unwrap();
}
