//! The config's keys: which ones the code knows (an unknown one, a typo such as `kv_cach_mb`,
//! is an error that names it, where it came from, and the nearest known key), and every leaf
//! of an effective config with its value (`zerolayer config` prints them with their sources).
//!
//! The known keys are the defaults' own tree, serialized, with each array's element shape from
//! its element's default: the structs are the one list of keys, so this cannot go stale.

use serde_json::{Map, Value};

/// The top-level sections: `ZEROLAYER_<SECTION>__…` variables are config, the rest of the
/// `ZEROLAYER_*` names belong to the CLI (`ZEROLAYER_ADDR`) or to tools.
pub const SECTIONS: [&str; 8] = ["model", "models", "server", "auth", "limits", "cluster", "placement", "nodes"];

/// One key that the config does not have: where it is (`nodes[0].workers[1].kv_cach_mb`) and
/// the nearest known key at that level, if one is near.
#[derive(Debug, PartialEq)]
pub struct Unknown {
    pub key: String,
    pub nearest: Option<String>,
}

impl std::fmt::Display for Unknown {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "unknown key `{}`", self.key)?;
        match &self.nearest {
            Some(n) => write!(f, " (did you mean `{n}`?)"),
            None => Ok(()),
        }
    }
}

/// Every key in `given` (a config as parsed from one source) that `known` lacks; `element`
/// gives the shape of one element of the array at a dotted path (without indices).
pub fn unknown_keys(given: &Value, known: &Value, element: &dyn Fn(&str) -> Option<Value>) -> Vec<Unknown> {
    let mut out = Vec::new();
    walk(given, known, "", "", element, &mut out);
    out.sort_by(|a, b| a.key.cmp(&b.key));
    out
}

fn walk(given: &Value, known: &Value, shown: &str, schema_path: &str, element: &dyn Fn(&str) -> Option<Value>, out: &mut Vec<Unknown>) {
    let (Value::Object(g), Value::Object(k)) = (given, known) else { return };
    for (key, v) in g {
        let here = if shown.is_empty() { key.clone() } else { format!("{shown}.{key}") };
        let path = if schema_path.is_empty() { key.clone() } else { format!("{schema_path}.{key}") };
        let Some(kv) = k.get(key) else {
            out.push(Unknown { key: here, nearest: nearest(key, k) });
            continue;
        };
        match v {
            Value::Object(_) => walk(v, kv, &here, &path, element, out),
            Value::Array(items) => {
                if let Some(el) = element(&path) {
                    for (i, item) in items.iter().enumerate() {
                        walk(item, &el, &format!("{here}[{i}]"), &path, element, out);
                    }
                }
            }
            _ => {}
        }
    }
}

/// The known key closest to `key` by edit distance, when it is close enough to be a typo.
fn nearest(key: &str, known: &Map<String, Value>) -> Option<String> {
    let (d, best) = known.keys().map(|k| (edit_distance(key, k), k)).min()?;
    (d <= (key.len() / 3).max(2)).then(|| best.clone())
}

/// Levenshtein distance over chars.
pub fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diag = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let next = (diag + usize::from(ca != cb)).min(row[j] + 1).min(row[j + 1] + 1);
            diag = row[j + 1];
            row[j + 1] = next;
        }
    }
    row[b.len()]
}

/// Every leaf of `v` as (dotted path with indices, value as TOML-ish text), in order.
pub fn leaves(v: &Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    collect(v, "", &mut out);
    out
}

fn collect(v: &Value, here: &str, out: &mut Vec<(String, String)>) {
    let join = |k: &str| if here.is_empty() { k.to_string() } else { format!("{here}.{k}") };
    match v {
        Value::Object(m) => m.iter().for_each(|(k, x)| collect(x, &join(k), out)),
        Value::Array(items) if items.iter().any(|x| x.is_object()) => {
            items.iter().enumerate().for_each(|(i, x)| collect(x, &format!("{here}[{i}]"), out))
        }
        Value::Null => out.push((here.to_string(), "(unset)".into())),
        other => out.push((here.to_string(), other.to_string())),
    }
}

