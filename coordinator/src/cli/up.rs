//! `zerolayer up` and `zerolayer config`: the cluster config, as the flags change it, and the
//! node that runs it.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use indicatif::{ProgressBar, ProgressStyle};
use zerolayer_common::config::ModelSection;
use zerolayer_common::{ClusterConfig, WorkerConfig};
use zerolayer_coordinator::node::Node;

/// The default cluster config, embedded so the binary runs from anywhere.
const DEFAULT_CONFIG: &str = include_str!("../../../cluster.toml");

/// What `up` runs: a config, and the flags that change it (the conventions of vLLM and
/// llama-server: `--host`, `--port`, `--model`, `--served-model-name`, `--api-key`).
#[derive(clap::Args)]
pub struct UpArgs {
    /// Cluster config (default: ./cluster.toml, else the embedded default).
    #[arg(long, env = "ZEROLAYER_CONFIG")]
    pub config: Option<PathBuf>,
    /// Which node of the config this process is (default: the first).
    #[arg(long)]
    pub node: Option<String>,
    /// HTTP listen address (host:port), overriding the config.
    #[arg(long, conflicts_with_all = ["host", "port"])]
    pub http: Option<String>,
    /// HTTP listen host, keeping the config's port unless --port is given.
    #[arg(long)]
    pub host: Option<String>,
    /// HTTP listen port (0 picks a free one), keeping the config's host unless --host is given.
    #[arg(long)]
    pub port: Option<u16>,
    /// A model to serve (a GGUF file, or a safetensors directory) in place of the config's
    /// models. Repeat it to serve several files from this node, one worker each. Each is
    /// served under its own name: the GGUF's `general.name` as an id, else the file's stem.
    #[arg(long)]
    pub model: Vec<PathBuf>,
    /// The name clients send for each --model, in the same order (vLLM's flag).
    #[arg(long = "served-model-name")]
    pub served_model_name: Vec<String>,
    /// An API key clients must send (`x-api-key` or `Authorization: Bearer`); repeatable. Adds
    /// to the config's `auth.api_keys`. At least 8 characters.
    #[arg(long = "api-key")]
    pub api_key: Vec<String>,
    /// CPU threads of each of this node's workers (the config's `threads`; 0: every core).
    #[arg(long)]
    pub threads: Option<usize>,
    /// KV cache size of each of this node's workers, in MiB (the config's `kv_cache_mb`).
    #[arg(long = "kv-cache-mb")]
    pub kv_cache_mb: Option<usize>,
}

impl UpArgs {
    /// The config file named, or ./cluster.toml when present; `None`: the embedded default.
    fn config_path(&self) -> Option<PathBuf> {
        self.config.clone().or_else(|| Path::new("cluster.toml").exists().then(|| PathBuf::from("cluster.toml")))
    }

    /// The effective config, this node's id, and the keys the flags set (with the flag that
    /// set each, for `zerolayer config`).
    pub fn resolve(&self) -> anyhow::Result<(ClusterConfig, String, Vec<(String, String)>)> {
        let mut cfg = match self.config_path() {
            Some(p) => ClusterConfig::load(Some(&p))?,
            None => load_default()?,
        };
        let node_id = self.node.clone().unwrap_or_else(|| cfg.nodes[0].id.clone());
        let idx = cfg.nodes.iter().position(|n| n.id == node_id).ok_or_else(|| anyhow::anyhow!("node {node_id:?} is not in the config"))?;
        let mut set = Vec::new();
        if !self.model.is_empty() {
            serve_models(&mut cfg, &node_id, &self.model, &self.served_model_name)?;
            set.push(("model".into(), "--model".into()));
            set.push(("models".into(), "--model".into()));
        } else if !self.served_model_name.is_empty() {
            anyhow::bail!("--served-model-name names a --model; with the config's models, set their `id`");
        }
        let node = &mut cfg.nodes[idx];
        let at = format!("nodes[{idx}]");
        if let Some(h) = &self.http {
            node.http = h.clone();
            set.push((format!("{at}.http"), "--http".into()));
        }
        if self.host.is_some() || self.port.is_some() {
            let (host, port) = split_host_port(&node.http)?;
            let host = self.host.clone().unwrap_or(host);
            let port = self.port.map(|p| p.to_string()).unwrap_or(port);
            node.http = if host.contains(':') && !host.starts_with('[') { format!("[{host}]:{port}") } else { format!("{host}:{port}") };
            set.push((format!("{at}.http"), if self.host.is_some() { "--host" } else { "--port" }.into()));
        }
        for (i, w) in node.workers.iter_mut().enumerate() {
            if let Some(t) = self.threads {
                w.threads = t;
                set.push((format!("{at}.workers[{i}].threads"), "--threads".into()));
            }
            if let Some(mb) = self.kv_cache_mb {
                w.kv_cache_mb = mb;
                set.push((format!("{at}.workers[{i}].kv_cache_mb"), "--kv-cache-mb".into()));
            }
        }
        if let Some(short) = self.api_key.iter().find(|k| k.len() < 8) {
            anyhow::bail!("--api-key {:?}…: a key needs at least 8 characters", &short[..short.len().min(2)]);
        }
        if !self.api_key.is_empty() {
            cfg.auth.api_keys.extend(self.api_key.iter().cloned());
            set.push(("auth.api_keys".into(), "--api-key".into()));
        }
        // One variable for the admin key in both the node and the CLI's drain (a Kubernetes
        // Secret sets it once): the CLI's name works for the server too.
        if cfg.auth.admin_key.is_none() {
            if let Ok(k) = std::env::var("ZEROLAYER_ADMIN_KEY") {
                cfg.auth.admin_key = Some(k);
                set.push(("auth.admin_key".into(), "env ZEROLAYER_ADMIN_KEY".into()));
            }
        }
        cfg.validate()?;
        Ok((cfg, node_id, set))
    }

