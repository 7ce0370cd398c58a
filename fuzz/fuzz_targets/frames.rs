//! Fuzz target: a peer's wire frames → their decoders (`Open`, `Reply`, a rank's `RankMsg`; the
//! first byte picks one). `cargo fuzz run frames` (see scripts/fuzz). Nothing panics, and a
//! frame that reads encodes back to itself.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = zerolayer_common::wire::samples::exercise(data);
});
