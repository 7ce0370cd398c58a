//! The admin commands (`status`, `drain`, `undrain`): calls to any node's admin API.

/// Where the admin API is, and its key.
#[derive(clap::Args)]
pub struct AdminArgs {
    /// Any node's HTTP address.
    #[arg(long, default_value = "http://127.0.0.1:8080", env = "ZEROLAYER_ADDR")]
    pub addr: String,
    /// The admin key, if the cluster has one. Also read from `ZEROLAYER_AUTH__ADMIN_KEY`, the
    /// server's own variable, so one Secret serves the node and its preStop drain.
    #[arg(long, env = "ZEROLAYER_ADMIN_KEY", hide_env_values = true)]
    pub admin_key: Option<String>,
}

impl AdminArgs {
    fn key(&self) -> Option<String> {
        self.admin_key.clone().or_else(|| std::env::var("ZEROLAYER_AUTH__ADMIN_KEY").ok())
    }
}

/// `NODE` or `--self` (the node at --addr).
pub fn target(node: Option<String>, this: bool) -> anyhow::Result<String> {
    match (node, this) {
        (Some(n), false) => Ok(n),
        (None, true) => Ok("self".into()),
        _ => anyhow::bail!("name a node, or pass --self"),
    }
}

/// One admin API call; the JSON answer, or the error the node gave.
pub fn call(admin: &AdminArgs, method: reqwest::Method, path: &str) -> anyhow::Result<serde_json::Value> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        let url = format!("{}{path}", admin.addr.trim_end_matches('/'));
        let mut req = reqwest::Client::new().request(method, &url).timeout(std::time::Duration::from_secs(30));
        if let Some(k) = admin.key() {
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

pub fn drain(node: &str, admin: &AdminArgs, wait: bool, timeout: u64) -> anyhow::Result<()> {
    let v = call(admin, reqwest::Method::POST, &format!("/admin/nodes/{node}/drain"))?;
    let name = v["node"].as_str().unwrap_or(node).to_string();
    println!("draining {name}: {} sequences on its workers", v["sequences"]);
    if !wait {
        return Ok(());
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(timeout);
    let v = loop {
        let v = call(admin, reqwest::Method::GET, &format!("/admin/nodes/{name}/drain"))?;
        // Empty, and its warm-up over (a node of an earlier version reports none).
        if v["sequences"] == 0 && v.get("warmed").is_none_or(|w| w == true) {
            break v;
        }
        if std::time::Instant::now() > deadline {
            eprintln!("{name} still holds {} sequences (warm-up over: {}) after {timeout} s", v["sequences"], v["warmed"]);
            std::process::exit(1);
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    println!(
        "{name} drained: {} sequences moved with their KV ({} blocks, {} bytes), {} without; {} cached prefix chains copied ahead ({} blocks, {} ms)",
        v["moved_with_kv"],
        v["kv_blocks_moved"],
        v["kv_bytes_sent"].as_u64().unwrap_or(0).saturating_sub(v["warm_bytes"].as_u64().unwrap_or(0)),
        v["moved_without_kv"],
        v["warmed_chains"],
        v["warmed_blocks"],
        v["warm_ms"]
    );
    Ok(())
}

pub fn undrain(node: &str, admin: &AdminArgs) -> anyhow::Result<()> {
    let v = call(admin, reqwest::Method::POST, &format!("/admin/nodes/{node}/undrain"))?;
    println!("{} is {}", v["node"].as_str().unwrap_or("?"), if v["draining"] == true { "still draining" } else { "taking work" });
    Ok(())
}

pub fn status(admin: &AdminArgs, json: bool) -> anyhow::Result<()> {
    let v = call(admin, reqwest::Method::GET, "/admin/cluster")?;
    if json {
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!("{}", zerolayer_coordinator::status::render(&v));
    }
    Ok(())
}
