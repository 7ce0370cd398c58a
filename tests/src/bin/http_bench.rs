//! `http_bench`: the HTTP benchmark sweep against a live server (see `zerolayer_tests::bench`).
//!
//! ```text
//! http_bench --url http://127.0.0.1:8080 [--concurrency 1,4,16,32] [--prompts short,long]
//!            [--output-tokens 128] [--requests N] [--time-limit-s 120] [--json F] [--md F]
//!            [--model NAME] [--api chat|completions]
//! ```
//! `--requests` is per level (default: 2 × concurrency, at least 4). `--model` defaults to the
//! first model `/v1/models` lists; `--api completions` sends raw prompts (a base model).

use std::time::Duration;

use zerolayer_tests::bench::{markdown, run_level, Api, Level};

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let url = arg(&args, "--url").ok_or_else(|| anyhow::anyhow!("--url is required"))?;
    let host = url.trim_start_matches("http://").split(['/', ':']).next().unwrap_or_default().to_string();
    anyhow::ensure!(host == "127.0.0.1" || host == "localhost" || host == "[::1]", "http_bench targets loopback only, not {host}");
    let conc: Vec<usize> = arg(&args, "--concurrency").unwrap_or_else(|| "1,4,16,32".into()).split(',').map(|c| c.parse()).collect::<Result<_, _>>()?;
    let prompts: Vec<String> = arg(&args, "--prompts").unwrap_or_else(|| "short,long".into()).split(',').map(String::from).collect();
    let output_tokens: u32 = arg(&args, "--output-tokens").map(|v| v.parse()).transpose()?.unwrap_or(128);
    let requests: Option<usize> = arg(&args, "--requests").map(|v| v.parse()).transpose()?;
    let limit = Duration::from_secs(arg(&args, "--time-limit-s").map(|v| v.parse()).transpose()?.unwrap_or(120));
    let api = match arg(&args, "--api").as_deref() {
        None | Some("chat") => Api::Chat,
        Some("completions") => Api::Completions,
        Some(other) => anyhow::bail!("--api: chat or completions, not {other}"),
    };
    let model = match arg(&args, "--model") {
        Some(m) => m,
        None => {
            let models: serde_json::Value = reqwest::get(format!("{url}/v1/models")).await?.json().await?;
            models["data"][0]["id"].as_str().ok_or_else(|| anyhow::anyhow!("{url}/v1/models lists no model"))?.to_string()
        }
    };
    let mut results = vec![];
    for p in &prompts {
        anyhow::ensure!(p == "short" || p == "long", "--prompts: short or long, not {p}");
        for &c in &conc {
            let level = Level { model: model.clone(), api, prompt: p.clone(), concurrency: c, requests: requests.unwrap_or((2 * c).max(4)), output_tokens, time_limit: limit };
            let r = run_level(&url, &level).await;
            eprintln!("{}", serde_json::to_string(&r)?);
            results.push(r);
        }
    }
    let md = markdown(&results);
    print!("{md}");
    if let Some(f) = arg(&args, "--json") {
        std::fs::write(f, serde_json::to_string_pretty(&results)?)?;
    }
    if let Some(f) = arg(&args, "--md") {
        std::fs::write(f, md)?;
    }
    Ok(())
}
