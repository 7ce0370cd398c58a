//! The config's loading, defaults, naming and validation, on small TOML strings.
use super::*;

#[test]
fn model_names_become_ids() {
    assert_eq!(model_slug("Gemma 3 270m"), "gemma-3-270m");
    assert_eq!(model_slug("Qwen2.5 Coder 0.5B Instruct AWQ"), "qwen2.5-coder-0.5b-instruct-awq");
    assert_eq!(model_slug("  Llama-3.2-1B-Instruct.Q4_K_M "), "llama-3.2-1b-instruct.q4_k_m");
    assert_eq!(model_slug("Mistral 7B (v0.3) / Instruct!"), "mistral-7b-v0.3-instruct");
    assert_eq!(model_slug("日本語"), "");
    assert_eq!(model_slug(&"a".repeat(100)).len(), 64);
    assert_eq!(model_slug(&format!("{} b", "a".repeat(63))), "a".repeat(63));
}

#[test]
fn several_models_each_worker_names_one() {
    let c = ClusterConfig::from_toml(
        r#"
        [[models]]
        path = "models/qwen.gguf"
        id = "qwen"
        aliases = ["Qwen2.5-Coder"]
        [[nodes]]
        id = "a"
        [[nodes.workers]]
        id = "cpu0"
        [[nodes.workers]]
        id = "cpu1"
        model = "qwen"
        "#,
    )
    .unwrap();
    let ids: Vec<&str> = c.all_models().map(|m| m.id.as_str()).collect();
    assert_eq!(ids, ["smollm2-135m-instruct", "qwen"]);
    assert_eq!(c.model_of(&c.nodes[0].workers[0]).id, "smollm2-135m-instruct");
    assert_eq!(c.model_of(&c.nodes[0].workers[1]).id, "qwen");
    let base = "[[models]]\npath='q.gguf'\nid='qwen'\n[[nodes]]\nid='a'\n[[nodes.workers]]\nid='cpu0'\n";
    // An entry inherits nothing from the default model: no aliases, its id as its name.
    let plain = ClusterConfig::from_toml(base).unwrap();
    assert_eq!((plain.models[0].aliases.len(), plain.models[0].shown_name()), (0, "qwen"));
    assert_eq!(plain.model.aliases, ["SmolLM2-135M-Instruct"]);
    // A [model] naming another model keeps none of the default's names.
    let other = ClusterConfig::from_toml("[model]\npath='q.gguf'\nid='qwen'\n").unwrap();
    assert_eq!((other.model.aliases.len(), other.model.shown_name()), (0, "qwen"));
    assert!(ClusterConfig::from_toml(&format!("{base}model='llama'\n")).is_err(), "a worker names a model that is not configured");
    assert!(ClusterConfig::from_toml(&base.replace("id='qwen'", "id='smollm2-135m-instruct'")).is_err(), "two models share an id");
    assert!(ClusterConfig::from_toml(&base.replace("id='qwen'", "id='SmolLM2-135M-Instruct'")).is_err(), "an id is another's alias");
    assert!(ClusterConfig::from_toml(&base.replace("id='qwen'", "id='q w'")).is_err(), "a model id with a space");
    // A model without an id is named by its file at startup; until then nothing refers to it.
    let mut unnamed = ClusterConfig::from_toml(&base.replace("id='qwen'\n", "")).unwrap();
    assert_eq!(unnamed.models[0].id, "");
    unnamed.name_models(|p| Ok(model_slug(&p.file_stem().unwrap().to_string_lossy()))).unwrap();
    assert_eq!(unnamed.models[0].id, "q");
    let mut twins = ClusterConfig::from_toml(&base.replace("id='qwen'\n", "")).unwrap();
    let err = twins.name_models(|_| Ok("smollm2-135m-instruct".into())).unwrap_err().to_string();
    assert!(err.contains("used twice"), "two files of one name: {err}");
    // A [model] on another file forgets the default's id too: the file names it.
    let moved = ClusterConfig::from_toml("[model]\npath='other.gguf'\n").unwrap();
    assert_eq!((moved.model.id.as_str(), moved.model.aliases.len()), ("", 0));
    assert!(ClusterConfig::from_toml(&format!("{base}tensor_parallel=0\n")).unwrap_err().to_string().contains("tensor_parallel"));
    assert_eq!(ClusterConfig::from_toml(&format!("{base}tensor_parallel=2\n")).unwrap().nodes[0].workers[0].tensor_parallel, 2);
    // A GPU is named `cuda:N`; anything else is refused, saying what is accepted. (Whether the
    // build and the machine can drive it is the node's to check at startup.)
    assert_eq!(ClusterConfig::from_toml(&format!("{base}device='cuda:1'\n")).unwrap().nodes[0].workers[0].gpu(), Ok(Some(1)));
    let bad_dev = ClusterConfig::from_toml(&format!("{base}device='gpu0'\n")).unwrap_err().to_string();
    assert!(bad_dev.contains("unknown device") && bad_dev.contains("cuda:N"), "{bad_dev}");
    assert_eq!(ClusterConfig::from_toml(&format!("{base}device='cuda:2'\ntensor_parallel=2\n")).unwrap().nodes[0].workers[0].tensor_parallel, 2);
    assert!(ClusterConfig::from_toml(&format!("{base}kv_cache_mb=0\n")).is_err(), "a CPU cache needs a size");
    // A group across nodes: one node per rank, this one first, the others configured nodes.
    let two = "[cluster]\ntls_dir='t'\n[[nodes]]\nid='a'\nquic='127.0.0.1:1'\n[[nodes.workers]]\nid='w'\ntensor_parallel=2\nRANKS\n[[nodes]]\nid='b'\nquic='127.0.0.1:2'\n[[nodes.workers]]\nid='w'\n";
    let ok = ClusterConfig::from_toml(&two.replace("RANKS", "rank_nodes=['a','b']")).unwrap();
    assert_eq!(ok.nodes[0].workers[0].rank_nodes, ["a", "b"]);
    assert!(ok.nodes[1].workers[0].rank_nodes.is_empty(), "by default every rank is local");
    assert!(ClusterConfig::from_toml(&two.replace("RANKS", "rank_nodes=['a','b']\ndevice='cuda:0'")).is_ok(), "GPU ranks across nodes");
    for (ranks, why) in [
        ("rank_nodes=['a']", "one node per rank"),
        ("rank_nodes=['b','a']", "rank 0 is this node"),
        ("rank_nodes=['a','a']", "a remote rank on this node"),
        ("rank_nodes=['a','c']", "no such node"),
        ("rank_nodes=['a','b']\ndevice='cuda:0'\nkv_cache_mb=0", "a GPU group across nodes sizes its cache alike on every node"),
    ] {
        let e = ClusterConfig::from_toml(&two.replace("RANKS", ranks)).unwrap_err().to_string();
        assert!(e.contains("rank_nodes"), "{why}: {e}");
    }
    assert!(ClusterConfig::from_toml(&format!("{base}device='cuda:0'\nkv_cache_mb=0\n")).is_ok(), "a GPU cache may take a share of free memory");
}

