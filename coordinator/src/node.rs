//! Starting a node (this process): load the model onto each worker, build the front end, serve HTTP on an
//! already-bound listener until a shutdown future resolves, then drain within the grace period.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;
use zerolayer_common::ClusterConfig;
use zerolayer_worker::engine::Engine;
use zerolayer_worker::chat::ChatTemplate;
use zerolayer_worker::loader;
use zerolayer_worker::tokenizer::Tokenizer;
use zerolayer_worker::WorkerHandle;

use crate::cluster::{Cluster, LocalWorker};
use crate::frontend::pipeline::{ModelInfo, Served};
use crate::frontend::service::{Admission, Frontend};
use crate::routing::dispatch::Dispatcher;
use crate::routing::orchestrator::{Orchestrator, OrchestratorContext};
use crate::view::NodeState;

/// A started node: its front end and the switch that ends open streams.
pub struct Node {
    pub frontend: Arc<Frontend>,
    hard_stop_tx: watch::Sender<bool>,
}

impl Node {
    /// Loads the model for every worker of node `node_id` in `config`.
    /// `progress(worker, done, total)` reports layers loaded.
    pub async fn start(config: ClusterConfig, node_id: &str, progress: impl FnMut(&str, usize, usize) + Send) -> anyhow::Result<Node> {
        Node::start_with(config, node_id, None, progress).await
    }

