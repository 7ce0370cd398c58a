//! Helpers shared by the integration tests: the real model's location, loading, and a lock
//! that keeps model-heavy tests from running at once on a 2-core machine.

pub mod agents;
pub mod bench;
pub mod hostile;

pub use agents::{answered, assert_none_refused, counter, install_agent, metrics_page, run_agent, AgentRun};

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};

use zerolayer_common::SeqEvent;
use zerolayer_common::WorkerConfig;
use zerolayer_worker::engine::Engine;
use zerolayer_worker::loader::{load, Loaded};

/// The default model, fetched by `scripts/fetch-model`. Tests never skip without it: they fail
/// and say how to fetch it.
pub fn model_path() -> PathBuf {
    let p = match std::env::var_os("ZEROLAYER_TEST_MODEL") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    };
    assert!(p.exists(), "the real model is required at {}: run scripts/fetch-model", p.display());
    p
}

/// Serializes tests that run the model (each uses every core).
pub fn heavy() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

pub fn load_default() -> Loaded {
    load(&model_path(), None, 2, |_, _| {}).expect("load the default model")
}

/// The worker config engine-level tests start from: 16-token blocks, a 512 MB KV cache, and
/// stall-free batching off (every step gives prefill the whole budget), so a test's steps do not
/// depend on the host's speed. Tests change what they exercise with `..engine_cfg()`.
pub fn engine_cfg() -> WorkerConfig {
    WorkerConfig { block_size: 16, kv_cache_mb: 512, step_stretch: 0.0, min_step_ms: 0.0, ..WorkerConfig::default() }
}

/// An engine on the default model.
pub fn engine(cfg: WorkerConfig) -> Engine {
    let l = load_default();
    Engine::new(l.model, l.tokenizer, &cfg).expect("engine")
}

/// An engine on the default model whose KV cache holds exactly `kv_bytes` (tests that size the
/// pool in blocks, finer than `kv_cache_mb`).
pub fn engine_with_kv_bytes(cfg: WorkerConfig, kv_bytes: usize) -> Engine {
    let l = load_default();
    let cpu = zerolayer_worker::backend::Cpu::new(l.model, cfg.block_size, cfg.kv_dtype, kv_bytes).expect("KV cache");
    Engine::with_backend(Box::new(cpu), l.tokenizer, &cfg).expect("engine")
}

/// Runs the engine until every listed sequence finishes; returns generated tokens and final events.
pub fn run_all(engine: &mut Engine) -> HashMap<u64, (Vec<u32>, String, SeqEvent)> {
    let mut out: HashMap<u64, (Vec<u32>, String, SeqEvent)> = HashMap::new();
    let mut steps = 0;
    while engine.has_work() {
        steps += 1;
        assert!(steps < 20_000, "engine did not finish");
        for (id, ev) in engine.step().expect("step").events {
            let e = out.entry(id).or_insert_with(|| (vec![], String::new(), SeqEvent::Delta { tokens: vec![], text: String::new(), logprobs: vec![] }));
            match &ev {
                SeqEvent::Delta { tokens, text, .. } => {
                    e.0.extend(tokens);
                    e.1.push_str(text);
                }
                SeqEvent::Finished { .. } => e.2 = ev.clone(),
                SeqEvent::Started { .. } | SeqEvent::PromptLogprobs { .. } => {}
            }
        }
    }
    out
}

/// Qwen2.5-Coder-0.5B-Instruct (Q4_K_M, 32k context), fetched by `scripts/fetch-model
/// qwen2.5-coder-0.5b` (the test script does). Tests never skip without it.
pub fn qwen_model_path() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf");
    assert!(p.exists(), "the Qwen model is required at {}: run scripts/fetch-model qwen2.5-coder-0.5b", p.display());
    p
}

/// Gemma 3 270M (base, Q4_K_M, a SentencePiece vocabulary), fetched by `scripts/fetch-model
/// gemma3-270m` (the test script does). Tests never skip without it.
pub fn gemma_model_path() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/gemma-3-270m-Q4_K_M.gguf");
    assert!(p.exists(), "the Gemma 3 model is required at {}: run scripts/fetch-model gemma3-270m", p.display());
    p
}

/// A reference fixture, `tests/fixtures/NAME.json`, made by the `scripts/gen-*-fixtures` script
/// named `generator` from llama.cpp itself.
pub fn reference_fixture(name: &str, generator: &str) -> serde_json::Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures").join(format!("{name}.json"));
    let raw = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{} (made by scripts/{generator}): {e}", path.display()));
    serde_json::from_str(&raw).unwrap()
}

