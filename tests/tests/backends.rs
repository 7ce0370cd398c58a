//! The engine's side of the backend contract, on the real model: tokens a device picks for
//! greedy rows, and top-k candidates it selects for sampled rows (as the CUDA backend does,
//! sparing the logits' trip to the host), give exactly the host sampler's output, with
//! sampled and greedy sequences side by side.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use zerolayer_common::{Job, SamplingParams};
use zerolayer_worker::backend::{Backend, Cpu, Shape};
use zerolayer_common::WorkerConfig;
use zerolayer_worker::engine::Engine;
use zerolayer_worker::model::ForwardItem;
use zerolayer_worker::sampler::{argmax, select_top_k, Pick, Picked};
use zerolayer_worker::Result;
use zerolayer_tests::*;

/// The CPU backend, picking the way a device does: every row's argmax when a row is greedy,
/// each top-k row's candidates (in reverse, as any order must do), and no logits at all when
/// no row is sampled on the host.
struct Picking {
    inner: Cpu,
    picked: Arc<AtomicUsize>,
    selected: Arc<AtomicUsize>,
    logits_skipped: Arc<AtomicUsize>,
}

impl Backend for Picking {
    fn shape(&self) -> Shape<'_> {
        self.inner.shape()
    }
    fn forward_into(&mut self, items: &[ForwardItem<'_>], logits: &mut Vec<f32>) -> Result<usize> {
        self.inner.forward_into(items, logits)
    }
    fn forward_pick(&mut self, items: &[ForwardItem<'_>], picks: &[Pick], logits: &mut Vec<f32>, picked: &mut Picked) -> Result<usize> {
        let rows = self.inner.forward_into(items, logits)?;
        assert_eq!(picks.len(), rows, "one pick per logits row");
        let v = self.config().vocab_size;
        picked.clear();
        if picks.contains(&Pick::Greedy) {
            picked.tokens.extend((0..rows).map(|r| argmax(&logits[r * v..(r + 1) * v])));
        }
        if picks.iter().any(|p| matches!(p, Pick::TopK { .. })) {
            picked.ranges = vec![(0, 0); rows];
            for (r, p) in picks.iter().enumerate() {
                if let Pick::TopK { k, inv_t } = *p {
                    let mut c = select_top_k(&logits[r * v..(r + 1) * v], k as usize, inv_t);
                    c.reverse();
                    picked.ranges[r] = (picked.candidates.len(), c.len());
                    picked.candidates.extend(c);
                }
            }
        }
        self.picked.fetch_add(picks.iter().filter(|&&p| p == Pick::Greedy).count(), Ordering::Relaxed);
        self.selected.fetch_add(picks.iter().filter(|p| matches!(p, Pick::TopK { .. })).count(), Ordering::Relaxed);
        if rows > 0 && !picks.contains(&Pick::Host) {
            logits.clear();
            self.logits_skipped.fetch_add(1, Ordering::Relaxed);
        }
        Ok(rows)
    }
    fn read_block(&self, b: u32, out: &mut Vec<u8>) -> zerolayer_worker::error::Result<()> {
        self.inner.read_block(b, out)
    }
    fn write_block(&mut self, b: u32, bytes: &[u8]) -> zerolayer_worker::error::Result<()> {
        self.inner.write_block(b, bytes)
    }
    fn describe(&self) -> String {
        format!("picking greedy tokens over {}", self.inner.describe())
    }
}

fn requests(engine: &mut Engine, phase: u64) {
    let tok = engine.tokenizer.clone();
    for (i, text) in ["The capital of France is", "Once upon a time", "def add(a, b):", "Colors of the rainbow:"].iter().enumerate() {
        let ids = tok.encode(text).unwrap();
        let params = if phase == 1 && i == 1 {
            // Sampled, seeded, no top-k: the host draws it from the logits, beside the greedy rows.
            SamplingParams { max_tokens: 20, temperature: 0.8, top_p: Some(0.9), seed: Some(7), ignore_eos: true, ..Default::default() }
        } else if phase >= 1 && i == 2 {
            // Sampled with top-k: drawn from the candidates the "device" selected (phase 2:
            // beside greedy rows only, so no logits come back at all).
            SamplingParams { max_tokens: 20, temperature: 1.1, top_k: Some(40), top_p: Some(0.95), seed: Some(11), ignore_eos: true, ..Default::default() }
        } else {
            SamplingParams { max_tokens: 20 + i as u32, ignore_eos: true, ..SamplingParams::greedy(20) }
        };
        engine.add(phase * 10 + i as u64, Job::new(ids, params)).unwrap();
    }
}

#[test]
fn device_picked_tokens_and_top_k_candidates_equal_the_host_sampler() {
    let _g = heavy();
    let cfg = WorkerConfig { block_size: 16, kv_cache_mb: 64, ..engine_cfg() };
    let mut host = engine(cfg.clone());
    let l = load_default();
    let (picked, selected, skipped) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let backend = Picking { inner: Cpu::new(l.model, cfg.block_size, cfg.kv_dtype, cfg.kv_cache_mb << 20).unwrap(), picked: picked.clone(), selected: selected.clone(), logits_skipped: skipped.clone() };
    let mut device = Engine::with_backend(Box::new(backend), l.tokenizer, &cfg).unwrap();
    // Phase 0: greedy only (every step's logits stay on the "device"); phase 1: a sampled
    // sequence (logits come back for it) and a top-k one among greedy ones; phase 2: top-k
    // among greedy ones (logits stay on the "device" again).
    for phase in 0..3 {
        requests(&mut host, phase);
        requests(&mut device, phase);
        let (a, b) = (run_all(&mut host), run_all(&mut device));
        assert_eq!(a.len(), 4);
        for (id, (tokens, text, _)) in &a {
            assert_eq!(&b[id].0, tokens, "sequence {id}: tokens");
            assert_eq!(&b[id].1, text, "sequence {id}: text");
        }
    }
    assert!(picked.load(Ordering::Relaxed) >= 4 * 20, "greedy rows were picked on the device side");
    assert!(selected.load(Ordering::Relaxed) >= 2 * 20, "top-k rows were selected on the device side");
    assert!(skipped.load(Ordering::Relaxed) >= 30, "steps with no host-sampled row skipped the logits");
}