    /// As [`Node::start`], with the QUIC socket already bound (tests bind `127.0.0.1:0` and
    /// write the real addresses into the config, so no port is guessed).
    pub async fn start_with(
        config: ClusterConfig,
        node_id: &str,
        quic_socket: Option<std::net::UdpSocket>,
        mut progress: impl FnMut(&str, usize, usize) + Send,
    ) -> anyhow::Result<Node> {
        // Models the config gives no id are served under their files' own names.
        let mut config = config;
        config.name_models(loader::served_name)?;
        let node = config.node(node_id).ok_or_else(|| anyhow::anyhow!("node {node_id:?} is not in the cluster config"))?.clone();
        // Install the metrics recorder before anything records: series recorded earlier would go
        // to the no-op recorder and be lost.
        crate::metrics::handle();
        let fallbacks: Vec<(String, String)> = config.all_models().flat_map(|m| config.fallbacks(&m.id).into_iter().map(|f| (m.id.clone(), f.id.clone()))).collect();
        let rules: Vec<(String, &'static str)> = config
            .policy
            .rules
            .iter()
            .flat_map(|r| [(r.applies_to.input(), "input"), (r.applies_to.output(), "output")].into_iter().filter(|(on, _)| *on).map(|(_, d)| (r.name.clone(), d)))
            .collect();
        let worker_ids: Vec<String> = node.workers.iter().map(|w| w.id.clone()).collect();
        crate::metrics::zeroes(node_id, &worker_ids, &fallbacks, &rules);
        crate::logs::configure(&config.logging)?;
        let mut workers = Vec::new();
        // Per model id: the front end a local worker loaded, and the context a request may use
        // (the model's, or less where a local worker's KV cache holds fewer tokens).
        let mut fronts: HashMap<String, (Arc<Tokenizer>, Arc<ChatTemplate>, usize)> = HashMap::new();
        for wc in &node.workers {
            let mc = config.model_of(wc);
            let path = mc.path.clone();
            let tok = mc.tokenizer.clone();
            let threads = wc.threads;
            let wid = wc.id.clone();
            let loaded = {
                let mut p = |d: usize, t: usize| progress(&wid, d, t);
                loader::load(&path, tok.as_deref(), threads, &mut p)?
            };
            let (tokenizer, template) = (loaded.tokenizer.clone(), loaded.template.clone());
            let backend = if wc.rank_nodes.is_empty() {
                zerolayer_worker::backend::open(wc, loaded.model)?
            } else {
                crate::cluster::rank::lead::open_group(&config, node_id, wc, loaded.model).await?
            };
            tracing::info!(worker = %wc.id, backend = %backend.describe(), "worker backend");
            let mut engine = Engine::with_backend(backend, loaded.tokenizer, wc)?;
            open_disk_tier(&mut engine, wc, &path, node_id)?;
            let room = engine.max_sequence_tokens();
            let f = fronts.entry(mc.id.clone()).or_insert((tokenizer, template, usize::MAX));
            f.2 = f.2.min(room);
            let handle = WorkerHandle::spawn(engine, &format!("{node_id}-{}", wc.id)).await?;
            workers.push(LocalWorker { id: wc.id.clone(), handle, max_waiting: wc.max_waiting, device: wc.device.clone(), model: mc.id.clone() });
        }
        let mut models = Vec::new();
        for mc in config.all_models() {
            let (tokenizer, template, context_length) = match fronts.remove(&mc.id) {
                Some(f) => f,
                // No local worker runs it: only its text front end, from the file's metadata.
                None => loader::load_frontend(&mc.path).map_err(|e| anyhow::anyhow!("model {:?}: {e}", mc.id))?,
            };
            let created_unix = std::fs::metadata(&mc.path)
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map(|d| d.as_secs() as i64)
                .unwrap_or(0);
            let info = ModelInfo { id: mc.id.clone(), aliases: mc.aliases.clone(), display_name: mc.shown_name().to_string(), created_unix, context_length };
            // The grammar compiler indexes the vocabulary once (about half a second for 150k
            // tokens): built in the background now, not on the first constrained request.
            let t = tokenizer.clone();
            std::thread::Builder::new().name("zl-grammars".into()).spawn(move || {
                if let Err(e) = t.grammars() {
                    tracing::info!(error = %e, "constrained decoding is unavailable for this model");
                }
            })?;
            models.push(Served { info, tokenizer, template, special_tokens_in_content: mc.special_tokens_in_content });
        }
        let guard = crate::auth::Guard::from_config(&config)?;
        if !guard.enabled() {
            tracing::warn!("auth disabled: no API keys configured, so the API is open (development mode)");
        }
        let cluster = Cluster::start(&config, node_id, &workers, quic_socket, guard.quota.clone()).await?;
        let (hard_stop_tx, hard_stop) = watch::channel(false);
        let admission = Admission::new(config.server.max_inflight, config.server.prepare_threads);
        let block_size = node.workers.first().map(|w| w.block_size).unwrap_or(16);
        let dispatch = Arc::new(Dispatcher::new(node_id, cluster.clone(), config.clone(), block_size));
        let ctx = OrchestratorContext { node_id: node_id.to_string(), cluster: cluster.clone(), dispatch: dispatch.clone(), workers: workers.clone() };
        let (orchestrator, _) = ractor::Actor::spawn(None, Orchestrator, ctx).await.map_err(|e| anyhow::anyhow!("starting the node's orchestrator actor: {e}"))?;
        let node_id = node_id.to_string();
        // The secret under which cache scopes are named: the cluster CA's (every node derives
        // the same one); without a cluster, the one kept beside a disk tier (so its blocks keep
        // their names across a restart), or this process's own.
        let cache_secret = match cluster.cache_secret() {
            Some(s) => s,
            None => local_cache_secret(&node.workers)?,
        };
        let policy = crate::frontend::policy::Policy::new(&config.policy).map_err(|e| anyhow::anyhow!(e))?;
        let frontend = Arc::new(Frontend {
            node_id,
            config,
            models,
            workers,
            guard,
            cluster,
            hard_stop,
            admission,
            dispatch,
            orchestrator,
            recent: Default::default(),
            cache_secret,
            responses: Default::default(),
            policy,
            audit: Default::default(),
        });
        // What peers ask of this front end (weak: the cluster link outlives no front end).
        frontend.cluster.serve_peers(Arc::new(FrontendForPeers(Arc::downgrade(&frontend))));
        Ok(Node { frontend, hard_stop_tx })
    }

    /// Serves HTTP on `listener` until `shutdown` resolves. Then: `/ready` turns 503 and new
    /// generations get 529 while in-flight requests finish, for up to the grace period; streams
    /// still open after it end with an SSE `error` event; then the listener closes, the
    /// workers stop, and this returns.
    pub async fn serve(self, listener: TcpListener, shutdown: impl Future<Output = ()> + Send + 'static) -> anyhow::Result<()> {
        let app = crate::frontend::api::router(self.frontend.clone());
        if let Ok(a) = listener.local_addr() {
            // Listening on every interface (a container): peers reach it at the QUIC address's IP.
            let reachable = match self.frontend.cluster.quic_addr() {
                Some(q) if a.ip().is_unspecified() => std::net::SocketAddr::new(q.ip(), a.port()),
                _ => a,
            };
            self.frontend.cluster.set_http_addr(reachable.to_string());
        }
        self.frontend.cluster.set_state(NodeState::Ready);
        let grace = Duration::from_secs(self.frontend.config.server.shutdown_grace_secs);
        let coord = self.frontend.clone();
        let hard = self.hard_stop_tx.clone();
        let signal = async move {
            shutdown.await;
            // In a cluster the drain moves this node's sequences to other workers; the
            // requests this node's clients sent keep streaming from wherever they now run.
            if let Err(e) = coord.drain().await {
                tracing::warn!(error = %e, "could not start the drain");
            }
            tracing::info!(grace_secs = grace.as_secs(), in_flight = coord.busy(), "shutting down: no new work; finishing in-flight requests");
            let deadline = tokio::time::Instant::now() + grace;
            // In-flight requests finish, and the drain's warm-up copies the cache's hottest
            // prefixes to the nodes that stay (within the grace period).
            let warming = |c: &Arc<Frontend>| {
                let c = c.clone();
                async move { c.drain_report().await.is_ok_and(|r| r.draining && !r.warmed) }
            };
            while (coord.busy() > 0 || warming(&coord).await) && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            if coord.busy() > 0 {
                tracing::warn!(in_flight = coord.busy(), "grace period over: ending the remaining streams with an error event");
                let _ = hard.send(true);
            }
        };
        // TCP_NODELAY: a stream's last small SSE chunk must not wait for the client's delayed
        // ACK (Nagle held it up to 40 ms, which every client saw as the stream's end).
        let listener = axum::serve::ListenerExt::tap_io(listener, |tcp: &mut tokio::net::TcpStream| {
            if let Err(e) = tcp.set_nodelay(true) {
                tracing::debug!(error = %e, "could not set TCP_NODELAY on a client connection");
            }
        });
        axum::serve(listener, app).with_graceful_shutdown(signal).await?;
        self.frontend.orchestrator.stop(None);
        self.frontend.cluster.stop().await;
        for w in &self.frontend.workers {
            w.handle.shutdown().await;
        }
        Ok(())
    }
}

/// The front end as peers see it (`cluster::handle::PeerCalls`): stored responses, admin calls
/// checked against this node's key, and forwarded jobs under this node's config.
struct FrontendForPeers(std::sync::Weak<Frontend>);

const STOPPING: &[u8] = br#"{"type":"error","error":{"type":"overloaded_error","message":"this node is stopping"}}"#;

impl crate::cluster::handle::PeerCalls for FrontendForPeers {
    fn lookup(&self, l: &zerolayer_common::wire::Lookup) -> (bool, Vec<u8>) {
        match self.0.upgrade() {
            Some(f) => crate::frontend::api::openai::responses::serve_lookup(&f, l),
            None => (false, Vec::new()),
        }
    }

