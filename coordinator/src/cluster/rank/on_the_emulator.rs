//! A GPU group across two nodes on the CUDA emulator (`--features cuda-emulator`): node b hosts
//! rank 1 on its `cuda:0`, rank 0 runs here on this node's `cuda:0`, and the NCCL group forms
//! from the id the join carries over QUIC (the emulator's NCCL is in-process, so both nodes
//! live in this test; everything between them is the real link). The group gives the bits of
//! the same two ranks on two GPUs of one node: the same kernels, the same all-gather and
//! rank-order sum, so logits are equal at every step.

use std::time::Duration;

use zerolayer_common::ClusterConfig;
use zerolayer_worker::backend::{self, Backend};
use zerolayer_worker::device_check::greedy;
use zerolayer_worker::model::Model;
use zerolayer_worker::synthetic;

use super::lead::open_group;
use crate::cluster::{tls, Cluster};
use crate::quota::Quota;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_group_across_nodes_forms_from_the_nccl_id_sent_over_the_link() {
    let dir = std::env::temp_dir().join(format!("zl-gpu-ranks-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    tls::init(&dir, &["a".into(), "b".into()], false).unwrap();
    let path = dir.join("m.gguf");
    synthetic::write(&path, synthetic::Shape { n_layers: 2, ..Default::default() }, 11).unwrap();
    let (sa, sb) = (std::net::UdpSocket::bind("127.0.0.1:0").unwrap(), std::net::UdpSocket::bind("127.0.0.1:0").unwrap());
    let mut cfg = ClusterConfig::default();
    cfg.model.path = path.clone();
    cfg.cluster.tls_dir = Some(dir.clone());
    cfg.cluster.rank_join_timeout_ms = 60_000;
    let template = cfg.nodes[0].clone();
    cfg.nodes = [("a", &sa), ("b", &sb)]
        .iter()
        .map(|(id, s)| {
            let mut n = template.clone();
            n.id = id.to_string();
            n.quic = Some(s.local_addr().unwrap().to_string());
            n.workers[0].block_size = 16;
            n.workers[0].kv_cache_mb = 4;
            n
        })
        .collect();
    let w = &mut cfg.nodes[0].workers[0];
    (w.device, w.tensor_parallel, w.rank_nodes) = ("cuda:0".into(), 2, vec!["a".into(), "b".into()]);
    cfg.validate().unwrap();
    let wc = cfg.nodes[0].workers[0].clone();

    let host = Cluster::start(&cfg, "b", &[], Some(sb), Quota::new(Vec::new())).await.unwrap();
    let model = |_| Model::from_gguf(&path, 1, |_, _| {}).unwrap().0;
    let group = tokio::time::timeout(Duration::from_secs(120), open_group(&cfg, "a", &wc, model(0))).await.expect("the group forms in time").unwrap();
    assert_eq!(host.hosted_ranks(), 1);
    assert!(group.describe().contains("cuda:0") && group.describe().contains("rank 1 on node b"), "{}", group.describe());
    let local = backend::cuda_group(model(1), 0..2, wc.block_size, wc.kv_cache_mb << 20, 0.9).unwrap();
    tokio::task::spawn_blocking(move || {
        let (mut group, mut local): (Box<dyn Backend>, Box<dyn Backend>) = (group, Box::new(local));
        assert_eq!(group.kv(), local.kv());
        for pi in 0..2u32 {
            let p: Vec<u32> = (0..9 + 5 * pi).map(|j| (j * 7919 + pi * 104_729) % 4096).collect();
            let table: Vec<u32> = (0..16).collect();
            let (tg, lg) = greedy(&mut *group, &p, 6, &table).unwrap();
            let (tl, ll) = greedy(&mut *local, &p, 6, &table).unwrap();
            assert_eq!(tg, tl, "prompt {pi}");
            assert!(lg == ll, "prompt {pi}: the logits differ from the same group's on one node");
        }
        let (mut a, mut b) = (Vec::new(), Vec::new());
        group.read_block(1, &mut a).unwrap();
        local.read_block(1, &mut b).unwrap();
        assert!(!a.is_empty() && a == b, "KV block 1 through the remote GPU rank");
    })
    .await
    .unwrap();
    host.kill();
    drop(sa);
    let _ = std::fs::remove_dir_all(&dir);
}
