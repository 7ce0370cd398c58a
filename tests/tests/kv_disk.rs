//! A worker's disk tier (real model, one node): blocks that RAM evicts are kept on disk, a
//! prompt whose prefix a flood pushed out of RAM reads it back from disk instead of recomputing
//! it (the control, without a disk tier, recomputes it), and a restart on the same directory
//! reloads the tier, so the prompt is still cached.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use zerolayer_common::config::KvDtype;
use zerolayer_tests::{document, heavy, metric_with, temp_dir, TestServer};

/// 64 MB of f16 KV (about 2,800 tokens), and a 512 MB disk tier in `disk` if given.
async fn server(disk: Option<&Path>) -> TestServer {
    let disk = disk.map(Path::to_path_buf);
    TestServer::start(move |c| {
        let w = &mut c.nodes[0].workers[0];
        w.kv_cache_mb = 64;
        w.kv_dtype = KvDtype::F16;
        if let Some(d) = disk {
            w.kv_disk_mb = 512;
            w.kv_disk_dir = Some(d);
        }
    })
    .await
}

/// One greedy one-token Messages request: (prompt tokens, cached tokens, seconds).
async fn ask(s: &TestServer, text: &str) -> (u64, u64, f64) {
    let body = json!({"model": "smollm2-135m-instruct", "max_tokens": 1, "temperature": 0, "messages": [{"role": "user", "content": text}]});
    let t = Instant::now();
    let r = tokio::time::timeout(Duration::from_secs(120), reqwest::Client::new().post(s.url("/v1/messages")).json(&body).send()).await.expect("an answer in time").unwrap();
    let v: Value = r.json().await.unwrap();
    let u = &v["usage"];
    let n = |k: &str| u[k].as_u64().unwrap_or_else(|| panic!("usage.{k} in {v}"));
    (n("input_tokens") + n("cache_read_input_tokens") + u["cache_creation_input_tokens"].as_u64().unwrap_or(0), n("cache_read_input_tokens"), t.elapsed().as_secs_f64())
}

/// About 1,250 tokens, kept across the flood.
fn kept_prompt() -> String {
    format!("{}\n{}\nWhat do the two documents above have in common?", document(0, "kept"), document(1, "kept"))
}

/// A prompt, 24 other ~640-token prompts (15,000 tokens: five times the RAM cache), then the
/// prompt again: returns its second (prompt, cached) tokens and seconds.
async fn flood(s: &TestServer) -> (u64, u64, f64) {
    let (input, cached, _) = ask(s, &kept_prompt()).await;
    assert!(input > 1_100 && cached < input / 10, "a long, cold prompt: {cached} of {input} cached");
    for i in 0..24 {
        ask(s, &format!("{}\nSummarize the document above.", document(2, &format!("flood {i}")))).await;
    }
    ask(s, &kept_prompt()).await
}

fn disk_signals(s: &TestServer) -> zerolayer_common::DiskSignals {
    s.frontend.workers[0].handle.signals().kv_disk
}

/// Acceptance: with a 64 MB RAM cache and a disk tier, a prompt, a flood of 24 other long
/// prompts, then the prompt again reads at least 90% from cache (restored from disk); without
/// the disk tier, under 10% (the control, in the same test). A restart on the same directory
/// reloads the tier: the prompt is still read from cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_flood_pushes_a_prefix_to_disk_and_a_hit_restores_it_even_after_a_restart() {
    let _g = heavy();
    let dir = temp_dir("kv-disk");

    let control = server(None).await;
    let (input, cached, cold_secs) = flood(&control).await;
    assert!(cached * 10 < input, "without a disk tier the flood evicted the prefix: {cached} of {input} cached");
    control.stop().await.unwrap();

    let s = server(Some(&dir)).await;
    let (input, cached, warm_secs) = flood(&s).await;
    let d = disk_signals(&s);
    eprintln!("disk tier: {cached} of {input} cached ({warm_secs:.2}s against {cold_secs:.2}s recomputed); {d:?}");
    assert!(cached * 10 >= input * 9, "with a disk tier at least 90% read from cache: {cached} of {input} ({d:?})");
    assert!(d.restored_total as u64 * 4 >= cached / 2, "the blocks came back from disk: {d:?}");
    assert!(d.written_total > 0 && d.blocks > 0 && d.capacity_blocks > d.blocks, "{d:?}");
    // The node's prefix index knows which blocks sit on disk (their even disk names), for
    // placement to price them.
    let deadline = Instant::now() + Duration::from_secs(10);
    let on_disk = || s.frontend.cluster.view().workers.iter().map(|w| w.cached.iter().filter(|&&h| h % 2 == 0).count()).sum::<usize>();
    while on_disk() * 10 < d.blocks as usize * 9 {
        assert!(Instant::now() < deadline, "the index shows {} of {} disk blocks", on_disk(), d.blocks);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let page = reqwest::get(s.url("/metrics")).await.unwrap().text().await.unwrap();
    let restored = metric_with(&page, "zerolayer_kv_disk_blocks_restored_total", &[("worker", "cpu0")]);
    assert!(restored.is_some_and(|r| r >= d.restored_total as f64 / 2.0), "/metrics shows the restores: {restored:?}");
    let tier = |t: &str| metric_with(&page, &format!("zerolayer_prefix_hit_ratio_{t}"), &[("worker", "cpu0")]).unwrap_or(-1.0);
    assert!(tier("disk") > 0.0 && tier("ram") >= 0.0 && tier("disk") + tier("ram") <= 1.0, "hit ratio per tier: ram {}, disk {}", tier("ram"), tier("disk"));
    s.stop().await.unwrap();

    // The restart: the file's header matches (same model, same geometry), so its index reloads.
    let again = server(Some(&dir)).await;
    assert!(disk_signals(&again).blocks > 0, "the disk tier reloaded: {:?}", disk_signals(&again));
    let (input, cached, _) = ask(&again, &kept_prompt()).await;
    assert!(cached * 10 >= input * 9, "after a restart the prefix is read from disk: {cached} of {input}");
    again.stop().await.unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}
