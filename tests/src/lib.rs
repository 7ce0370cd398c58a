//! Helpers shared by the integration tests: the real model's location, loading, and a lock
//! that keeps model-heavy tests from running at once on a 2-core machine.

use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};

use zerolayer_node::engine::{Engine, EngineConfig};
use zerolayer_node::loader::{load, Loaded};

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

/// An engine on the default model.
pub fn engine(cfg: EngineConfig) -> Engine {
    let l = load_default();
    Engine::new(l.model, l.tokenizer, &cfg).expect("engine")
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
    pub coordinator: std::sync::Arc<zerolayer_coordinator::coordinator::Coordinator>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    pub task: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

impl TestServer {
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
        let coordinator = node.coordinator.clone();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(node.serve(listener, async move {
            let _ = rx.await;
        }));
        TestServer { base, coordinator, shutdown: Some(tx), task: Some(task) }
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
