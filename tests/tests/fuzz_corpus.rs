//! Deterministic passes of the fuzz targets' bodies: `request` over its corpus
//! (`fuzz/corpus/request`) and every crash regression (`fuzz/regressions`), so no input may
//! panic the front end; `gossip` over its seeds; and `frames` (a peer's wire frames) over its
//! seeds and thousands of mutations of every kind of frame.

use zerolayer_coordinator::frontend::fuzzing;
use zerolayer_worker::loader::load_frontend;
use zerolayer_tests::model_path;

#[test]
fn fuzz_corpus_never_panics() {
    let (tok, tmpl, context) = load_frontend(&model_path()).unwrap();
    let served = fuzzing::served(tok, tmpl, context);
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz");
    let mut n = 0;
    let mut ok = 0;
    for (dir, at_least) in [("corpus/request", 7), ("regressions", 1)] {
        let entries = std::fs::read_dir(root.join(dir)).unwrap_or_else(|e| panic!("fuzz/{dir} must exist: {e}"));
        let before = n;
        let mut files: Vec<_> = entries.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.is_file()).collect();
        files.sort();
        for f in files {
            let data = std::fs::read(&f).unwrap();
            if fuzzing::exercise(&data, &served).is_ok() {
                ok += 1;
            }
            n += 1;
        }
        assert!(n - before >= at_least, "fuzz/{dir} holds at least {at_least} inputs ({})", n - before);
    }
    eprintln!("{n} corpus inputs, {ok} valid requests");
    assert!(ok >= 5, "valid seeds render and tokenize ({ok})");
}

/// The gossip target's seeds (`fuzz/corpus/gossip`, chitchat messages written byte by byte
/// from chitchat's format) read as chitchat messages; the screen refuses the delta that trips
/// chitchat's max-version assert, and cuts the one that speaks for the target node out of its
/// message.
#[test]
fn gossip_corpus_reads_and_the_screen_refuses_the_hostile_seeds() {
    use zerolayer_coordinator::cluster::screen::{check, wire, Known, Policy, Refusal};
    struct Nothing;
    impl Known for Nothing {
        fn node_states(&self) -> usize {
            0
        }
        fn knows(&self, _: &wire::Id) -> bool {
            false
        }
        fn keys(&self, _: &wire::Id) -> usize {
            0
        }
        fn has_key(&self, _: &wire::Id, _: &str) -> bool {
            false
        }
    }
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/gossip");
    let policy = Policy { me: "a".into(), generation: 2, configured: vec!["a".into(), "b".into()], allow_join: false };
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let path = e.unwrap().path();
        let data = std::fs::read(&path).unwrap();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        wire::decode(&data).unwrap_or_else(|e| panic!("{name}: {e}"));
        let got = check(&data, &policy, &Nothing);
        match name.as_str() {
            "ack-crash" => assert!(matches!(got, Err(Refusal::MaxBelowKey { max: 5, key: 100, .. })), "{name}: {got:?}"),
            "ack-self" => assert!(got.as_ref().is_ok_and(|s| s.rewritten.is_some() && s.message == wire::Message::Ack { delta: vec![] }), "{name}: {got:?}"),
            _ => assert!(got.is_ok(), "{name}: {got:?}"),
        }
        n += 1;
    }
    assert!(n >= 6, "{n} gossip seeds");
}

/// Every decoder of a peer's frames (a node's `Open` and `Reply`, a rank's messages) reads or
/// refuses, and never panics: the committed seeds (`fuzz/corpus/frames`, one frame of every
/// kind), every truncation of every kind, and 400 mutations of each. What reads encodes back
/// to itself.
#[test]
fn frame_decoders_read_or_refuse_every_mutation() {
    use zerolayer_common::wire::samples::{exercise, inputs};
    use zerolayer_tests::hostile::{mutate, Rng};
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/frames");
    let seeds: Vec<Vec<u8>> = std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("fuzz/corpus/frames must exist: {e}")).map(|e| std::fs::read(e.unwrap().path()).unwrap()).collect();
    assert!(seeds.len() >= inputs().len(), "a seed of every kind ({} of {})", seeds.len(), inputs().len());
    for s in &seeds {
        assert!(exercise(s), "a seed reads");
    }
    let (mut read, mut refused) = (0, 0);
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for frame in inputs() {
        for len in 0..frame.len() {
            let _ = exercise(&frame[..len]);
        }
        for _ in 0..400 {
            if exercise(&mutate(&frame, &mut rng)) {
                read += 1;
            } else {
                refused += 1;
            }
        }
    }
    eprintln!("{read} mutated frames read, {refused} refused");
    // Most changed bytes are values (a token id, a float), which read; a changed length,
    // offset or tag must be refused (measured: 7,890 read, 2,510 refused).
    assert!(refused >= 1_000 && read >= 1_000, "the decoders check what they read ({refused} refused, {read} read)");
}

/// Writes the `frames` target's seeds (`cargo test --test fuzz_corpus -- --ignored`).
#[test]
#[ignore]
fn write_frame_seeds() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/frames");
    std::fs::create_dir_all(&dir).unwrap();
    for (i, input) in zerolayer_common::wire::samples::inputs().iter().enumerate() {
        let kind = zerolayer_common::wire::samples::DECODERS[input[0] as usize % 3];
        std::fs::write(dir.join(format!("{i:02}-{kind}")), input).unwrap();
    }
}