    /// `zerolayer config`: every value `up` would run with, and where it came from.
    pub fn explain(&self) -> anyhow::Result<()> {
        let (cfg, node_id, set) = self.resolve()?;
        let path = self.config_path();
        println!("# node {node_id}; config {}", path.as_ref().map(|p| p.display().to_string()).unwrap_or_else(|| "(embedded default)".into()));
        for (key, value, source) in cfg.explain(path.as_deref(), &set)? {
            let value = if zerolayer_common::config::keys::is_secret(&key) { redact(&value) } else { value };
            println!("{key} = {value}    # {source}");
        }
        Ok(())
    }
}

/// Secrets are shown as set or not, never printed.
fn redact(v: &str) -> String {
    if v == "(unset)" || v == "[]" { v.to_string() } else { "(set, hidden)".to_string() }
}

/// "host:port" (or "[v6]:port") into its two halves.
fn split_host_port(addr: &str) -> anyhow::Result<(String, String)> {
    let (h, p) = addr.rsplit_once(':').ok_or_else(|| anyhow::anyhow!("http address {addr:?} has no port"))?;
    Ok((h.trim_start_matches('[').trim_end_matches(']').to_string(), p.to_string()))
}

/// The embedded default config, its model path relative to the working directory.
fn load_default() -> anyhow::Result<ClusterConfig> {
    let dir = std::env::temp_dir().join(format!("zerolayer-default-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let p = dir.join("cluster.toml");
    std::fs::write(&p, DEFAULT_CONFIG)?;
    let mut c = ClusterConfig::load(Some(&p))?;
    let default_path = ClusterConfig::default().model.path;
    if c.model.path == dir.join(&default_path) {
        c.model.path = default_path;
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(c)
}

/// `--model` (repeated) and `--served-model-name`: the models the config names give way to
/// these files, each under its own name, and node `node_id` runs one worker per model (copies
/// of its first worker). Other nodes' workers run the first.
fn serve_models(cfg: &mut ClusterConfig, node_id: &str, paths: &[PathBuf], names: &[String]) -> anyhow::Result<()> {
    if names.len() > paths.len() {
        anyhow::bail!("{} --served-model-name for {} --model", names.len(), paths.len());
    }
    let mut sections = Vec::new();
    for (i, path) in paths.iter().enumerate() {
        let id = match names.get(i) {
            Some(n) => n.clone(),
            None => zerolayer_worker::loader::served_name(path).map_err(|e| anyhow::anyhow!(e))?,
        };
        sections.push(ModelSection { path: path.clone(), id, ..ModelSection::default() });
    }
    let ids: Vec<String> = sections.iter().map(|m| m.id.clone()).collect();
    cfg.model = sections.remove(0);
    cfg.models = sections;
    for n in &mut cfg.nodes {
        let template = n.workers[0].clone();
        if n.id == node_id {
            n.workers = ids
                .iter()
                .enumerate()
                .map(|(i, id)| WorkerConfig {
                    id: if i == 0 { template.id.clone() } else { format!("{}-{}", template.id, i) },
                    model: (i > 0).then(|| id.clone()),
                    ..template.clone()
                })
                .collect();
        } else {
            n.workers.iter_mut().for_each(|w| w.model = None);
        }
    }
    Ok(())
}

pub fn up(args: &UpArgs) -> anyhow::Result<()> {
    let (cfg, node_id, _) = args.resolve()?;
    let idx = cfg.nodes.iter().position(|n| n.id == node_id).expect("resolved");
    let addr: SocketAddr = cfg.nodes[idx].http.parse().map_err(|e| anyhow::anyhow!("http address {:?}: {e}", cfg.nodes[idx].http))?;
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async move {
        let bar = ProgressBar::new(0);
        bar.set_style(ProgressStyle::with_template("loading {msg} [{bar:30}] {pos}/{len} layers").unwrap().progress_chars("=> "));
        let model_path = cfg.model.path.display().to_string();
        let node = Node::start(cfg, &node_id, |w, d, t| {
            bar.set_length(t as u64);
            bar.set_message(format!("{model_path} on {w}"));
            bar.set_position(d as u64);
        })
        .await?;
        bar.finish_and_clear();
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let local = listener.local_addr()?;
        let c = node.frontend.clone();
        let quic = c.cluster.quic_addr().map(|a| format!(", quic {a}")).unwrap_or_default();
        tracing::info!(
            "zerolayer ready: node {} serving {} on http://{}{} ({} worker{})",
            c.node_id,
            c.models.iter().map(|m| m.info.id.as_str()).collect::<Vec<_>>().join(", "),
            local,
            quic,
            c.workers.len(),
            if c.workers.len() == 1 { "" } else { "s" }
        );
        node.serve(listener, shutdown_signal()).await
    })?;
    tracing::info!("zerolayer stopped");
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
