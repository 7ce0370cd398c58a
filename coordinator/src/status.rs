//! `zerolayer status`: renders `/admin/cluster` as a table, one row per worker.

use comfy_table::presets::UTF8_FULL_CONDENSED;
use comfy_table::{Cell, Table};
use serde_json::Value;

fn f(v: &Value, k: &str) -> f64 {
    v.get(k).and_then(Value::as_f64).unwrap_or(0.0)
}

fn s<'a>(v: &'a Value, k: &str) -> &'a str {
    v.get(k).and_then(Value::as_str).unwrap_or("-")
}

/// A worker's speculative acceptance rate: draft tokens kept of those verified ("-" before
/// its first draft).
fn acceptance(w: &Value) -> String {
    match f(w, "draft_tokens_total") {
        d if d > 0.0 => format!("{:.1}%", 100.0 * f(w, "draft_accepted_total") / d),
        _ => "-".into(),
    }
}

/// A worker's disk tier: blocks on disk of its capacity, and blocks read back ("-" without one).
fn disk(w: &Value) -> String {
    match f(w, "kv_disk_capacity_blocks") {
        c if c > 0.0 => format!("{}/{} ({})", f(w, "kv_disk_blocks"), c, f(w, "kv_disk_restored_total")),
        _ => "-".into(),
    }
}

/// The summary line and the table, ready to print.
pub fn render(v: &Value) -> String {
    let nodes = v.get("nodes").and_then(Value::as_array).cloned().unwrap_or_default();
    let workers = v.get("workers").and_then(Value::as_array).cloned().unwrap_or_default();
    let ready = nodes.iter().filter(|n| s(n, "state") == "ready").count();
    let mut out = format!(
        "cluster seen from node {}: {} node{}, {} ready; placement {}; cluster prefix-hit ratio {:.1}% (from disk {:.1}%, brought from other workers {:.1}%)\n",
        s(v, "node"),
        nodes.len(),
        if nodes.len() == 1 { "" } else { "s" },
        ready,
        s(v, "policy"),
        100.0 * f(v, "prefix_hit_ratio"),
        100.0 * f(v, "restored_ratio"),
        100.0 * f(v, "imported_ratio"),
    );
    // Each model with the most tokens one request may hold (prompt and output).
    let models = v.get("models").and_then(Value::as_array).cloned().unwrap_or_default();
    if !models.is_empty() {
        let list: Vec<String> = models.iter().map(|m| format!("{} (max_model_len {})", s(m, "id"), f(m, "max_model_len"))).collect();
        out.push_str(&format!("models: {}\n", list.join(", ")));
    }
    let mut t = Table::new();
    t.load_style(UTF8_FULL_CONDENSED);
    t.set_header(vec!["node", "state", "worker", "model", "device", "kv free/total", "cached/pinned", "frag", "prefix hit", "draft kept", "kv in/out", "disk (restored)", "run/wait", "tok/s", "http"]);
    let state = |n: &Value| match (s(n, "state"), f(n, "moving")) {
        ("draining", m) if m > 0.0 => format!("draining, {m} moving"),
        (st, _) => st.to_string(),
    };
    for n in &nodes {
        let id = s(n, "id");
        let ws: Vec<&Value> = workers.iter().filter(|w| s(w, "node") == id).collect();
        if ws.is_empty() {
            t.add_row(vec![id, &state(n), "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", s(n, "http")]);
        }
        for w in ws {
            // A worker whose backend is gone (a lost tensor-parallel rank) takes no work.
            let st = if w.get("unavailable").and_then(Value::as_bool) == Some(true) { format!("{}, worker unavailable", state(n)) } else { state(n) };
            t.add_row(vec![
                Cell::new(id),
                Cell::new(st),
                Cell::new(s(w, "worker")),
                Cell::new(s(w, "model")),
                Cell::new(s(w, "device")),
                Cell::new(format!("{}/{}", f(w, "kv_blocks_free"), f(w, "kv_blocks_total"))),
                Cell::new(format!("{}/{}", f(w, "kv_blocks_cached"), f(w, "kv_blocks_pinned"))),
                Cell::new(format!("{:.1}%", 100.0 * f(w, "kv_fragmentation_ratio"))),
                Cell::new(format!("{:.1}%", 100.0 * f(w, "prefix_hit_ratio"))),
                Cell::new(acceptance(w)),
                // KV blocks imported from other workers / served to them.
                Cell::new(format!("{}/{}", f(w, "kv_blocks_imported_total"), f(w, "kv_blocks_served_total"))),
                Cell::new(disk(w)),
                Cell::new(format!("{}/{}", f(w, "running"), f(w, "waiting"))),
                Cell::new(format!("{:.1}", f(w, "tokens_per_second"))),
                Cell::new(s(n, "http")),
            ]);
        }
    }
    out.push_str(&t.to_string());
    out.push('\n');
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn one_row_per_worker_and_dead_nodes_show() {
        let v = serde_json::json!({
            "node": "a", "policy": "cache_aware", "prefix_hit_ratio": 0.5, "restored_ratio": 0.125, "imported_ratio": 0.25,
            "models": [{"id": "qwen", "max_model_len": 32768}, {"id": "gemma-3-270m", "max_model_len": 8192}],
            "nodes": [{"id": "a", "state": "ready", "http": "127.0.0.1:1"}, {"id": "b", "state": "dead", "http": "127.0.0.1:2"},
                      {"id": "c", "state": "draining", "moving": 3, "http": "127.0.0.1:3"}],
            "workers": [{"node": "a", "worker": "cpu0", "model": "qwen", "device": "cpu", "kv_blocks_free": 10, "kv_blocks_total": 12,
                         "kv_blocks_cached": 3, "kv_blocks_pinned": 2, "kv_fragmentation_ratio": 0.01, "prefix_hit_ratio": 0.25, "running": 1, "waiting": 0, "tokens_per_second": 80.5,
                         "draft_tokens_total": 400, "draft_accepted_total": 250, "kv_blocks_imported_total": 96, "kv_blocks_served_total": 7,
                         "kv_disk_blocks": 40, "kv_disk_capacity_blocks": 5000, "kv_disk_restored_total": 12},
                        {"node": "a", "worker": "tp0", "unavailable": true}]
        });
        let out = super::render(&v);
        assert!(out.lines().any(|l| l.contains(" c ") && l.contains("draining, 3 moving")), "{out}");
        assert!(out.starts_with("cluster seen from node a: 3 nodes, 1 ready; placement cache_aware; cluster prefix-hit ratio 50.0% (from disk 12.5%, brought from other workers 25.0%)"), "{out}");
        assert!(out.contains("cpu0") && out.contains("qwen") && out.contains("10/12") && out.contains("3/2") && out.contains("80.5") && out.contains("25.0%"), "{out}");
        assert!(out.lines().any(|l| l == "models: qwen (max_model_len 32768), gemma-3-270m (max_model_len 8192)"), "{out}");
        assert!(out.lines().any(|l| l.contains("cpu0") && l.contains("62.5%")), "the acceptance rate: {out}");
        assert!(out.lines().any(|l| l.contains("cpu0") && l.contains("96/7")), "KV blocks in and out: {out}");
        assert!(out.lines().any(|l| l.contains("cpu0") && l.contains("40/5000 (12)")), "the disk tier: {out}");
        assert!(out.lines().any(|l| l.contains(" b ") && l.contains("dead")), "{out}");
        assert!(out.lines().any(|l| l.contains("tp0") && l.contains("ready, worker unavailable")), "{out}");
        assert!(!out.lines().any(|l| l.contains("cpu0") && l.contains("unavailable")), "{out}");
    }
}
