//! Writes one of the synthetic models the tests check against llama.cpp
//! (`zerolayer_tests::synthetic_models`) and prints its checksum:
//! `synthetic_model NAME OUT.gguf`. `scripts/gen-synthetic-fixtures` runs it.

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let [_, name, out] = &args[..] else {
        let names: Vec<&str> = zerolayer_tests::synthetic_models().iter().map(|m| m.0).collect();
        eprintln!("usage: synthetic_model NAME OUT.gguf (NAME: {})", names.join(", "));
        std::process::exit(2);
    };
    println!("{}", zerolayer_tests::write_synthetic(name, std::path::Path::new(out)));
}