#[test]
fn kv_dtype_is_f32_unless_set_and_the_same_for_every_worker() {
    let one = "[[nodes]]\nid='a'\n[[nodes.workers]]\nid='cpu0'\nKV\n";
    assert_eq!(ClusterConfig::from_toml(&one.replace("KV", "")).unwrap().nodes[0].workers[0].kv_dtype, KvDtype::F32);
    let half = ClusterConfig::from_toml(&one.replace("KV", "kv_dtype='f16'")).unwrap();
    assert_eq!((half.nodes[0].workers[0].kv_dtype, half.nodes[0].workers[0].kv_dtype.bytes()), (KvDtype::F16, 2));
    let e = ClusterConfig::from_toml(&one.replace("KV", "kv_dtype='bf16'")).unwrap_err().to_string();
    assert!(e.contains("bf16") && e.contains("f16") && e.contains("f32"), "an unknown element names the known ones: {e}");
    let e = ClusterConfig::from_toml(&one.replace("KV", "kv_dtype='f16'\ndevice='cuda:0'")).unwrap_err().to_string();
    assert!(e.contains("kv_dtype f16 runs on the CPU only"), "{e}");
    let mixed = "[[nodes]]\nid='a'\n[[nodes.workers]]\nid='cpu0'\nkv_dtype='f16'\n[[nodes.workers]]\nid='cpu1'\n";
    let e = ClusterConfig::from_toml(mixed).unwrap_err().to_string();
    assert!(e.contains("same kv_dtype"), "{e}");
}

