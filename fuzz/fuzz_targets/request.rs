//! Fuzz target: request JSON → validation → chat template → tokenization.
//! `cargo fuzz run request` (see scripts/fuzz). The model file provides the tokenizer and the
//! template; no weights are loaded.
#![no_main]

use std::sync::{Arc, OnceLock};

use libfuzzer_sys::fuzz_target;
use zerolayer_worker::chat::ChatTemplate;
use zerolayer_worker::tokenizer::Tokenizer;

static FRONT: OnceLock<(Arc<Tokenizer>, Arc<ChatTemplate>)> = OnceLock::new();

fuzz_target!(|data: &[u8]| {
    let (tok, tmpl) = FRONT.get_or_init(|| {
        let path = std::env::var("ZEROLAYER_FUZZ_MODEL").unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/../models/SmolLM2-135M-Instruct.Q4_1.gguf").into());
        zerolayer_worker::loader::load_frontend(std::path::Path::new(&path)).expect("model metadata for the fuzz target")
    });
    let _ = zerolayer_coordinator::frontend::fuzzing::exercise(data, tok, tmpl);
});
