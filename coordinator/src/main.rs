//! The `zerolayer` binary: its commands and their flags; each command's work is in `cli`.

mod cli;

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};
use cli::admin::{self, AdminArgs};
use cli::up::UpArgs;

#[derive(Parser)]
#[command(name = "zerolayer", version, about = "A distributed LLM inference cluster with no proxy tier")]
struct Cli {
    /// Log lines as text, or as JSON objects (one per line, with each request's `request_id`
    /// and `node`). The level comes from `RUST_LOG` (default: info).
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text, env = "ZEROLAYER_LOG_FORMAT")]
    log_format: LogFormat,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Cmd {
    /// Start this process's node from the cluster config.
    Up(UpArgs),
    /// Print the config `up` would run with (same flags), each value with its source: a flag,
    /// an environment variable, the file, or the default. Keys are hidden.
    Config(UpArgs),
    /// Cluster status: one row per worker across the cluster, as a node sees it.
    Status {
        #[command(flatten)]
        admin: AdminArgs,
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
        /// How long node certificates are valid, in days (a new CA: ten times as long).
        #[arg(long, default_value_t = 365)]
        days: u32,
    },
}

fn init_logs(format: LogFormat) {
    zerolayer_coordinator::logs::init(matches!(format, LogFormat::Json));
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    init_logs(cli.log_format);
    match cli.cmd {
        Cmd::Up(args) => cli::up::up(&args),
        Cmd::Config(args) => args.explain(),
        Cmd::Status { admin, json } => admin::status(&admin, json),
        Cmd::Tokenizer { model, out } => {
            zerolayer_worker::loader::export_tokenizer(&model, &out)?;
            println!("wrote {}/tokenizer.json and tokenizer_config.json", out.display());
            Ok(())
        }
        Cmd::Cluster { cmd: ClusterCmd::Init { out, nodes, force, days } } => {
            let files = zerolayer_coordinator::cluster::tls::init_valid_for(&out, &nodes, force, days)?;
            for f in files {
                println!("wrote {}", f.display());
            }
            println!("keep {} private: it signs new node certificates", out.join("ca.key").display());
            Ok(())
        }
        Cmd::Drain { node, this, admin, wait, timeout } => admin::drain(&admin::target(node, this)?, &admin, wait, timeout),
        Cmd::Undrain { node, this, admin } => admin::undrain(&admin::target(node, this)?, &admin),
    }
}
