//! Fuzz target: request JSON → validation → chat template → tokenization.
//! `cargo fuzz run request` (see scripts/fuzz). The model file provides the tokenizer and the
//! template; no weights are loaded.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use zerolayer_coordinator::frontend::fuzzing;
use zerolayer_coordinator::frontend::pipeline::Served;

static FRONT: OnceLock<Served> = OnceLock::new();

fuzz_target!(|data: &[u8]| {
    let served = FRONT.get_or_init(|| {
        let path = std::env::var("ZEROLAYER_FUZZ_MODEL").unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/../models/SmolLM2-135M-Instruct.Q4_1.gguf").into());
        let (tok, tmpl, context) = zerolayer_worker::loader::load_frontend(std::path::Path::new(&path)).expect("model metadata for the fuzz target");
        fuzzing::served(tok, tmpl, context)
    });
    let _ = fuzzing::exercise(data, served);
});
