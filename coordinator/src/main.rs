//! The `zerolayer` binary.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use zerolayer_common::config::ModelSection;
use zerolayer_common::{ClusterConfig, WorkerConfig};
use zerolayer_coordinator::node::Node;

/// The default cluster config, embedded so the binary runs from anywhere.
const DEFAULT_CONFIG: &str = include_str!("../../cluster.toml");

#[derive(Parser)]
#[command(name = "zerolayer", version, about = "A distributed LLM inference cluster with no proxy tier")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Start this process's node from the cluster config.
    Up {
        /// Cluster config (default: ./cluster.toml, else the embedded default).
        #[arg(long, env = "ZEROLAYER_CONFIG")]
        config: Option<PathBuf>,
        /// Which node of the config this process is (default: the first).
        #[arg(long)]
        node: Option<String>,
        /// HTTP listen address, overriding the config.
        #[arg(long)]
        http: Option<String>,
        /// A model to serve (a GGUF file, or a safetensors directory) in place of the config's
        /// models. Repeat it to serve several files from this node, one worker each. Each is
        /// served under its own name: the GGUF's `general.name` as an id, else the file's stem.
        #[arg(long)]
        model: Vec<PathBuf>,
        /// The name clients send for each --model, in the same order (vLLM's flag).
        #[arg(long = "served-model-name")]
        served_model_name: Vec<String>,
    },
    /// Cluster status: one row per worker across the cluster, as a node sees it.
    Status {
        /// Any node's HTTP address.
        #[arg(long, default_value = "http://127.0.0.1:8080", env = "ZEROLAYER_ADDR")]
        addr: String,
        /// The admin key, if the cluster has one.
        #[arg(long, env = "ZEROLAYER_ADMIN_KEY", hide_env_values = true)]
        admin_key: Option<String>,
        /// Print the raw JSON of `/admin/cluster`.
        #[arg(long)]
        json: bool,
    },
    /// Drain a node: it stops taking new work and its sequences move (with their KV) to
    /// other workers; clients' streams continue. Through any node's admin API.
    Drain {
        /// The node's id (as in the config), or `--self` for the node at --addr.
        node: Option<String>,
        /// Drain the node that --addr points at (a Kubernetes preStop hook).
        #[arg(long = "self")]
        this: bool,
        #[command(flatten)]
        admin: AdminArgs,
        /// Return once the node's workers hold no sequence, and print what moved.
        #[arg(long)]
        wait: bool,
        /// With --wait: give up after this many seconds (exit code 1).
        #[arg(long, default_value_t = 300)]
        timeout: u64,
    },
    /// Let traffic back into a drained node.
    Undrain {
        node: Option<String>,
        #[arg(long = "self")]
        this: bool,
        #[command(flatten)]
        admin: AdminArgs,
    },
    /// Write a GGUF model's tokenizer as a Hugging Face tokenizer directory (tokenizer.json,
    /// tokenizer_config.json with the chat template), for clients that tokenize on their own
    /// (benchmark clients such as aiperf).
    Tokenizer {
        /// The GGUF file.
        #[arg(long)]
        model: PathBuf,
        /// The directory to write.
        #[arg(long)]
        out: PathBuf,
    },
    /// Cluster CA and node certificates.
    Cluster {
        #[command(subcommand)]
        cmd: ClusterCmd,
    },
}

/// Where the admin API is, and its key.
#[derive(clap::Args)]
struct AdminArgs {
    /// Any node's HTTP address.
    #[arg(long, default_value = "http://127.0.0.1:8080", env = "ZEROLAYER_ADDR")]
    addr: String,
    /// The admin key, if the cluster has one.
    #[arg(long, env = "ZEROLAYER_ADMIN_KEY", hide_env_values = true)]
    admin_key: Option<String>,
}

#[derive(Subcommand)]
enum ClusterCmd {
    /// Make a cluster CA (or reuse `DIR/ca.key`) and a certificate per node for mutual TLS.
    Init {
        /// Where to write ca.pem, ca.key, <node>.pem and <node>.key.
        #[arg(long)]
        out: PathBuf,
        /// Node ids, comma-separated (as in cluster.toml).
        #[arg(long, value_delimiter = ',', required = true)]
        nodes: Vec<String>,
        /// Replace the key and certificate of a node that already has one.
        #[arg(long)]
        force: bool,
    },
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .init();
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Up { config, node, http, model, served_model_name } => up(config, node, http, model, served_model_name),
        Cmd::Status { addr, admin_key, json } => status(&addr, admin_key.as_deref(), json),
        Cmd::Tokenizer { model, out } => {
            zerolayer_worker::loader::export_tokenizer(&model, &out)?;
            println!("wrote {}/tokenizer.json and tokenizer_config.json", out.display());
            Ok(())
        }
        Cmd::Cluster { cmd: ClusterCmd::Init { out, nodes, force } } => {
            let files = zerolayer_coordinator::cluster::tls::init(&out, &nodes, force)?;
            for f in files {
                println!("wrote {}", f.display());
            }
            println!("keep {} private: it signs new node certificates", out.join("ca.key").display());
            Ok(())
        }
        Cmd::Drain { node, this, admin, wait, timeout } => drain(&target(node, this)?, &admin, wait, timeout),
        Cmd::Undrain { node, this, admin } => {
            let v = admin_call(&admin, reqwest::Method::POST, &format!("/admin/nodes/{}/undrain", target(node, this)?))?;
            println!("{} is {}", v["node"].as_str().unwrap_or("?"), if v["draining"] == true { "still draining" } else { "taking work" });
            Ok(())
        }
    }
}