    fn admin(&self, call: zerolayer_common::wire::AdminCall) -> std::pin::Pin<Box<dyn Future<Output = (u16, Vec<u8>)> + Send>> {
        let f = self.0.upgrade();
        Box::pin(async move {
            match f {
                Some(f) => crate::frontend::api::admin::serve_peer(f, call).await,
                None => (503, STOPPING.to_vec()),
            }
        })
    }

    fn rederive(&self, job: zerolayer_common::Job) -> Result<zerolayer_common::Job, String> {
        let f = self.0.upgrade().ok_or("this node is stopping")?;
        f.guard.rederive(job, &f.cache_secret)
    }

    fn fetch(&self, into: &str, job: &zerolayer_common::Job, from: zerolayer_common::wire::FetchFrom) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send>> {
        let Some(f) = self.0.upgrade() else { return Box::pin(async {}) };
        let (into, job) = (into.to_string(), Box::new(job.clone()));
        Box::pin(async move {
            // The fetch ends within its own timeout; the call's is a backstop.
            let wait = crate::cluster::fetch::FETCH_TIMEOUT.as_millis() as u64 + 1_000;
            let asked = ractor::call_t!(f.orchestrator, |done| crate::routing::orchestrator::OrchestratorMsg::Fetch { into, job, from, done }, wait);
            if let Err(e) = asked {
                tracing::warn!(error = %e, "the orchestrator did not run a prefix fetch; the request recomputes");
            }
        })
    }
}

/// A single node's cache secret: kept in the first disk tier's directory (`cache-secret`, made
/// once, readable by this user only), or drawn afresh when no worker has a disk tier.
fn local_cache_secret(workers: &[zerolayer_common::WorkerConfig]) -> anyhow::Result<[u8; 32]> {
    let Some(dir) = workers.iter().filter(|w| w.kv_disk_mb > 0).find_map(|w| w.kv_disk_dir.as_ref()) else {
        return Ok(rand::random());
    };
    let path = dir.join("cache-secret");
    if let Ok(bytes) = std::fs::read(&path) {
        if let Ok(s) = <[u8; 32]>::try_from(bytes.as_slice()) {
            return Ok(s);
        }
        tracing::warn!(path = %path.display(), "the cache secret file is not 32 bytes; a new one is made (the disk tier's blocks go unused)");
    }
    let secret: [u8; 32] = rand::random();
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join("cache-secret.tmp");
    {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&tmp)?;
        f.write_all(&secret)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, &path)?;
    Ok(secret)
}

/// Gives `engine` the disk tier its worker's config asks for (`kv_disk_mb`), in a file named
/// for the node and worker, identified by the model file at `model`.
fn open_disk_tier(engine: &mut Engine, wc: &zerolayer_common::WorkerConfig, model: &std::path::Path, node_id: &str) -> anyhow::Result<()> {
    let (true, Some(dir)) = (wc.kv_disk_mb > 0, &wc.kv_disk_dir) else { return Ok(()) };
    let kv = engine.backend().kv();
    let identity = zerolayer_worker::kv_disk::model_identity(model, &kv)?;
    engine.set_disk(zerolayer_worker::kv_disk::DiskTier::open(dir, &format!("{node_id}-{}", wc.id), wc.kv_disk_mb, identity, &kv)?);
    Ok(())
}
