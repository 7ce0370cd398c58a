//! Prometheus metrics: request counters and latency histograms through the `metrics` crate, and
//! the workers' live signals rendered at scrape time. Figures that vLLM also exports are
//! repeated under vLLM's names so existing dashboards and autoscalers can scrape us.

use std::fmt::Write as _;
use std::sync::OnceLock;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use zerolayer_common::WorkerSignals;

const LATENCY_BUCKETS: &[f64] =
    &[0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0];

/// The process-wide recorder (one per process; series carry a `node` label).
pub fn handle() -> &'static PrometheusHandle {
    static H: OnceLock<PrometheusHandle> = OnceLock::new();
    H.get_or_init(|| {
        let builder = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS)
            .expect("buckets are valid");
        let recorder = builder.build_recorder();
        let handle = recorder.handle();
        // A second install (another component set one first) keeps rendering from our handle.
        let _ = metrics::set_global_recorder(recorder);
        handle
    })
}

/// Series that only events move (moves, drains, diagnoses, fetches per worker, fallbacks and
/// policy matches: each configured pair and rule)
/// start at zero, so that dashboards and alerts see a flat line rather than no data before the
/// first event.
pub fn zeroes(node: &str, workers: &[String], fallbacks: &[(String, String)], rules: &[(String, &'static str)]) {
    for w in workers {
        for (direction, outcome) in [("in", "ok"), ("in", "failed")] {
            metrics::counter!("zerolayer_kv_fetches_total", "node" => node.to_string(), "worker" => w.clone(), "direction" => direction, "outcome" => outcome).increment(0);
        }
        for direction in ["in", "out"] {
            metrics::counter!("zerolayer_kv_fetch_bytes_total", "node" => node.to_string(), "worker" => w.clone(), "direction" => direction).increment(0);
        }
        metrics::counter!("zerolayer_kv_fetched_tokens_total", "node" => node.to_string(), "worker" => w.clone()).increment(0);
    }
    for (rule, direction) in rules {
        metrics::counter!("zerolayer_policy_matches_total", "node" => node.to_string(), "rule" => rule.clone(), "direction" => *direction).increment(0);
    }
    for (from, to) in fallbacks {
        metrics::counter!("zerolayer_fallbacks_total", "node" => node.to_string(), "from" => from.clone(), "to" => to.clone()).increment(0);
    }
    for kind in ["kv", "replay", "exhausted"] {
        metrics::counter!("zerolayer_migrations_total", "node" => node.to_string(), "kind" => kind).increment(0);
    }
    metrics::counter!("zerolayer_drain_moves_total", "node" => node.to_string()).increment(0);
    metrics::counter!("zerolayer_cache_miss_diagnoses_total", "node" => node.to_string(), "reason" => "none").increment(0);
}

pub fn request_done(node: &str, endpoint: &'static str, status: u16) {
    metrics::counter!("zerolayer_requests_total", "node" => node.to_string(), "endpoint" => endpoint, "status" => status.to_string())
        .increment(1);
}

pub fn ttft(node: &str, secs: f64) {
    metrics::histogram!("zerolayer_time_to_first_token_seconds", "node" => node.to_string()).record(secs);
    metrics::histogram!("vllm:time_to_first_token_seconds", "node" => node.to_string()).record(secs);
}

pub fn inter_token(node: &str, secs: f64) {
    metrics::histogram!("zerolayer_inter_token_latency_seconds", "node" => node.to_string()).record(secs);
    metrics::histogram!("vllm:inter_token_latency_seconds", "node" => node.to_string()).record(secs);
}

/// A finished request's phases (`prepare`, `queue`, `prefill`, `decode`, and `migrate` when it
/// moved), and its whole time.
pub fn phases(node: &str, phases: &[(&'static str, std::time::Duration)], total: std::time::Duration) {
    for (phase, d) in phases {
        metrics::histogram!("zerolayer_request_phase_seconds", "node" => node.to_string(), "phase" => *phase).record(d.as_secs_f64());
    }
    metrics::histogram!("zerolayer_request_duration_seconds", "node" => node.to_string()).record(total.as_secs_f64());
    metrics::histogram!("vllm:e2e_request_latency_seconds", "node" => node.to_string()).record(total.as_secs_f64());
}

pub fn tokens(node: &str, input: u64, cached: u64, output: u64) {
    let n = node.to_string();
    metrics::counter!("zerolayer_input_tokens_total", "node" => n.clone()).increment(input + cached);
    metrics::counter!("zerolayer_cached_input_tokens_total", "node" => n.clone()).increment(cached);
    metrics::counter!("zerolayer_output_tokens_total", "node" => n.clone()).increment(output);
    metrics::counter!("vllm:prompt_tokens_total", "node" => n.clone()).increment(input + cached);
    metrics::counter!("vllm:generation_tokens_total", "node" => n).increment(output);
}

/// Renders everything: recorded series, one gauge set per local worker, and one
/// `zerolayer_cluster_node_state` series per node this node knows (value 1 on its state).
pub fn render(node: &str, model: &str, workers: &[(String, WorkerSignals)], peers: &[(String, &'static str)]) -> String {
    let h = handle();
    h.run_upkeep();
    let mut out = h.render();
    let mut gauge = |name: &str, help: &str, kind: &str, f: &dyn Fn(&WorkerSignals) -> f64| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (w, s) in workers {
            let _ = writeln!(out, "{name}{{node=\"{node}\",worker=\"{w}\",model_name=\"{model}\"}} {}", f(s));
        }
    };
    gauge("zerolayer_kv_blocks_total", "KV cache blocks on the worker", "gauge", &|s| s.kv_blocks_total as f64);
    gauge("zerolayer_kv_blocks_free", "KV blocks not referenced by any sequence (includes cached)", "gauge", &|s| s.kv_blocks_free as f64);
    gauge("zerolayer_kv_blocks_cached", "Free KV blocks still holding a cached prefix", "gauge", &|s| s.kv_blocks_cached as f64);
    gauge("zerolayer_kv_fragmentation_ratio", "1 - live token slots / allocated slots", "gauge", &|s| s.kv_fragmentation_ratio as f64);
    gauge("zerolayer_memory_used_bytes", "Weights plus KV blocks held by sequences", "gauge", &|s| s.memory_used_bytes as f64);
    gauge("zerolayer_memory_limit_bytes", "Weights plus the whole KV pool", "gauge", &|s| s.memory_limit_bytes as f64);
    gauge("zerolayer_kv_blocks_pinned", "KV blocks holding a cache_control pin", "gauge", &|s| s.kv_blocks_pinned as f64);
    gauge("zerolayer_running_sequences", "Sequences in the running batch", "gauge", &|s| s.running as f64);
    gauge("zerolayer_waiting_sequences", "Sequences waiting for admission", "gauge", &|s| s.waiting as f64);
    gauge("zerolayer_waiting_prefill_tokens", "Prompt tokens not yet computed", "gauge", &|s| s.waiting_prefill_tokens as f64);
    gauge("zerolayer_active_decode_blocks", "Blocks held by decoding sequences", "gauge", &|s| s.active_decode_blocks as f64);
    gauge("zerolayer_prefix_hit_ratio", "Prefix-cache hit ratio over recent admissions", "gauge", &|s| s.prefix_hit_ratio as f64);
    gauge("zerolayer_preemptions_total", "Sequences preempted by recompute", "counter", &|s| s.preemptions_total as f64);
    gauge("zerolayer_repreemptions_total", "Preemptions of sequences preempted before (preemption loops)", "counter", &|s| s.repreemptions_total as f64);
    gauge("zerolayer_draft_tokens_total", "Speculative draft tokens verified", "counter", &|s| s.draft_tokens_total as f64);
    gauge("zerolayer_draft_accepted_tokens_total", "Speculative draft tokens kept (equal to the sampler's draws)", "counter", &|s| s.draft_accepted_total as f64);
    gauge("zerolayer_draft_rejected_tokens_total", "Speculative draft tokens rejected", "counter", &|s| s.draft_tokens_total.saturating_sub(s.draft_accepted_total) as f64);
    gauge("zerolayer_draft_acceptance_ratio", "Kept / verified speculative draft tokens since the start", "gauge", &|s| {
        if s.draft_tokens_total == 0 { 0.0 } else { s.draft_accepted_total as f64 / s.draft_tokens_total as f64 }
    });
    gauge("zerolayer_tokens_per_second", "Output tokens per second, recent", "gauge", &|s| s.tokens_per_second as f64);
    gauge("zerolayer_kv_blocks_imported_total", "KV blocks written into the prefix cache from other workers (drains, warm-ups, fetches)", "counter", &|s| s.kv_blocks_imported_total as f64);
    gauge("zerolayer_kv_blocks_served_total", "Cached KV blocks read out for other workers (fetches, warm-ups)", "counter", &|s| s.kv_blocks_served_total as f64);
    gauge("zerolayer_kv_disk_blocks", "KV blocks in the worker's disk tier", "gauge", &|s| s.kv_disk.blocks as f64);
    gauge("zerolayer_kv_disk_capacity_blocks", "KV blocks the worker's disk tier holds at most", "gauge", &|s| s.kv_disk.capacity_blocks as f64);
    gauge("zerolayer_kv_disk_blocks_written_total", "KV blocks evicted from RAM and written to the disk tier", "counter", &|s| s.kv_disk.written_total as f64);
    gauge("zerolayer_kv_disk_spills_dropped_total", "Evicted KV blocks not written to the disk tier (its queue full, or every slot pinned)", "counter", &|s| s.kv_disk.dropped_total as f64);
    gauge("zerolayer_kv_disk_blocks_restored_total", "KV blocks read back from the disk tier into RAM for a prompt that hit them", "counter", &|s| s.kv_disk.restored_total as f64);
    // Hit ratio per tier since the start: prompt tokens found in RAM (computed here, or brought
    // by a drain or a fetch) and read back from disk, over prompt tokens looked up.
    let tier_ratio = |s: &WorkerSignals, disk: bool| {
        let restored = (s.kv_disk.restored_total * s.block_size as u64).min(s.prefix_cache_hits_total);
        let hits = if disk { restored } else { s.prefix_cache_hits_total - restored };
        if s.prefix_cache_queries_total == 0 { 0.0 } else { hits as f64 / s.prefix_cache_queries_total as f64 }
    };
    gauge("zerolayer_prefix_hit_ratio_ram", "Prompt tokens found in the RAM cache / prompt tokens looked up, since the start", "gauge", &|s| tier_ratio(s, false));
    gauge("zerolayer_prefix_hit_ratio_disk", "Prompt tokens read back from the disk tier / prompt tokens looked up, since the start", "gauge", &|s| tier_ratio(s, true));
    gauge("vllm:num_requests_running", "Number of requests in the running batch", "gauge", &|s| s.running as f64);
    gauge("vllm:num_requests_waiting", "Number of requests waiting", "gauge", &|s| s.waiting as f64);
    gauge("vllm:kv_cache_usage_perc", "KV cache usage, 1 = full", "gauge", &|s| {
        if s.kv_blocks_total == 0 { 0.0 } else { 1.0 - s.kv_blocks_free as f64 / s.kv_blocks_total as f64 }
    });
    gauge("vllm:prefix_cache_hits_total", "Prompt tokens served from the prefix cache", "counter", &|s| s.prefix_cache_hits_total as f64);
    gauge("vllm:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache", "counter", &|s| s.prefix_cache_queries_total as f64);
    let _ = writeln!(out, "# HELP zerolayer_cluster_node_state Membership state of each node, as this node sees it\n# TYPE zerolayer_cluster_node_state gauge");
    for (peer, state) in peers {
        for st in ["joining", "ready", "draining", "dead"] {
            let _ = writeln!(out, "zerolayer_cluster_node_state{{node=\"{node}\",peer=\"{peer}\",state=\"{st}\"}} {}", u8::from(*state == st));
        }
    }
    out
}
