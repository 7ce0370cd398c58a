//! A certified peer that sends hostile frames, over real QUIC with mutual TLS (the forged
//! origins, gossip, imports and rank joins of `cluster.rs` are tested there):
//! - 520 mutated opening frames, 20 of each kind of frame (`wire::samples`, mutated as the
//!   fuzz pass does), each on its own stream, and frames that announce more than the limit;
//! - 64 streams at once, each announcing the largest frame (4 MiB) and sending all of it but
//!   its last byte: the node reads at most its budget for that peer
//!   (`frames::OPENING_BYTES_PER_PEER`, 16 MiB) at once, and the rest wait;
//! - the node stays up and ready (no frame drains it: the cluster has an admin key), its
//!   gossip runs, the process's resident memory stays bounded (printed),
//!   and its greedy answer is the same before and after.

use std::time::{Duration, Instant};

use zerolayer_common::wire::{samples, MAX_FRAME_BYTES};
use zerolayer_coordinator::cluster::frames::OPENING_BYTES_PER_PEER;
use zerolayer_coordinator::cluster::tls;
use zerolayer_tests::hostile::{mutate, Rng};
use zerolayer_tests::*;

/// The process's resident memory (both nodes and the attacker live in it), in MiB.
fn rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: f64 = status.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok()).unwrap();
    kb / 1024.0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_frames_cannot_stop_a_node() {
    let _g = heavy();
    // With an admin key: a node without one takes anyone's drain, over HTTP or the link.
    let cluster = TestCluster::start(2, |c| c.auth.admin_key = Some("sk-admin-hostile-0123456789".into())).await;
    cluster.wait_converged(&[0, 1], Duration::from_secs(15)).await;
    let b = &cluster.nodes[1];
    let http = http_client(120);
    let url = format!("{}/v1/messages", b.base);
    let question = "Name the planets of the solar system.";
    let before = ask_text(&http, &url, question).await;
    let rss_before = rss_mib();

    let mat = tls::TlsMaterial::load(&cluster.tls_dir, "a").unwrap();
    let client = tls::endpoint(std::net::UdpSocket::bind("127.0.0.1:0").unwrap(), &mat, Duration::from_secs(30)).unwrap();
    let conn = client.connect(b.frontend.cluster.quic_addr().unwrap(), tls::SERVER_NAME).unwrap().await.unwrap();

    // Sends a frame (a length prefix and a body, or anything) on a new stream and waits a while
    // for whatever comes back.
    let send = |frame: Vec<u8>| {
        let conn = conn.clone();
        async move {
            let Ok((mut s, mut r)) = conn.open_bi().await else { return };
            let _ = s.write_all(&frame).await;
            let _ = s.finish();
            let _ = tokio::time::timeout(Duration::from_secs(30), r.read_to_end(1 << 20)).await;
        }
    };
    // Mutated opening frames of every kind, 16 streams at a time.
    let mut rng = Rng(0x5eed_f00d_1234_5678);
    let mut frames = Vec::new();
    for input in samples::inputs() {
        for _ in 0..20 {
            let body = mutate(&input, &mut rng);
            frames.push([&(body.len() as u32 - 1).to_le_bytes()[..], &body[1..]].concat());
        }
    }
    frames.push((MAX_FRAME_BYTES as u32 + 1).to_le_bytes().to_vec());
    frames.push([&u32::MAX.to_le_bytes()[..], &[0u8; 64][..]].concat());
    frames.push([&64u32.to_le_bytes()[..], &[0xffu8; 10][..]].concat());
    let sent = frames.len();
    let t0 = Instant::now();
    for chunk in frames.chunks(16) {
        futures::future::join_all(chunk.iter().map(|f| send(f.clone()))).await;
    }
    eprintln!("{sent} hostile frames answered in {:.1} s", t0.elapsed().as_secs_f64());

    // 64 streams announcing the largest frame, all but its last byte sent: b reads at most the
    // peer's budget at once.
    let big = std::sync::Arc::new(vec![0xabu8; MAX_FRAME_BYTES - 1]);
    let mut held_streams = Vec::new();
    for _ in 0..64 {
        let (mut s, r) = conn.open_bi().await.unwrap();
        let body = big.clone();
        held_streams.push(tokio::spawn(async move {
            let _ = s.write_all(&(MAX_FRAME_BYTES as u32).to_le_bytes()).await;
            let _ = s.write_all(&body).await;
            (s, r)
        }));
    }
    let deadline = Instant::now() + Duration::from_secs(8);
    let mut most = 0;
    while Instant::now() < deadline {
        most = most.max(b.frontend.cluster.opening_bytes_held());
        if most >= OPENING_BYTES_PER_PEER {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let rss_during = rss_mib();
    assert_eq!(most, OPENING_BYTES_PER_PEER, "b reads the peer's whole budget of opening frames, and no more");
    assert!(b.frontend.cluster.opening_bytes_held() <= OPENING_BYTES_PER_PEER);
    for h in held_streams {
        h.abort();
    }
    conn.close(0u32.into(), b"done");
    let deadline = Instant::now() + Duration::from_secs(15);
    while b.frontend.cluster.opening_bytes_held() > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(b.frontend.cluster.opening_bytes_held(), 0, "a closed connection's frames give their budget back");

    cluster.wait_converged(&[0, 1], Duration::from_secs(15)).await;
    let after = ask_text(&http, &url, question).await;
    assert_eq!(after, before, "b's greedy answer is unchanged");
    let rss_after = rss_mib();
    eprintln!("resident memory: {rss_before:.0} MiB before, {rss_during:.0} MiB with 64 streams of 4 MiB pending, {rss_after:.0} MiB after");
    // Measured: +73 MiB (the budget's 16 MiB, QUIC's buffers on both sides); without the budget
    // the 64 bodies alone are 256 MiB.
    assert!(rss_during - rss_before < 160.0, "64 pending 4 MiB frames hold less than 160 MiB ({rss_before:.0} → {rss_during:.0} MiB)");
}

/// The greedy answer's text.
async fn ask_text(http: &reqwest::Client, url: &str, text: &str) -> String {
    let body = serde_json::json!({"model": "smollm2-135m-instruct", "max_tokens": 24, "temperature": 0, "messages": [{"role": "user", "content": text}]});
    let v: serde_json::Value = http.post(url).json(&body).send().await.unwrap().json().await.unwrap();
    v["content"][0]["text"].as_str().unwrap_or_else(|| panic!("an answer: {v}")).to_string()
}
