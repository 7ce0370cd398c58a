//! `docs/config-reference.md` is generated from the config structs' doc comments and their
//! defaults; this test fails when it is stale. `ZEROLAYER_BLESS=1 cargo test -p
//! zerolayer-common --test config_reference` writes it anew.

use std::path::Path;

use serde_json::Value;
use zerolayer_common::config::{element_shape, known_keys};

/// Each table of the config: its heading, the struct that holds it, and the file defining it.
const TABLES: [(&str, &str, &str); 12] = [
    ("[model] and [[models]]", "ModelSection", "mod.rs"),
    ("[server]", "ServerSection", "mod.rs"),
    ("[auth]", "AuthSection", "access.rs"),
    ("[[auth.keys]]", "KeyConfig", "access.rs"),
    ("[limits]", "LimitsSection", "access.rs"),
    ("[cluster]", "ClusterSection", "mod.rs"),
    ("[placement]", "PlacementConfig", "mod.rs"),
    ("[logging]", "LoggingSection", "logging.rs"),
    ("[policy]", "PolicySection", "policy.rs"),
    ("[[policy.rules]]", "PolicyRule", "policy.rs"),
    ("[[nodes]]", "NodeConfig", "mod.rs"),
    ("[[nodes.workers]]", "WorkerConfig", "worker.rs"),
];

/// The (field, doc comment) pairs of `pub struct name` in `src`, in order.
fn fields(src: &str, name: &str) -> Vec<(String, String)> {
    let start = src.find(&format!("pub struct {name} {{")).unwrap_or_else(|| panic!("struct {name}"));
    let mut out = Vec::new();
    let mut doc = Vec::new();
    for line in src[start..].lines().skip(1) {
        let t = line.trim();
        if t == "}" {
            break;
        }
        if let Some(d) = t.strip_prefix("///") {
            doc.push(d.trim().to_string());
        } else if let Some(rest) = t.strip_prefix("pub ") {
            let field = rest.split(':').next().unwrap().trim().to_string();
            out.push((field, doc.join(" ")));
            doc.clear();
        } else if !t.starts_with("#[") {
            doc.clear();
        }
    }
    out
}

/// The defaults of the table `heading` as JSON.
fn defaults(heading: &str) -> Value {
    let known = known_keys();
    match heading {
        "[model] and [[models]]" => known["model"].clone(),
        "[server]" => known["server"].clone(),
        "[auth]" => known["auth"].clone(),
        "[[auth.keys]]" => element_shape("auth.keys").unwrap(),
        "[limits]" => known["limits"].clone(),
        "[cluster]" => known["cluster"].clone(),
        "[placement]" => known["placement"].clone(),
        "[logging]" => known["logging"].clone(),
        "[policy]" => known["policy"].clone(),
        "[[policy.rules]]" => element_shape("policy.rules").unwrap(),
        "[[nodes]]" => element_shape("nodes").unwrap(),
        _ => element_shape("nodes.workers").unwrap(),
    }
}

fn render() -> String {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/config");
    let mut out = String::from(
        "# Configuration reference\n\n\
         Generated from the config structs' doc comments and defaults by\n\
         `common/tests/config_reference.rs` (which fails when this file is stale). Every key can\n\
         also be set by `ZEROLAYER_<SECTION>__<KEY>` (e.g. `ZEROLAYER_SERVER__MAX_INFLIGHT=64`); a\n\
         key the config does not have stops startup. `zerolayer config` prints the values a node\n\
         would run with and where each came from. The `[model]` defaults are the default model's;\n\
         a `[[models]]` entry starts empty. Guide: [configuration.md](configuration.md).\n",
    );
    for (heading, name, file) in TABLES.iter() {
        let src = std::fs::read_to_string(dir.join(file)).unwrap();
        let d = defaults(heading);
        out.push_str(&format!("\n## {heading}\n\n| key | default | meaning |\n|---|---|---|\n"));
        for (field, doc) in fields(&src, name) {
            assert!(!doc.is_empty(), "{name}.{field} has no doc comment: say what it means");
            let default = match &d[&field] {
                Value::Null => "unset".to_string(),
                Value::Array(a) if a.iter().any(Value::is_object) => format!("see {heading}.{field}"),
                v => format!("`{v}`"),
            };
            let default = if field == "workers" || field == "keys" && *heading == "[auth]" || field == "rules" { "see below".to_string() } else { default };
            out.push_str(&format!("| `{field}` | {default} | {} |\n", doc.replace('|', "\\|")));
        }
    }
    out
}

#[test]
fn the_config_reference_is_current() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/config-reference.md");
    let want = render();
    if std::env::var("ZEROLAYER_BLESS").is_ok_and(|v| v == "1") {
        std::fs::write(&path, &want).unwrap();
    }
    let have = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(have == want, "docs/config-reference.md is stale: run ZEROLAYER_BLESS=1 cargo test -p zerolayer-common --test config_reference");
    // Every key the config knows is in it.
    for (section, v) in known_keys().as_object().unwrap() {
        if let Value::Object(m) = v {
            for k in m.keys() {
                assert!(want.contains(&format!("| `{k}` |")), "{section}.{k} is documented");
            }
        }
    }
}
