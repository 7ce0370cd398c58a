//! A deterministic pass of the fuzz target's body over its corpus (`fuzz/corpus/request`) and
//! over every crash regression (`fuzz/regressions`): no input may panic the front end.

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