fn target(node: Option<String>, this: bool) -> anyhow::Result<String> {
    match (node, this) {
        (Some(n), false) => Ok(n),
        (None, true) => Ok("self".into()),
        _ => anyhow::bail!("name a node, or pass --self"),
    }
}

/// One admin API call; the JSON answer, or the error the node gave.
fn admin_call(admin: &AdminArgs, method: reqwest::Method, path: &str) -> anyhow::Result<serde_json::Value> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        let url = format!("{}{path}", admin.addr.trim_end_matches('/'));
        let mut req = reqwest::Client::new().request(method, &url).timeout(std::time::Duration::from_secs(30));
        if let Some(k) = &admin.admin_key {
            req = req.header("x-api-key", k);
        }
        let resp = req.send().await.map_err(|e| anyhow::anyhow!("{url}: {e}"))?;
        let code = resp.status();
        let body = resp.text().await?;
        if !code.is_success() {
            anyhow::bail!("{url} answered {code}: {body}");
        }
        anyhow::Ok(serde_json::from_str(&body)?)
    })
}

fn drain(node: &str, admin: &AdminArgs, wait: bool, timeout: u64) -> anyhow::Result<()> {
    let v = admin_call(admin, reqwest::Method::POST, &format!("/admin/nodes/{node}/drain"))?;
    let name = v["node"].as_str().unwrap_or(node).to_string();
    println!("draining {name}: {} sequences on its workers", v["sequences"]);
    if !wait {
        return Ok(());
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(timeout);
    let v = loop {
        let v = admin_call(admin, reqwest::Method::GET, &format!("/admin/nodes/{name}/drain"))?;
        if v["sequences"] == 0 {
            break v;
        }
        if std::time::Instant::now() > deadline {
            eprintln!("{name} still holds {} sequences after {timeout} s", v["sequences"]);
            std::process::exit(1);
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    println!(
        "{name} drained: {} sequences moved with their KV ({} blocks, {} bytes), {} without",
        v["moved_with_kv"], v["kv_blocks_moved"], v["kv_bytes_sent"], v["moved_without_kv"]
    );
    Ok(())
}

fn status(addr: &str, admin_key: Option<&str>, json: bool) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let v: serde_json::Value = rt.block_on(async {
        let mut req = reqwest::Client::new().get(format!("{}/admin/cluster", addr.trim_end_matches('/'))).timeout(std::time::Duration::from_secs(10));
        if let Some(k) = admin_key {
            req = req.header("x-api-key", k);
        }
        let resp = req.send().await.map_err(|e| anyhow::anyhow!("{addr}: {e}"))?;
        let code = resp.status();
        let body = resp.text().await?;
        if !code.is_success() {
            anyhow::bail!("{addr}/admin/cluster answered {code}: {body}");
        }
        anyhow::Ok(serde_json::from_str(&body)?)
    })?;
    if json {
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    print!("{}", zerolayer_coordinator::status::render(&v));
    Ok(())
}

/// `--model` (repeated) and `--served-model-name`: the models the config names give way to
/// these files, each under its own name, and node `node_id` runs one worker per model (copies
/// of its first worker). Other nodes' workers run the first.
fn serve_models(cfg: &mut ClusterConfig, node_id: &str, paths: Vec<PathBuf>, names: Vec<String>) -> anyhow::Result<()> {
    if names.len() > paths.len() {
        anyhow::bail!("{} --served-model-name for {} --model", names.len(), paths.len());
    }
    let mut sections = Vec::new();
    for (i, path) in paths.into_iter().enumerate() {
        let id = match names.get(i) {
            Some(n) => n.clone(),
            None => zerolayer_worker::loader::served_name(&path).map_err(|e| anyhow::anyhow!(e))?,
        };
        sections.push(ModelSection { path, id, ..ModelSection::default() });
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

fn up(config: Option<PathBuf>, node: Option<String>, http: Option<String>, model: Vec<PathBuf>, served_model_name: Vec<String>) -> anyhow::Result<()> {
    let mut cfg = match config {
        Some(p) => ClusterConfig::load(Some(&p))?,
        None if std::path::Path::new("cluster.toml").exists() => ClusterConfig::load(Some(std::path::Path::new("cluster.toml")))?,
        None => {
            let dir = std::env::temp_dir().join(format!("zerolayer-default-{}", std::process::id()));
            std::fs::create_dir_all(&dir)?;
            let p = dir.join("cluster.toml");
            std::fs::write(&p, DEFAULT_CONFIG)?;
            let mut c = ClusterConfig::load(Some(&p))?;
            // Relative paths in the embedded default are relative to the working directory
            // (a path from the environment is as given).
            let default_path = ClusterConfig::default().model.path;
            if c.model.path == dir.join(&default_path) {
                c.model.path = default_path;
            }
            c
        }
    };
    let node_id = node.unwrap_or_else(|| cfg.nodes[0].id.clone());
    if !model.is_empty() {
        serve_models(&mut cfg, &node_id, model, served_model_name)?;
    } else if !served_model_name.is_empty() {
        anyhow::bail!("--served-model-name names a --model; with the config's models, set their `id`");
    }
    let idx = cfg.nodes.iter().position(|n| n.id == node_id).ok_or_else(|| anyhow::anyhow!("node {node_id:?} is not in the config"))?;
    if let Some(h) = http {
        cfg.nodes[idx].http = h;
    }
    cfg.validate()?;
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
