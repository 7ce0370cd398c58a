//! The Anthropic request parser's tests: turns, breakpoints, errors, Claude Code's shapes.

use super::*;
use serde_json::json;
use crate::frontend::request::{CacheTtl, Role, Turn};

#[test]
fn combines_turns_and_keeps_prefill() {
    let r = parse(
        &json!({"model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "sys"}], "messages": [
            {"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "text", "text": "b"}]},
            {"role": "assistant", "content": "The answer is"}]}),
        Endpoint::Messages,
    )
    .unwrap();
    let g = r.generation;
    assert_eq!(g.system.as_deref(), Some("sys"));
    assert_eq!(g.turns, vec![Turn::new(Role::User, "a\n\nb"), Turn::new(Role::Assistant, "The answer is")]);
    assert_eq!(g.params.temperature, 1.0);
}

#[test]
fn breakpoints_land_at_the_end_of_their_blocks() {
    let cc = json!({"type": "ephemeral"});
    let hour = json!({"type": "ephemeral", "ttl": "1h"});
    let r = parse(
        &json!({"model": "m", "max_tokens": 5, "cache_control": cc,
            "system": [{"type": "text", "text": "one"}, {"type": "text", "text": "two", "cache_control": hour}, {"type": "text", "text": "three"}],
            "messages": [
                {"role": "user", "content": "a"},
                {"role": "user", "content": [{"type": "text", "text": "bb", "cache_control": cc}, {"type": "text", "text": "c"}]},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "42", "cache_control": cc}, {"type": "text", "text": "ok"}]}]}),
        Endpoint::Messages,
    )
    .unwrap();
    let g = r.generation;
    let five = CacheTtl::FiveMinutes;
    // "one\n\ntwo": the end of "two"; "a\n\nbb": the end of "bb" in the combined turn; the
    // tool result's turn; the top-level breakpoint at the end of the last message.
    assert_eq!(g.system.as_deref().map(|s| &s[..8]), Some("one\n\ntwo"));
    assert_eq!(
        g.breakpoints,
        vec![
            Breakpoint { turn: None, end: 8, ttl: CacheTtl::OneHour },
            Breakpoint { turn: Some(0), end: 5, ttl: five },
            Breakpoint { turn: Some(2), end: 2, ttl: five },
            Breakpoint { turn: Some(3), end: 2, ttl: five },
        ]
    );
    assert_eq!(&g.turns[0].text[..5], "a\n\nbb");
    assert_eq!(g.turns[2].text, "42");
    assert_eq!(g.turns[3].text, "ok");
}

#[test]
fn errors_name_the_field() {
    let cases = [
        (json!({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}), "model"),
        (json!({"model": "m", "messages": [{"role": "user", "content": "x"}]}), "max_tokens"),
        (json!({"model": "m", "max_tokens": -1, "messages": [{"role": "user", "content": "x"}]}), "max_tokens"),
        (json!({"model": "m", "max_tokens": 1, "messages": []}), "messages"),
        (json!({"model": "m", "max_tokens": 1, "messages": [{"role": "tool", "content": "x"}]}), "messages[0].role"),
        (json!({"model": "m", "max_tokens": 1, "temperature": 1.5, "messages": [{"role": "user", "content": "x"}]}), "temperature"),
        (json!({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}), "image"),
        (json!({"model": "m", "max_tokens": 1, "bogus": 1, "messages": [{"role": "user", "content": "x"}]}), "bogus"),
    ];
    for (body, needle) in cases {
        let e = parse(&body, Endpoint::Messages).unwrap_err();
        assert_eq!(e.status(), 400);
        assert!(e.to_string().contains(needle), "{e} lacks {needle}");
    }
    assert!(parse(&json!({"model": "m", "messages": [{"role": "user", "content": "x"}]}), Endpoint::CountTokens).is_ok());
}

/// What Claude Code sends on its first request is accepted, with the official meaning.
#[test]
fn claude_code_shapes_are_accepted() {
    let body = json!({"model": "m", "max_tokens": 32000, "stream": true,
        "system": [{"type": "text", "text": "a"}, {"type": "text", "text": "b", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "<system-reminder>x</system-reminder>", "cache_control": {"type": "ephemeral"}}]},
            {"role": "system", "content": "mid"},
            {"role": "user", "content": "go"}],
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "metadata": {"user_id": "{\"device_id\":\"abc\",\"session_id\":\"s\"}"}});
    let r = parse(&body, Endpoint::Messages).unwrap();
    assert!(r.context_management);
    assert_eq!(r.generation.max_tokens, Some(32000));
    let roles: Vec<Role> = r.generation.turns.iter().map(|t| t.role).collect();
    assert_eq!(roles, vec![Role::User, Role::System, Role::User]);
    // Enabled thinking and unknown edits are errors.
    let mut b = body.clone();
    b["thinking"] = json!({"type": "enabled", "budget_tokens": 1024});
    assert!(parse(&b, Endpoint::Messages).unwrap_err().to_string().contains("cannot think"));
    let mut b = body.clone();
    b["context_management"] = json!({"edits": [{"type": "summarize"}]});
    assert!(parse(&b, Endpoint::Messages).unwrap_err().to_string().contains("context_management.edits[0].type"));
}

#[test]
fn a_tool_result_must_answer_a_tool_use_of_the_previous_message() {
    let use_t1 = json!({"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]});
    let result = |id: &str| json!({"role": "user", "content": [{"type": "text", "text": "here"}, {"type": "tool_result", "tool_use_id": id, "content": "42"}]});
    let body = |msgs: Vec<serde_json::Value>| json!({"model": "m", "max_tokens": 5, "messages": msgs});
    let first = json!({"role": "user", "content": "go"});
    assert!(parse(&body(vec![first.clone(), use_t1.clone(), result("t1")]), Endpoint::Messages).is_ok());
    let e = parse(&body(vec![first.clone(), use_t1.clone(), result("t2")]), Endpoint::Messages).unwrap_err();
    assert_eq!(e.status(), 400);
    assert_eq!(
        e.to_string(),
        "messages.2.content.1: unexpected `tool_use_id` found in `tool_result` blocks: t2. Each `tool_result` block must have a corresponding `tool_use` block in the previous message."
    );
    // A call two messages back does not count: the result must follow its call.
    let later = vec![first.clone(), use_t1, result("t1"), json!({"role": "assistant", "content": "ok"}), result("t1")];
    assert!(parse(&body(later), Endpoint::Messages).is_err());
    assert!(parse(&body(vec![result("t1")]), Endpoint::Messages).is_err(), "no call before it at all");
}

#[test]
fn the_billing_header_is_not_part_of_the_prompt() {
    let sys = |header: &str| {
        json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "system": [
            {"type": "text", "text": header},
            {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}]})
    };
    let a = parse(&sys("x-anthropic-billing-header: cc_version=2.1.37.a1b; cc_entrypoint=cli; cch=11111;"), Endpoint::Messages).unwrap();
    let b = parse(&sys("x-anthropic-billing-header: cc_version=2.1.37.a1b; cc_entrypoint=cli; cch=22222;"), Endpoint::Messages).unwrap();
    assert_eq!(a.generation.system.as_deref(), Some("You are Claude Code."));
    assert_eq!(a.generation, b.generation, "requests that differ only in the header are the same prompt");
    assert_eq!(a.generation.breakpoints[0].end, "You are Claude Code.".len());
    let kept = parse(&sys("Some other first block."), Endpoint::Messages).unwrap();
    assert_eq!(kept.generation.system.as_deref(), Some("Some other first block.\n\nYou are Claude Code."));
}
