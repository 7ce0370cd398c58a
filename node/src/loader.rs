//! Loading a model directory or file into everything a worker and its coordinator need:
//! the model, its tokenizer and its chat template.

use std::path::Path;
use std::sync::Arc;

use zerolayer_common::config::model_slug;

use crate::chat::ChatTemplate;
use crate::error::{WorkerError, Result};
use crate::model::Model;
use crate::tokenizer::Tokenizer;

/// A loaded model and its text front end.
pub struct Loaded {
    pub model: Model,
    pub tokenizer: Arc<Tokenizer>,
    pub template: Arc<ChatTemplate>,
}

/// Only the model at `path` (as [`load`] reads it), without its tokenizer: what a
/// tensor-parallel rank hosted for another node needs.
pub fn load_model(path: &Path, threads: usize, progress: impl FnMut(usize, usize)) -> Result<Model> {
    if !path.exists() {
        return Err(WorkerError::Model(format!("model not found at {} (every node of a group needs the model file)", path.display())));
    }
    if path.is_dir() {
        return Ok(Model::from_safetensors(path, threads, progress)?.0);
    }
    Ok(Model::from_gguf(path, threads, progress)?.0)
}

/// Loads `path`: a `.gguf` file, or a directory with `config.json` + `*.safetensors`
/// (+ `tokenizer.json`, and optionally `tokenizer_config.json` for the chat template).
/// `tokenizer` overrides where the tokenizer comes from. `progress(done, total)` reports layers.
pub fn load(path: &Path, tokenizer: Option<&Path>, threads: usize, progress: impl FnMut(usize, usize)) -> Result<Loaded> {
    if !path.exists() {
        return Err(WorkerError::Model(format!(
            "model not found at {} (run scripts/fetch-model for the default model)",
            path.display()
        )));
    }
    if path.is_dir() {
        let (model, cfg_json) = Model::from_safetensors(path, threads, progress)?;
        let tok_path = tokenizer.map(Path::to_path_buf).unwrap_or_else(|| path.join("tokenizer.json"));
        let eos: Vec<u32> = match cfg_json.get("eos_token_id") {
            Some(serde_json::Value::Number(n)) => n.as_u64().map(|v| vec![v as u32]).unwrap_or_default(),
            Some(serde_json::Value::Array(a)) => a.iter().filter_map(|v| v.as_u64()).map(|v| v as u32).collect(),
            _ => vec![],
        };
        let tok = Tokenizer::from_file(&tok_path, &eos)?;
        let tc: Option<serde_json::Value> =
            std::fs::read(path.join("tokenizer_config.json")).ok().and_then(|b| serde_json::from_slice(&b).ok());
        let tmpl_src = tc.as_ref().and_then(|v| v.get("chat_template")).and_then(|v| v.as_str());
        let bos = tc.as_ref().and_then(|v| v.get("bos_token")).and_then(|v| v.as_str()).unwrap_or("");
        let eos_s = tc.as_ref().and_then(|v| v.get("eos_token")).and_then(|v| v.as_str()).unwrap_or("");
        let template = ChatTemplate::new(tmpl_src, bos, eos_s)?;
        return Ok(Loaded { model, tokenizer: Arc::new(tok), template: Arc::new(template) });
    }
    let (model, md) = Model::from_gguf(path, threads, progress)?;
    let tok = match tokenizer {
        Some(t) => Tokenizer::from_file(t, &[])?,
        None => Tokenizer::from_gguf(&md)?,
    };
    let tmpl_src = md.get("tokenizer.chat_template").and_then(|v| v.to_string().ok()).cloned();
    let token_str = |key: &str| -> String {
        md.get(key)
            .and_then(|v| v.to_u32().ok())
            .and_then(|id| tok.decode_with_special(&[id]).ok())
            .unwrap_or_default()
    };
    let template = ChatTemplate::new(tmpl_src.as_deref(), &token_str("tokenizer.ggml.bos_token_id"), &token_str("tokenizer.ggml.eos_token_id"))?;
    Ok(Loaded { model, tokenizer: Arc::new(tok), template: Arc::new(template) })
}

