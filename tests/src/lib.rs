//! Helpers shared by the integration tests: the real model's location, loading, and a lock
//! that keeps model-heavy tests from running at once on a 2-core machine.

use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};

use zerolayer_node::engine::{Engine, EngineConfig};
use zerolayer_node::loader::{load, Loaded};

/// The default model, fetched by `scripts/fetch-model`. Tests never skip without it: they fail
/// and say how to fetch it.
pub fn model_path() -> PathBuf {
    let p = match std::env::var_os("ZEROLAYER_TEST_MODEL") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    };
    assert!(p.exists(), "the real model is required at {}: run scripts/fetch-model", p.display());
    p
}

/// Serializes tests that run the model (each uses every core).
pub fn heavy() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

pub fn load_default() -> Loaded {
    load(&model_path(), None, 2, |_, _| {}).expect("load the default model")
}

/// An engine on the default model.
pub fn engine(cfg: EngineConfig) -> Engine {
    let l = load_default();
    Engine::new(l.model, l.tokenizer, &cfg).expect("engine")
}

/// A long, varied English text for building prompts of a given token length.
pub const LOREM: &str = "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg \
combined movable metal type, oil-based ink and a wooden press adapted from wine making. Books became cheaper, \
literacy spread across Europe, and scientific ideas travelled faster than ever before. Within fifty years, \
printers in more than two hundred cities had produced millions of volumes, from bibles and grammars to \
almanacs, maps and pamphlets that argued about religion and politics. Historians still debate how much the \
press caused the Reformation and the scientific revolution, but few doubt that it changed how knowledge \
was stored, copied and shared. Today the same questions are asked about the internet and about machine \
learning: who controls the presses, who can read what they print, and what happens to the people whose \
work is automated away. ";