/// A fixture's list of token ids.
pub fn ids_of(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// Greedy decoding of exactly `n` tokens (end tokens do not stop it), as the reference runs do.
pub fn greedy_tokens(n: u32) -> zerolayer_common::SamplingParams {
    zerolayer_common::SamplingParams { max_tokens: n, temperature: 0.0, ignore_eos: true, ..Default::default() }
}

/// The synthetic models checked against llama.cpp (`tests/tests/synthetic.rs`,
/// `scripts/gen-synthetic-fixtures`): each architecture we have no small file of, by the name
/// the fixture uses, with its shape (every matrix F32) and seed; the vocabulary is SmolLM2's.
pub fn synthetic_models() -> Vec<(&'static str, zerolayer_worker::synthetic::Shape, u64)> {
    use zerolayer_worker::synthetic::{Arch, Shape};
    let small = Shape { n_layers: 2, dim: 128, n_heads: 2, n_kv_heads: 1, head_dim: 64, ffn_dim: 384, context: 4096, dense: true, ..Shape::default() };
    vec![
        // Attention 4 × 64 = 256 wide in a 128-wide model, Q/K norms.
        ("qwen3", Shape { arch: Arch::Qwen3, n_heads: 4, n_kv_heads: 2, ..small }, 3),
        // rope_freqs and tied embeddings.
        ("llama3.1", Shape { arch: Arch::Llama31, ..small }, 31),
    ]
}

/// Writes synthetic model `name` (see [`synthetic_models`]) to `path`; its checksum
/// (`zerolayer_common::checksum` of the file).
pub fn write_synthetic(name: &str, path: &std::path::Path) -> u64 {
    let (_, shape, seed) = synthetic_models().into_iter().find(|(n, _, _)| *n == name).unwrap_or_else(|| panic!("no synthetic model {name:?}"));
    zerolayer_worker::synthetic::write_with(path, shape, seed, Some(&model_path())).unwrap();
    zerolayer_common::checksum(&std::fs::read(path).unwrap())
}

/// A long, varied English text for building prompts of a given token length.
pub const LOREM: &str = "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg \
combined movable metal type, oil-based ink and a wooden press adapted from wine making. Books became cheaper, \
literacy spread across Europe, and scientific ideas travelled faster than ever before. Within fifty years, \
printers in more than two hundred cities had produced millions of volumes, from bibles and grammars to \
almanacs, maps and pamphlets that argued about religion and politics. Historians still debate how much the \
press caused the Reformation and the scientific revolution, but few doubt that it changed how knowledge \
was stored, copied and shared. Today the same questions are asked about the internet and about machine \
learning: who controls the presses, who can read what they print, and what happens to the people whose \
work is automated away. ";

/// A node serving HTTP on 127.0.0.1:0 inside this test process.
pub struct TestServer {
    pub base: String,
    pub frontend: std::sync::Arc<zerolayer_coordinator::frontend::service::Frontend>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    pub task: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

impl TestServer {
    /// A single node serving Qwen2.5-Coder-0.5B-Instruct as `qwen` (a model whose template
    /// renders tools), with 512 MB of KV.
    pub async fn qwen() -> TestServer {
        TestServer::qwen_with(|_| {}).await
    }

    /// [`TestServer::qwen`] with `tweak` applied after.
    pub async fn qwen_with(tweak: impl FnOnce(&mut zerolayer_common::ClusterConfig)) -> TestServer {
        TestServer::start(|c| {
            c.model.path = qwen_model_path();
            c.model.id = "qwen".into();
            c.model.aliases = vec![];
            c.nodes[0].workers[0].kv_cache_mb = 512;
            tweak(c);
        })
        .await
    }

    /// Starts the default single-node config on the real model, with `tweak` applied.
    pub async fn start(tweak: impl FnOnce(&mut zerolayer_common::ClusterConfig)) -> TestServer {
        let mut cfg = zerolayer_common::ClusterConfig::default();
        cfg.model.path = model_path();
        cfg.nodes[0].http = "127.0.0.1:0".into();
        cfg.nodes[0].workers[0].threads = 2;
        cfg.nodes[0].workers[0].kv_cache_mb = 256;
        tweak(&mut cfg);
        let node = zerolayer_coordinator::node::Node::start(cfg, "n1", |_, _, _| {}).await.expect("node starts");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let frontend = node.frontend.clone();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(node.serve(listener, async move {
            let _ = rx.await;
        }));
        TestServer { base, frontend, shutdown: Some(tx), task: Some(task) }
    }

    /// Triggers graceful shutdown and waits for the server to finish.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        self.task.take().unwrap().await?
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    /// Holds the (only) worker's engine at its next step until the returned gate opens.
    pub async fn hold_steps(&self) -> StepGate {
        let gate = StepGate::default();
        self.frontend.workers[0].handle.set_step_hook(Some(gate.hook())).await.unwrap();
        gate
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

/// Parses an SSE body into (event name, JSON data) pairs. Panics on malformed framing.
pub fn parse_sse(body: &str) -> Vec<(String, serde_json::Value)> {
    let mut out = vec![];
    for frame in body.split("\n\n").filter(|f| !f.trim().is_empty()) {
        let mut name = String::new();
        let mut data = String::new();
        for line in frame.lines() {
            if let Some(v) = line.strip_prefix("event:") {
                name = v.trim().to_string();
            } else if let Some(v) = line.strip_prefix("data:") {
                data.push_str(v.trim_start());
            } else if line.starts_with(':') {
            } else {
                panic!("unexpected SSE line {line:?}");
            }
        }
        let v = if data == "[DONE]" { serde_json::Value::String(data) } else { serde_json::from_str(&data).unwrap_or_else(|e| panic!("bad SSE data {data:?}: {e}")) };
        out.push((name, v));
    }
    out
}

/// Scrapes one gauge value (first matching series) from a Prometheus text page.
pub fn metric(page: &str, name: &str) -> Option<f64> {
    page.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (series, value) = l.rsplit_once(' ')?;
        let base = series.split('{').next()?;
        (base == name).then(|| value.parse().ok()).flatten()
    })
}

/// One node of an in-process [`TestCluster`].
pub struct ClusterNode {
    pub id: String,
    pub base: String,
    pub frontend: std::sync::Arc<zerolayer_coordinator::frontend::service::Frontend>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

impl ClusterNode {
    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    /// Stops the node abruptly, as a crash looks to its peers: its QUIC endpoint closes, its
    /// gossip and HTTP tasks end. (Its worker threads keep their memory until the test ends.)
    pub fn kill(&mut self) {
        self.frontend.cluster.kill();
        if let Some(t) = self.task.take() {
            t.abort();
        }
        self.shutdown.take();
    }
}

impl Drop for ClusterNode {
    fn drop(&mut self) {
        self.frontend.cluster.kill();
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}

/// `n` nodes in this process on 127.0.0.1:0, each with one CPU worker on the real model,
/// joined over real QUIC with mutual TLS (certificates from `zerolayer cluster init`'s code).
pub struct TestCluster {
    pub nodes: Vec<ClusterNode>,
    pub tls_dir: PathBuf,
}

/// A fresh temporary directory.
pub fn temp_dir(tag: &str) -> PathBuf {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let d = std::env::temp_dir().join(format!("zl-{tag}-{}-{}", std::process::id(), N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

impl TestCluster {
    /// Node ids are `a`, `b`, `c`, … `tweak` edits the shared config before any node starts.
    pub async fn start(n: usize, tweak: impl FnOnce(&mut zerolayer_common::ClusterConfig)) -> TestCluster {
        let ids: Vec<String> = (0..n).map(|i| ((b'a' + i as u8) as char).to_string()).collect();
        let tls_dir = temp_dir("tls");
        zerolayer_coordinator::cluster::tls::init(&tls_dir, &ids, false).expect("cluster init");
        let sockets: Vec<std::net::UdpSocket> = ids.iter().map(|_| std::net::UdpSocket::bind("127.0.0.1:0").unwrap()).collect();
        let mut cfg = zerolayer_common::ClusterConfig::default();
        cfg.model.path = model_path();
        cfg.cluster.tls_dir = Some(tls_dir.clone());
        let template = cfg.nodes[0].clone();
        cfg.nodes = ids
            .iter()
            .zip(&sockets)
            .map(|(id, s)| {
                let mut nc = template.clone();
                nc.id = id.clone();
                nc.http = "127.0.0.1:0".into();
                nc.quic = Some(s.local_addr().unwrap().to_string());
                nc.workers[0].threads = 2;
                // About 2,500 tokens of KV: a worker holds about four 600-token documents, so a
                // working set of eight fits the cluster only if placement partitions it.
                nc.workers[0].kv_cache_mb = 112;
                nc
            })
            .collect();
        tweak(&mut cfg);
        cfg.validate().expect("valid cluster config");
        // A node whose worker leads a group with ranks on other nodes waits for them at startup:
        // the others start first.
        let leads = |i: usize| cfg.nodes[i].workers.iter().any(|w| !w.rank_nodes.is_empty());
        let mut order: Vec<(usize, String, std::net::UdpSocket)> = ids.iter().cloned().zip(sockets).enumerate().map(|(i, (id, s))| (i, id, s)).collect();
        order.sort_by_key(|(i, _, _)| leads(*i));
        let mut started: Vec<(usize, ClusterNode)> = Vec::new();
        for (i, id, sock) in order {
            let node = zerolayer_coordinator::node::Node::start_with(cfg.clone(), &id, Some(sock), |_, _, _| {}).await.expect("node starts");
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let base = format!("http://{}", listener.local_addr().unwrap());
            let frontend = node.frontend.clone();
            let (tx, rx) = tokio::sync::oneshot::channel::<()>();
            let task = tokio::spawn(node.serve(listener, async move {
                let _ = rx.await;
            }));
            started.push((i, ClusterNode { id: id.clone(), base, frontend, shutdown: Some(tx), task: Some(task) }));
        }
        started.sort_by_key(|(i, _)| *i);
        TestCluster { nodes: started.into_iter().map(|(_, n)| n).collect(), tls_dir }
    }

    /// Waits until every live node sees every other live node `ready`, with its worker's signals.
    pub async fn wait_converged(&self, live: &[usize], within: std::time::Duration) {
        let deadline = std::time::Instant::now() + within;
        loop {
            let ok = live.iter().all(|&i| {
                let c = &self.nodes[i].frontend.cluster;
                let view = c.view();
                live.iter().all(|&j| {
                    let id = &self.nodes[j].id;
                    c.nodes().iter().any(|n| &n.id == id && n.state == zerolayer_coordinator::view::NodeState::Ready)
                        && view.workers.iter().any(|w| &w.node == id && w.signals.kv_blocks_total > 0)
                })
            });
            if ok {
                return;
            }
            assert!(std::time::Instant::now() < deadline, "the cluster did not converge within {within:?}");
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }

    /// Waits until every live node's view indexes the same number of cached blocks per worker
    /// (so prefix-cache gossip has caught up), for two polls in a row.
    pub async fn wait_index_synced(&self, live: &[usize], within: std::time::Duration) {
        let deadline = std::time::Instant::now() + within;
        let mut stable = 0;
        loop {
            let views: Vec<Vec<(String, usize)>> = live
                .iter()
                .map(|&i| {
                    let mut v: Vec<(String, usize)> =
                        self.nodes[i].frontend.cluster.view().workers.iter().filter(|w| live.iter().any(|&j| self.nodes[j].id == w.node)).map(|w| (w.node.clone(), w.cached.len())).collect();
                    v.sort();
                    v
                })
                .collect();
            if views.windows(2).all(|w| w[0] == w[1]) {
                stable += 1;
                if stable >= 2 {
                    return;
                }
            } else {
                stable = 0;
            }
            assert!(std::time::Instant::now() < deadline, "prefix indexes did not converge: {views:?}");
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }
}

/// A ~620-token document, distinct from its first block on (the cluster workloads' shared
/// prefixes).
pub fn document(p: usize, tag: &str) -> String {
    let mut s = format!("[{tag} document {p}] ");
    for k in 0..3 {
        s.push_str(&format!("Part {k} of document {p}. "));
        s.push_str(LOREM);
        s.push(' ');
    }
    s.push_str(&LOREM[..LOREM.len() / 2]);
    s
}

/// A fixed pseudo-random permutation of `0..n` (xorshift), so that every policy sees the same
/// order.
pub fn shuffled(n: usize, seed: u64) -> Vec<usize> {
    let mut v: Vec<usize> = (0..n).collect();
    let mut x = seed;
    for i in (1..n).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
    v
}

/// One answered non-streaming Messages request: where it ran and its usage.
pub struct Answer {
    /// The `zerolayer-worker` header (`node/worker`).
    pub served_by: String,
    pub input_tokens: u64,
    pub cached_tokens: u64,
    pub output_tokens: u64,
    pub secs: f64,
}

/// Sends `text` as a greedy Messages request to `url` and returns where it ran and its usage.
/// Panics on anything but a 200 within 120 s.
pub async fn ask(http: &reqwest::Client, url: &str, text: &str, max_tokens: u32) -> Answer {
    let body = serde_json::json!({"model": "smollm2-135m-instruct", "max_tokens": max_tokens, "temperature": 0,
                                  "messages": [{"role": "user", "content": text}]});
    let t = std::time::Instant::now();
    let r = tokio::time::timeout(std::time::Duration::from_secs(120), http.post(url).json(&body).send())
        .await
        .expect("answer in time")
        .expect("request");
    let status = r.status();
    let served_by = r.headers().get("zerolayer-worker").map(|v| v.to_str().unwrap().to_string()).unwrap_or_default();
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(status, 200, "{v}");
    let u = &v["usage"];
    let n = |k: &str| u[k].as_u64().unwrap_or_else(|| panic!("usage.{k} in {v}"));
    Answer { served_by, input_tokens: n("input_tokens"), cached_tokens: n("cache_read_input_tokens"), output_tokens: n("output_tokens"), secs: t.elapsed().as_secs_f64() }
}

/// Holds engine steps on demand, so a test waits for an event instead of hoping a step is
/// slow. Install with `handle.set_step_hook(Some(gate.hook()))`; while held, the engine thread
/// blocks at the start of its next step that computes something.
#[derive(Clone, Default)]
pub struct StepGate {
    inner: std::sync::Arc<(std::sync::Mutex<GateState>, std::sync::Condvar)>,
}

#[derive(Default)]
struct GateState {
    held: bool,
    /// Steps from this one on (counted as in `steps`) are held too, until `release`.
    held_from: Option<u64>,
    /// Steps currently blocked in the gate.
    waiting: usize,
    /// Steps that have passed the gate (or are in it).
    steps: u64,
}

impl StepGate {
    pub fn hook(&self) -> zerolayer_worker::StepHook {
        let inner = self.inner.clone();
        Box::new(move |_ids| {
            let (m, cv) = &*inner;
            let mut s = m.lock().unwrap();
            s.steps += 1;
            let this = s.steps;
            s.waiting += 1;
            cv.notify_all();
            while s.held || s.held_from.is_some_and(|from| this >= from) {
                s = cv.wait(s).unwrap();
            }
            s.waiting -= 1;
            Ok(())
        })
    }

    pub fn hold(&self) {
        self.inner.0.lock().unwrap().held = true;
    }

    /// Lets the next `n` steps pass and holds every step after them, until `release`. A test
    /// that must see a stream's first events (they leave with the step that made them) and
    /// then find the engine held sets this before it sends the request: holding only once the
    /// events arrive races a short request, which can finish all its steps in between.
    pub fn hold_after(&self, n: u64) {
        let mut s = self.inner.0.lock().unwrap();
        s.held_from = Some(s.steps + n + 1);
    }

    pub fn is_held(&self) -> bool {
        let s = self.inner.0.lock().unwrap();
        s.held || s.held_from.is_some_and(|from| s.steps >= from)
    }

    pub fn release(&self) {
        let (m, cv) = &*self.inner;
        let mut s = m.lock().unwrap();
        s.held = false;
        s.held_from = None;
        cv.notify_all();
    }

    /// Steps that have reached the gate so far.
    pub fn steps(&self) -> u64 {
        self.inner.0.lock().unwrap().steps
    }

    /// Waits (off the async runtime) until a step is blocked in the gate.
    pub async fn wait_blocked(&self, within: std::time::Duration) {
        let inner = self.inner.clone();
        tokio::task::spawn_blocking(move || {
            let (m, cv) = &*inner;
            let s = m.lock().unwrap();
            let (s, t) = cv.wait_timeout_while(s, within, |s| s.waiting == 0).unwrap();
            assert!(!t.timed_out() || s.waiting > 0, "no engine step reached the gate within {within:?}");
        })
        .await
        .unwrap();
    }
}

/// The value of `name{labels…}` in a Prometheus page: the first series whose labels include
/// every `k="v"` given.
pub fn metric_with(page: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    page.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (series, value) = l.rsplit_once(' ')?;
        let (base, rest) = series.split_once('{').unwrap_or((series, ""));
        (base == name && labels.iter().all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")))).then(|| value.parse().ok()).flatten()
    })
}

/// Greedy decoding of `n` tokens straight on a backend, the sequence in the blocks of `table`:
/// the tokens, and the logits each was chosen from.
pub fn greedy_on(b: &mut dyn zerolayer_worker::backend::Backend, prompt: &[u32], n: usize, table: &[u32]) -> (Vec<u32>, Vec<Vec<f32>>) {
    let (mut ctx, mut pos, mut toks, mut all) = (prompt.to_vec(), 0, Vec::new(), Vec::new());
    let mut logits = Vec::new();
    for _ in 0..n {
        let item = zerolayer_worker::model::ForwardItem { tokens: &ctx[pos..], start_pos: pos, block_table: table, logits: 1 };
        let rows = b.forward_into(&[item], &mut logits).unwrap();
        assert_eq!(rows, 1);
        let l = logits[..b.config().vocab_size].to_vec();
        let t = zerolayer_worker::sampler::argmax(&l);
        pos = ctx.len();
        ctx.push(t);
        toks.push(t);
        all.push(l);
    }
    (toks, all)
}

/// An HTTP client for tests against a live server: each request gives up after `secs` seconds.
pub fn http_client(secs: u64) -> reqwest::Client {
    reqwest::Client::builder().timeout(std::time::Duration::from_secs(secs)).build().unwrap()
}

/// An Anthropic Messages request for the default model: greedy, an ordinary system prompt, one
/// user turn `text`.
pub fn messages_body(text: &str, max_tokens: u32, stream: bool) -> serde_json::Value {
    serde_json::json!({"model": "smollm2-135m-instruct", "max_tokens": max_tokens, "stream": stream, "temperature": 0,
           "system": "You are a helpful assistant.", "messages": [{"role": "user", "content": text}]})
}

/// `f`'s output, or a panic naming `what` once `secs` seconds have passed.
pub async fn within<T>(secs: u64, what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(std::time::Duration::from_secs(secs), f).await.unwrap_or_else(|_| panic!("timed out: {what}"))
}

/// Reads a streamed response's chunks into `raw` until `done(raw)` holds: each chunk within
/// `secs` seconds, and panics naming `what` if one is late or the stream ends first.
pub async fn read_stream_until<S>(stream: &mut S, raw: &mut String, secs: u64, what: &str, done: impl Fn(&str) -> bool)
where
    S: futures::Stream<Item = reqwest::Result<bytes::Bytes>> + Unpin,
{
    use futures::StreamExt;
    while !done(raw) {
        let chunk = within(secs, what, stream.next()).await.unwrap_or_else(|| panic!("the stream ended before {what}: {raw}"));
        raw.push_str(&String::from_utf8_lossy(&chunk.expect("a chunk of the stream")));
    }
}

/// The repository's root.
pub fn repo_root() -> PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Runs a setup script (`scripts/client-venv`, `scripts/client-node`) and returns the path it
/// prints.
pub fn client_setup(script: &str) -> String {
    let out = std::process::Command::new(repo_root().join(script)).output().unwrap_or_else(|e| panic!("run {script}: {e}"));
    assert!(out.status.success(), "{script}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// Runs a client test script (`program script`, with `env`) to its end within `within`, and
/// checks that every test it defines (the lines that start with `marker`: at least `at_least`)
/// ran and passed, as `tests/clients/runner.py` and its TypeScript twin print them.
pub async fn run_client_script(program: &str, script: &std::path::Path, marker: &str, env: &[(&str, &str)], at_least: usize, within: std::time::Duration) {
    let mut cmd = tokio::process::Command::new(program);
    cmd.arg(script).envs(env.iter().copied());
    let out = tokio::time::timeout(within, cmd.output()).await.unwrap_or_else(|_| panic!("{} finishes within {within:?}", script.display())).expect("run the client");
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{}:\n{stdout}\n{}", script.display(), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{} failed:\n{stdout}", script.display());
    // Every test the script defines ran and passed: "0 passed, 0 failed" is a failure.
    let source = std::fs::read_to_string(script).unwrap();
    let defined: Vec<&str> = source.lines().filter_map(|l| l.strip_prefix(marker)).map(|l| l.split('(').next().unwrap()).collect();
    assert!(defined.len() >= at_least, "{} defines its tests ({})", script.display(), defined.len());
    assert!(stdout.contains(&format!("{} passed, 0 failed", defined.len())), "expected {} passed:\n{stdout}", defined.len());
    for t in defined {
        let t = t.strip_prefix("test_").unwrap_or(t);
        assert!(stdout.contains(&format!("ok   test_{t}\n")), "test_{t} did not pass:\n{stdout}");
    }
}

/// Everything the process logs, kept for a test to read: a `MakeWriter` for a subscriber.
#[derive(Clone, Default)]
pub struct LogCapture(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl LogCapture {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

impl std::io::Write for LogCapture {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogCapture {
    type Writer = LogCapture;
    fn make_writer(&'a self) -> LogCapture {
        self.clone()
    }
}