/// The name a model is served under when its config gives none: a GGUF's `general.name`, else
/// the file's stem (a directory's name), as an id ([`model_slug`]).
pub fn served_name(path: &Path) -> std::result::Result<String, String> {
    let stem = || path.file_stem().or(path.file_name()).map(|s| model_slug(&s.to_string_lossy())).unwrap_or_default();
    let named = if path.is_dir() {
        String::new()
    } else {
        let mut f = std::fs::File::open(path).map_err(|e| format!("opening {}: {e}", path.display()))?;
        let content = candle_core::quantized::gguf_file::Content::read(&mut f).map_err(|e| format!("reading GGUF {}: {e}", path.display()))?;
        content.metadata.get("general.name").and_then(|v| v.to_string().ok()).map(|n| model_slug(n)).unwrap_or_default()
    };
    let name = if named.is_empty() { stem() } else { named };
    if name.is_empty() {
        return Err(format!("{} has no name to serve it under; give it an `id` (--served-model-name)", path.display()));
    }
    Ok(name)
}

/// Writes a GGUF model's tokenizer as a Hugging Face tokenizer directory: `tokenizer.json` and
/// `tokenizer_config.json` (the chat template, BOS and EOS), for tools that tokenize on their
/// own, such as benchmark clients.
pub fn export_tokenizer(path: &Path, out: &Path) -> Result<()> {
    let mut f = std::fs::File::open(path).map_err(|e| WorkerError::Model(format!("opening {}: {e}", path.display())))?;
    let content = candle_core::quantized::gguf_file::Content::read(&mut f).map_err(WorkerError::candle)?;
    let md = &content.metadata;
    let tok = Tokenizer::from_gguf(md)?;
    let token_str = |key: &str| -> Option<String> { md.get(key).and_then(|v| v.to_u32().ok()).and_then(|id| tok.decode_with_special(&[id]).ok()) };
    std::fs::create_dir_all(out).map_err(|e| WorkerError::Model(format!("creating {}: {e}", out.display())))?;
    tok.save_json(&out.join("tokenizer.json"))?;
    let config = serde_json::json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": md.get("tokenizer.chat_template").and_then(|v| v.to_string().ok()),
        "bos_token": token_str("tokenizer.ggml.bos_token_id"),
        "eos_token": token_str("tokenizer.ggml.eos_token_id"),
        "model_max_length": md.iter().find(|(k, _)| k.ends_with(".context_length")).and_then(|(_, v)| v.to_u32().ok()),
    });
    std::fs::write(out.join("tokenizer_config.json"), serde_json::to_vec_pretty(&config).unwrap_or_default())
        .map_err(|e| WorkerError::Model(format!("writing {}: {e}", out.display())))
}

/// Just the text front end of a GGUF model (tokenizer and chat template) and its context
/// length, from its metadata, without loading any weights: for a coordinator that renders
/// prompts for a model no local worker runs, for fuzzing, and for tools.
pub fn load_frontend(path: &Path) -> Result<(Arc<Tokenizer>, Arc<ChatTemplate>, usize)> {
    let mut f = std::fs::File::open(path).map_err(|e| WorkerError::Model(format!("opening {}: {e}", path.display())))?;
    let content = candle_core::quantized::gguf_file::Content::read(&mut f).map_err(WorkerError::candle)?;
    let md = &content.metadata;
    let tok = Tokenizer::from_gguf(md)?;
    let tmpl_src = md.get("tokenizer.chat_template").and_then(|v| v.to_string().ok()).cloned();
    let token_str = |key: &str| -> String {
        md.get(key).and_then(|v| v.to_u32().ok()).and_then(|id| tok.decode_with_special(&[id]).ok()).unwrap_or_default()
    };
    let template = ChatTemplate::new(tmpl_src.as_deref(), &token_str("tokenizer.ggml.bos_token_id"), &token_str("tokenizer.ggml.eos_token_id"))?;
    let context = md.iter().find(|(k, _)| k.ends_with(".context_length")).and_then(|(_, v)| v.to_u32().ok()).unwrap_or(4096) as usize;
    Ok((Arc::new(tok), Arc::new(template), context))
}
