//! The tree's shape, checked by a tool rather than an eye (ARCHITECTURE.md, "Structure"):
//! - no function outside tests is longer than [`MAX_FN_LINES`] lines, except the SIMD kernel
//!   bodies, whose length is their unrolling;
//! - the coordinator keeps at most [`MAX_COORDINATOR_TOP_FILES`] files at its top level (the rest
//!   lives in its wings: `frontend/`, `routing/`, `cluster/`);
//! - the coordinator never runs a forward pass: tensors stay in the worker crate.
//!
//! Functions are found with `syn` (free functions, methods, and trait methods with a body),
//! outside `#[cfg(test)]` items and test-only files; a function's length runs from its first
//! attribute-free line (its signature) to its closing brace.

use std::path::{Path, PathBuf};

use syn::spanned::Spanned;
use syn::visit::Visit;

/// The longest function allowed, in lines (signature to closing brace).
const MAX_FN_LINES: usize = 120;
/// Files allowed at the coordinator crate's top level (`lib.rs` and `main.rs` included).
const MAX_COORDINATOR_TOP_FILES: usize = 12;

/// Files whose length is SIMD unrolling: exempt from [`MAX_FN_LINES`].
fn exempt(rel: &str) -> bool {
    rel == "kernels/src/attention/avx2.rs" || (rel.starts_with("kernels/src/quant/simd") && rel.ends_with(".rs"))
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") && p.file_name().unwrap() != "tests.rs" {
            out.push(p);
        }
    }
}

fn is_cfg_test(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        (a.path().is_ident("cfg") && a.meta.require_list().is_ok_and(|l| l.tokens.to_string().split(|c: char| !c.is_alphanumeric() && c != '_').any(|w| w == "test")))
            || a.path().is_ident("test")
    })
}

/// Every function's name, first line and length.
#[derive(Default)]
struct Lengths {
    out: Vec<(String, usize, usize)>,
}

impl Lengths {
    fn record(&mut self, name: &syn::Ident, sig: &syn::Signature, body_end: proc_macro2::Span) {
        let (start, end) = (sig.span().start().line, body_end.end().line);
        self.out.push((name.to_string(), start, end + 1 - start));
    }
}

impl<'ast> Visit<'ast> for Lengths {
    fn visit_item_mod(&mut self, m: &'ast syn::ItemMod) {
        if !is_cfg_test(&m.attrs) {
            syn::visit::visit_item_mod(self, m);
        }
    }
    fn visit_item_impl(&mut self, i: &'ast syn::ItemImpl) {
        if !is_cfg_test(&i.attrs) {
            syn::visit::visit_item_impl(self, i);
        }
    }
    fn visit_item_fn(&mut self, f: &'ast syn::ItemFn) {
        if !is_cfg_test(&f.attrs) {
            self.record(&f.sig.ident, &f.sig, f.block.span());
            syn::visit::visit_item_fn(self, f);
        }
    }
    fn visit_impl_item_fn(&mut self, f: &'ast syn::ImplItemFn) {
        if !is_cfg_test(&f.attrs) {
            self.record(&f.sig.ident, &f.sig, f.block.span());
            syn::visit::visit_impl_item_fn(self, f);
        }
    }
    fn visit_trait_item_fn(&mut self, f: &'ast syn::TraitItemFn) {
        if let (false, Some(b)) = (is_cfg_test(&f.attrs), &f.default) {
            self.record(&f.sig.ident, &f.sig, b.span());
        }
        syn::visit::visit_trait_item_fn(self, f);
    }
}

/// `(file, function, line, length)` of every function over the limit in these crates.
fn long_functions(crates: &[&str], limit: usize) -> Vec<(String, String, usize, usize)> {
    let root = root();
    let mut long = vec![];
    for krate in crates {
        let mut files = vec![];
        rust_files(&root.join(krate).join("src"), &mut files);
        for f in files {
            let rel = f.strip_prefix(&root).unwrap().to_string_lossy().into_owned();
            if exempt(&rel) {
                continue;
            }
            let file = syn::parse_file(&std::fs::read_to_string(&f).unwrap()).unwrap_or_else(|e| panic!("{rel}: {e}"));
            let mut v = Lengths::default();
            v.visit_file(&file);
            long.extend(v.out.into_iter().filter(|(_, _, n)| *n > limit).map(|(name, line, n)| (rel.clone(), name, line, n)));
        }
    }
    long
}

#[test]
fn no_function_outside_tests_is_longer_than_the_limit() {
    let long = long_functions(&["common", "kernels", "node", "coordinator"], MAX_FN_LINES);
    let listing: Vec<String> = long.iter().map(|(f, name, line, n)| format!("{f}:{line} {name}: {n} lines")).collect();
    assert!(long.is_empty(), "functions over {MAX_FN_LINES} lines (split them):\n{}", listing.join("\n"));
}

#[test]
fn the_length_check_sees_methods_and_skips_tests() {
    let src = "fn a() {\n\n\n}\nimpl X { fn b(&self) {\n\n} }\ntrait T { fn c() {\n} }\n#[cfg(test)]\nmod tests { fn d() {\n\n\n\n} }\n#[test]\nfn e() {\n\n\n\n\n}";
    let mut v = Lengths::default();
    v.visit_file(&syn::parse_file(src).unwrap());
    let got: Vec<(&str, usize)> = v.out.iter().map(|(n, _, l)| (n.as_str(), *l)).collect();
    assert_eq!(got, vec![("a", 4), ("b", 3), ("c", 2)]);
}

#[test]
fn the_coordinator_keeps_its_top_level_small_and_its_hands_off_tensors() {
    let src = root().join("coordinator/src");
    let top: Vec<String> = std::fs::read_dir(&src)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file() && p.extension().is_some_and(|x| x == "rs"))
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert!(top.len() <= MAX_COORDINATOR_TOP_FILES, "{} top-level files in coordinator/src (at most {MAX_COORDINATOR_TOP_FILES}; move them into a wing): {top:?}", top.len());
    let mut files = vec![];
    rust_files(&src, &mut files);
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        assert!(!text.contains("forward_into"), "{} runs a forward pass: tensors stay in the worker crate", f.display());
    }
}
