//! Claude Code, the agent, end to end against a node serving Qwen2.5-Coder-0.5B-Instruct (32k
//! context). `scripts/claude-code` installs it, pinned, from npm. `claude -p` runs in a
//! temporary directory holding one small file, with `ANTHROPIC_BASE_URL` set to the node:
//! every request it makes gets a 2xx, it prints no `API Error`, and the turn ends. A second
//! turn (`claude -p --continue`) reads at least 90% of its prompt from the prefix cache.

use std::path::Path;

use zerolayer_tests::*;

/// Runs `claude` with `args` in `dir` against `base`; returns (status ok, stdout, stderr, seconds).
async fn claude(bin: &str, dir: &Path, base: &str, args: &[&str]) -> (bool, String, String, f64) {
    let env = [
        ("ANTHROPIC_BASE_URL", base),
        ("ANTHROPIC_API_KEY", "sk-zerolayer-test"),
        ("ANTHROPIC_MODEL", "qwen"),
        ("ANTHROPIC_SMALL_FAST_MODEL", "qwen"),
        ("ANTHROPIC_DEFAULT_HAIKU_MODEL", "qwen"),
        ("ANTHROPIC_DEFAULT_SONNET_MODEL", "qwen"),
        ("ANTHROPIC_DEFAULT_OPUS_MODEL", "qwen"),
        ("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1"),
        ("DISABLE_TELEMETRY", "1"),
        ("DISABLE_AUTOUPDATER", "1"),
        ("DISABLE_ERROR_REPORTING", "1"),
        ("API_TIMEOUT_MS", "900000"),
        // Bounds each answer: this test is about the protocol and the cache, not the prose.
        // An answer that reaches the limit is an API error to Claude Code, so the node
        // samples as the model's authors recommend (below).
        ("CLAUDE_CODE_MAX_OUTPUT_TOKENS", "256"),
    ];
    let r = run_agent(bin, dir, args, &env).await;
    (r.ok, r.stdout, r.stderr, r.secs)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_code_runs_two_turns_against_qwen() {
    let _g = heavy();
    let bin = install_agent("claude-code");

    let s = TestServer::qwen_with(|c| {
        // Claude Code sends no sampling parameters. At the API's default (temperature 1, no
        // cut) the 0.5B model sometimes rambled past the output limit, and greedy it repeats
        // itself until the limit; Qwen2.5's own generation config (what vLLM applies) ends its
        // answers.
        c.model.default_temperature = Some(0.7);
        c.model.default_top_p = Some(0.8);
        c.model.default_top_k = Some(20);
        c.model.default_repetition_penalty = Some(1.05);
        c.nodes[0].workers[0].kv_cache_mb = 1536;
    })
    .await;
    let dir = temp_dir("claude-code");
    std::fs::create_dir_all(dir.join(".home")).unwrap();
    std::fs::write(dir.join("notes.txt"), "The launch code word is PELICAN.\n").unwrap();
    let c = reqwest::Client::new();

    let before = metrics_page(&c, s.url("/metrics")).await;
    let (ok, out, err, first_secs) = claude(&bin, &dir, &s.base, &["-p", "Say hello in one short sentence.", "--max-turns", "1"]).await;
    let after_first = metrics_page(&c, s.url("/metrics")).await;
    eprintln!("turn 1 ({first_secs:.1} s):\nstdout: {out}\nstderr: {err}");
    assert!(ok, "claude -p failed:\n{out}\n{err}");
    assert!(!out.contains("API Error") && !err.contains("API Error"), "{out}\n{err}");
    assert_none_refused("first turn", &before, &after_first);
    let prompt_1 = counter(&after_first, "zerolayer_input_tokens_total") - counter(&before, "zerolayer_input_tokens_total");
    assert!(prompt_1 > 5_000.0, "Claude Code's prompts are long ({prompt_1} tokens)");

    let (ok, out, err, second_secs) = claude(&bin, &dir, &s.base, &["-p", "--continue", "Now say goodbye in one short sentence.", "--max-turns", "1"]).await;
    let after_second = metrics_page(&c, s.url("/metrics")).await;
    eprintln!("turn 2 ({second_secs:.1} s):\nstdout: {out}\nstderr: {err}");
    assert!(ok, "claude -p --continue failed:\n{out}\n{err}");
    assert!(!out.contains("API Error") && !err.contains("API Error"), "{out}\n{err}");
    assert_none_refused("second turn", &after_first, &after_second);
    let prompt_2 = counter(&after_second, "zerolayer_input_tokens_total") - counter(&after_first, "zerolayer_input_tokens_total");
    let cached_2 = counter(&after_second, "zerolayer_cached_input_tokens_total") - counter(&after_first, "zerolayer_cached_input_tokens_total");
    let ttft = |a: &str, b: &str| {
        (counter(b, "zerolayer_time_to_first_token_seconds_sum") - counter(a, "zerolayer_time_to_first_token_seconds_sum"))
            / (counter(b, "zerolayer_time_to_first_token_seconds_count") - counter(a, "zerolayer_time_to_first_token_seconds_count")).max(1.0)
    };
    eprintln!(
        "turn 1: {prompt_1} prompt tokens, TTFT {:.1} s, {first_secs:.1} s in all; turn 2: {cached_2} of {prompt_2} prompt tokens from cache, TTFT {:.2} s, {second_secs:.1} s in all",
        ttft(&before, &after_first),
        ttft(&after_first, &after_second)
    );
    assert!(cached_2 >= 0.9 * prompt_2, "the second turn read {cached_2} of {prompt_2} prompt tokens from cache");
    s.stop().await.unwrap();
}