/// Each leaf of the effective config (`effective`) with its value and where that came from:
/// a flag on the command line (`cli`: dotted key prefixes a flag set), the environment
/// (`env`, as parsed from the `ZEROLAYER_*` variables), the file (`file`: its name and its
/// parsed content), else the default.
pub fn sources(effective: &Value, file: Option<(&str, &Value)>, env: &Value, cli: &[(String, String)]) -> Vec<(String, String, String)> {
    let from_file: Vec<String> = file.map(|(_, v)| leaves(v).into_iter().map(|(k, _)| k).collect()).unwrap_or_default();
    let from_env: Vec<String> = leaves(env).into_iter().map(|(k, _)| k).collect();
    let within = |k: &str, p: &str| k == p || k.starts_with(&format!("{p}.")) || k.starts_with(&format!("{p}["));
    leaves(effective)
        .into_iter()
        .map(|(k, v)| {
            let src = if let Some((_, flag)) = cli.iter().find(|(p, _)| within(&k, p)) {
                flag.clone()
            } else if from_env.iter().any(|e| within(&k, e)) {
                format!("env ZEROLAYER_{}", k.replace('.', "__").to_uppercase())
            } else if let Some((name, _)) = file.filter(|_| from_file.iter().any(|f| within(&k, f))) {
                name.to_string()
            } else {
                "default".into()
            };
            (k, v, src)
        })
        .collect()
}

/// Whether a leaf (as [`leaves`] names it) holds a secret that `zerolayer config` must not
/// print: the API keys, the admin key, and each named key's `key` (its name and weight are not
/// secret).
pub fn is_secret(leaf: &str) -> bool {
    let named_key = leaf.strip_prefix("auth.keys[").and_then(|r| r.split_once(']')).is_some_and(|(i, rest)| i.parse::<usize>().is_ok() && rest == ".key");
    leaf == "auth.api_keys" || leaf == "auth.admin_key" || named_key
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn exactly_the_keys_are_secret() {
        for leaf in ["auth.api_keys", "auth.admin_key", "auth.keys[0].key", "auth.keys[12].key"] {
            assert!(is_secret(leaf), "{leaf}");
        }
        for leaf in ["auth.keys[0].name", "auth.keys[0].weight", "auth.keys[0].cache_scope", "auth.keys", "limits.max_tokens", "cluster.tls_dir", "auth.keys[x].key"] {
            assert!(!is_secret(leaf), "{leaf}");
        }
    }

    #[test]
    fn a_typo_is_named_with_the_nearest_key() {
        let known = json!({"server": {"max_inflight": 1}, "nodes": [], "model": {"path": ""}});
        let element = |p: &str| (p == "nodes").then(|| json!({"id": "", "workers": []}));
        let given = json!({"server": {"max_inflight": 4, "max_inflght": 5}, "nodes": [{"id": "a", "wrkers": []}], "modle": {}, "colour": 1});
        let shown: Vec<String> = unknown_keys(&given, &known, &element).iter().map(|u| u.to_string()).collect();
        assert_eq!(
            shown,
            [
                "unknown key `colour`",
                "unknown key `modle` (did you mean `model`?)",
                "unknown key `nodes[0].wrkers` (did you mean `workers`?)",
                "unknown key `server.max_inflght` (did you mean `max_inflight`?)",
            ]
        );
        assert!(unknown_keys(&known, &known, &element).is_empty());
    }

    #[test]
    fn distances_and_leaves() {
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("same", "same"), 0);
        let l = leaves(&json!({"a": {"b": 1, "c": null}, "n": [{"x": "s"}], "list": ["p", "q"]}));
        assert_eq!(l[0], ("a.b".to_string(), "1".to_string()));
        assert_eq!(l[1], ("a.c".to_string(), "(unset)".to_string()));
        assert!(l.contains(&("n[0].x".to_string(), "\"s\"".to_string())), "{l:?}");
        assert!(l.contains(&("list".to_string(), "[\"p\",\"q\"]".to_string())), "{l:?}");
        let eff = json!({"a": {"b": 1, "c": 2, "d": 3, "e": 4}});
        let got = sources(&eff, Some(("c.toml", &json!({"a": {"b": 1, "c": 9}}))), &json!({"a": {"c": 2}}), &[("a.d".into(), "--d".into())]);
        let src: Vec<&str> = got.iter().map(|(_, _, s)| s.as_str()).collect();
        assert_eq!(src, ["c.toml", "env ZEROLAYER_A__C", "--d", "default"]);
    }
}