#[test]
fn toml_overrides_defaults() {
    let c = ClusterConfig::from_toml(
        r#"
        [model]
        id = "m"
        [[nodes]]
        id = "a"
        http = "127.0.0.1:0"
        [[nodes.workers]]
        id = "cpu0"
        kv_cache_mb = 64
        "#,
    )
    .unwrap();
    assert_eq!(c.model.id, "m");
    assert_eq!(c.nodes[0].workers[0].kv_cache_mb, 64);
    assert_eq!(c.nodes[0].workers[0].block_size, 4);
    assert!(ClusterConfig::from_toml("[[nodes]]\nid='a'\n[[nodes]]\nid='a'\n").is_err());
    assert_eq!(c.placement.policy, PlacementPolicy::CacheAware);
    // Several nodes need QUIC addresses and TLS material.
    assert!(ClusterConfig::from_toml("[[nodes]]\nid='a'\n[[nodes]]\nid='b'\n").is_err());
    let three = ClusterConfig::from_toml(
        r#"
        [cluster]
        tls_dir = "certs"
        [placement]
        policy = "round_robin"
        [[nodes]]
        id = "a"
        quic = "127.0.0.1:7001"
        [[nodes]]
        id = "b"
        quic = "127.0.0.1:7002"
        "#,
    )
    .unwrap();
    assert_eq!(three.placement.policy, PlacementPolicy::RoundRobin);
    assert!(ClusterConfig::from_toml("[[nodes]]\nid='a'\nquic='127.0.0.1:1'\n").is_err(), "no tls_dir");
}

#[test]
fn an_unknown_key_fails_with_its_name_and_a_suggestion() {
    let e = ClusterConfig::from_toml("[[nodes]]\nid='a'\n[[nodes.workers]]\nid='cpu0'\nkv_cach_mb=64\n").unwrap_err().to_string();
    assert!(e.contains("`nodes[0].workers[0].kv_cach_mb`") && e.contains("did you mean `kv_cache_mb`"), "{e}");
    let e = ClusterConfig::from_toml("[sever]\nmax_inflight=3\n").unwrap_err().to_string();
    assert!(e.contains("`sever`") && e.contains("`server`"), "{e}");
    let dir = std::env::temp_dir().join(format!("zerolayer-keys-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("cluster.toml");
    std::fs::write(&file, "[placement]\npolicy='round_robin'\nqueue_weigth=2.0\n").unwrap();
    let e = ClusterConfig::load(Some(&file)).unwrap_err().to_string();
    assert!(e.contains("placement.queue_weigth") && e.contains("queue_weight") && e.contains("cluster.toml"), "{e}");
    std::fs::write(&file, "[placement]\npolicy='round_robin'\n").unwrap();
    let c = ClusterConfig::load(Some(&file)).unwrap();
    let shown = c.explain(Some(&file), &[("nodes[0].http".into(), "--port".into())]).unwrap();
    let source = |k: &str| shown.iter().find(|(key, _, _)| key == k).map(|(_, _, s)| s.clone()).unwrap();
    assert_eq!(source("placement.policy"), file.display().to_string());
    assert_eq!(source("placement.queue_weight"), "default");
    assert_eq!(source("nodes[0].http"), "--port");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn every_typo_is_named_with_the_nearest_key() {
    let given = serde_json::json!({
        "nodes": [{"id": "a", "workers": [{"id": "w", "kv_cach_mb": 64}]}],
        "auth": {"keys": [{"name": "n", "key": "k", "wieght": 2.0}]},
    });
    let shown: Vec<String> = keys::unknown_keys(&given, &known_keys(), &element_shape).iter().map(|u| u.to_string()).collect();
    assert_eq!(shown, ["unknown key `auth.keys[0].wieght` (did you mean `weight`?)", "unknown key `nodes[0].workers[0].kv_cach_mb` (did you mean `kv_cache_mb`?)"]);
    assert!(keys::unknown_keys(&known_keys(), &known_keys(), &element_shape).is_empty(), "the defaults are all known");
}

#[test]
fn fallbacks_chain_without_loops() {
    let cfg = |fallbacks: &[(&str, &str)]| {
        let mut t = String::from("[model]\npath='a.gguf'\nid='a'\n");
        for id in ["b", "c", "d", "e"] {
            t.push_str(&format!("[[models]]\npath='{id}.gguf'\nid='{id}'\n"));
        }
        for (from, to) in fallbacks {
            t = t.replace(&format!("id='{from}'\n"), &format!("id='{from}'\nfallback='{to}'\n"));
        }
        ClusterConfig::from_toml(&format!("{t}[[nodes]]\nid='n'\n[[nodes.workers]]\nid='cpu0'\n"))
    };
    let c = cfg(&[("a", "b"), ("b", "c"), ("c", "d")]).unwrap();
    assert_eq!(c.fallbacks("a").iter().map(|m| m.id.as_str()).collect::<Vec<_>>(), ["b", "c", "d"]);
    assert_eq!(c.fallbacks("c").iter().map(|m| m.id.as_str()).collect::<Vec<_>>(), ["d"]);
    assert!(c.fallbacks("e").is_empty());
    let long = cfg(&[("a", "b"), ("b", "c"), ("c", "d"), ("d", "e")]).unwrap_err().to_string();
    assert!(long.contains("at most 3"), "{long}");
    let looped = cfg(&[("a", "b"), ("b", "a")]).unwrap_err().to_string();
    assert!(looped.contains("loop"), "{looped}");
    assert!(cfg(&[("a", "a")]).unwrap_err().to_string().contains("loop"));
    assert!(cfg(&[("a", "zz")]).unwrap_err().to_string().contains("not a model id"));
}

/// A model's sampling defaults fill in only what a request left unset, and only values a
/// request could send are accepted.
#[test]
fn sampling_defaults_fill_what_a_request_left_unset() {
    let toml = "[[models]]\npath='q.gguf'\nid='qwen'\ndefault_temperature=0.7\ndefault_top_p=0.8\ndefault_top_k=20\ndefault_repetition_penalty=1.05\n";
    let c = ClusterConfig::from_toml(toml).unwrap();
    let mut p = crate::types::SamplingParams::default();
    c.apply_sampling_defaults("qwen", &mut p, false);
    assert_eq!((p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty), (0.7, Some(0.8), Some(20), None, Some(1.05)));
    let mut sent = crate::types::SamplingParams { temperature: 0.0, top_p: Some(0.5), top_k: Some(3), ..Default::default() };
    c.apply_sampling_defaults("qwen", &mut sent, true);
    assert_eq!((sent.temperature, sent.top_p, sent.top_k, sent.repetition_penalty), (0.0, Some(0.5), Some(3), Some(1.05)));
    let mut other = crate::types::SamplingParams::default();
    c.apply_sampling_defaults("smollm2-135m-instruct", &mut other, false);
    assert_eq!((other.temperature, other.top_p, other.top_k), (1.0, None, None), "the APIs' defaults");
    for (field, value) in [("default_temperature", "2.5"), ("default_top_p", "0"), ("default_top_k", "0"), ("default_min_p", "1.5"), ("default_repetition_penalty", "0")] {
        let e = ClusterConfig::from_toml(&format!("[[models]]\npath='q.gguf'\nid='qwen'\n{field}={value}\n")).unwrap_err().to_string();
        assert!(e.contains(field), "{field} = {value}: {e}");
    }
}
