//! No import cycles among any crate's modules: a tool, not an eye, checks the layering that
//! ARCHITECTURE.md describes.
//!
//! Each source file is a module (`x.rs` and `x/mod.rs` are `x`). Every path in a file's code is
//! resolved the way rustc resolves it (`crate::`, `super::`, `self::`, or a child module's
//! name), outside `#[cfg(test)]` items, and names the deepest module it reaches; that is an edge.
//! Declaring a child (`mod x;`) is not an edge; a parent that *uses* a child's item is. Two
//! graphs must be acyclic: the modules themselves, and the same edges collapsed onto each
//! crate's top-level modules (so `cluster::*` and `placement` cannot use each other either).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use syn::visit::Visit;

type Module = Vec<String>;

fn module_of(src: &Path, file: &Path) -> Module {
    let rel = file.strip_prefix(src).unwrap();
    let mut parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
    let last = parts.pop().unwrap();
    match last.as_str() {
        "lib.rs" | "mod.rs" => {}
        f => parts.push(f.trim_end_matches(".rs").to_string()),
    }
    parts
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            if p.file_name().unwrap() != "bin" {
                rust_files(&p, out);
            }
        } else if p.extension().is_some_and(|x| x == "rs") && p.file_name().unwrap() != "main.rs" {
            out.push(p);
        }
    }
}

fn is_cfg_test(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| a.path().is_ident("cfg") && a.meta.require_list().is_ok_and(|l| l.tokens.to_string().contains("test")))
}

/// Collects the module paths a file's code names.
struct Collector<'a> {
    here: &'a Module,
    modules: &'a BTreeSet<Module>,
    out: BTreeSet<Module>,
}

impl Collector<'_> {
    fn resolve(&mut self, segs: &[String]) {
        let Some(first) = segs.first() else { return };
        let mut abs: Vec<String> = match first.as_str() {
            "crate" => segs[1..].to_vec(),
            "self" => self.here.iter().chain(&segs[1..]).cloned().collect(),
            "super" => {
                let mut base = self.here.clone();
                let mut rest = segs;
                while rest.first().is_some_and(|s| s == "super") {
                    base.pop();
                    rest = &rest[1..];
                }
                base.into_iter().chain(rest.iter().cloned()).collect()
            }
            child => {
                let mut m = self.here.clone();
                m.push(child.to_string());
                if !self.modules.contains(&m) {
                    return; // an item, a std or external path
                }
                self.here.iter().chain(segs).cloned().collect()
            }
        };
        // The deepest module the path reaches.
        while !abs.is_empty() && !self.modules.contains(&abs) {
            abs.pop();
        }
        if &abs != self.here {
            if std::env::var_os("MODGRAPH_DEBUG").is_some() {
                eprintln!("{} uses {} via {segs:?}", name(self.here), name(&abs));
            }
            self.out.insert(abs);
        }
    }

    fn use_tree(&mut self, prefix: &mut Vec<String>, t: &syn::UseTree) {
        match t {
            syn::UseTree::Path(p) => {
                prefix.push(p.ident.to_string());
                self.use_tree(prefix, &p.tree);
                prefix.pop();
            }
            syn::UseTree::Name(n) => {
                prefix.push(n.ident.to_string());
                self.resolve(&prefix.clone());
                prefix.pop();
            }
            syn::UseTree::Rename(r) => {
                prefix.push(r.ident.to_string());
                self.resolve(&prefix.clone());
                prefix.pop();
            }
            syn::UseTree::Glob(_) => self.resolve(&prefix.clone()),
            syn::UseTree::Group(g) => {
                for t in &g.items {
                    self.use_tree(prefix, t);
                }
            }
        }
    }
}

impl<'ast> Visit<'ast> for Collector<'_> {
    fn visit_item(&mut self, i: &'ast syn::Item) {
        let attrs = match i {
            syn::Item::Mod(m) => &m.attrs,
            syn::Item::Fn(f) => &f.attrs,
            syn::Item::Impl(m) => &m.attrs,
            syn::Item::Use(u) => &u.attrs,
            _ => return syn::visit::visit_item(self, i),
        };
        if !is_cfg_test(attrs) {
            syn::visit::visit_item(self, i);
        }
    }

    fn visit_item_use(&mut self, u: &'ast syn::ItemUse) {
        self.use_tree(&mut Vec::new(), &u.tree);
    }

    /// `pub(super)` and `pub(in crate::x)` name a scope, not a dependency.
    fn visit_visibility(&mut self, _: &'ast syn::Visibility) {}

    fn visit_path(&mut self, p: &'ast syn::Path) {
        let segs: Vec<String> = p.segments.iter().map(|s| s.ident.to_string()).collect();
        self.resolve(&segs);
        syn::visit::visit_path(self, p);
    }
}

/// The strongly connected components with more than one member (Tarjan).
fn cycles(edges: &BTreeMap<Module, BTreeSet<Module>>) -> Vec<Vec<Module>> {
    struct T<'a> {
        edges: &'a BTreeMap<Module, BTreeSet<Module>>,
        index: BTreeMap<&'a Module, usize>,
        low: BTreeMap<&'a Module, usize>,
        stack: Vec<&'a Module>,
        on: BTreeSet<&'a Module>,
        out: Vec<Vec<Module>>,
    }
    impl<'a> T<'a> {
        fn go(&mut self, v: &'a Module) {
            let n = self.index.len();
            self.index.insert(v, n);
            self.low.insert(v, n);
            self.stack.push(v);
            self.on.insert(v);
            for w in self.edges.get(v).into_iter().flatten() {
                if !self.index.contains_key(w) {
                    self.go(w);
                    let lw = self.low[w];
                    let lv = self.low.get_mut(v).unwrap();
                    *lv = (*lv).min(lw);
                } else if self.on.contains(w) {
                    let iw = self.index[w];
                    let lv = self.low.get_mut(v).unwrap();
                    *lv = (*lv).min(iw);
                }
            }
            if self.low[v] == self.index[v] {
                let mut scc = vec![];
                loop {
                    let w = self.stack.pop().unwrap();
                    self.on.remove(w);
                    scc.push(w.clone());
                    if w == v {
                        break;
                    }
                }
                if scc.len() > 1 {
                    self.out.push(scc);
                }
            }
        }
    }
    let mut t = T { edges, index: BTreeMap::new(), low: BTreeMap::new(), stack: vec![], on: BTreeSet::new(), out: vec![] };
    for v in edges.keys() {
        if !t.index.contains_key(v) {
            t.go(v);
        }
    }
    t.out
}

fn name(m: &Module) -> String {
    if m.is_empty() {
        "crate".into()
    } else {
        m.join("::")
    }
}

/// The module graph of one crate's `src/`.
fn graph(src: &Path) -> BTreeMap<Module, BTreeSet<Module>> {
    let mut files = vec![];
    rust_files(src, &mut files);
    let modules: BTreeSet<Module> = files.iter().map(|f| module_of(src, f)).collect();
    let mut edges = BTreeMap::new();
    for f in &files {
        let here = module_of(src, f);
        let ast = syn::parse_file(&std::fs::read_to_string(f).unwrap()).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        let mut c = Collector { here: &here, modules: &modules, out: BTreeSet::new() };
        c.visit_file(&ast);
        edges.insert(here.clone(), c.out);
    }
    edges
}

fn collapse(edges: &BTreeMap<Module, BTreeSet<Module>>) -> BTreeMap<Module, BTreeSet<Module>> {
    let top = |m: &Module| m.iter().take(1).cloned().collect::<Module>();
    let mut out: BTreeMap<Module, BTreeSet<Module>> = BTreeMap::new();
    for (from, tos) in edges {
        let e = out.entry(top(from)).or_default();
        for to in tos {
            // The crate root only declares modules; edges into it (shared helpers such as
            // `kernels::SyncPtr`) cannot close a cycle unless the root uses a module.
            if top(to) != top(from) {
                e.insert(top(to));
            }
        }
    }
    out
}

fn assert_acyclic(krate: &str, edges: &BTreeMap<Module, BTreeSet<Module>>, what: &str) {
    let found = cycles(edges);
    let described: Vec<String> = found
        .iter()
        .map(|scc| {
            let members: BTreeSet<&Module> = scc.iter().collect();
            let inner: Vec<String> = scc
                .iter()
                .flat_map(|m| edges[m].iter().filter(|t| members.contains(t)).map(move |t| format!("{} -> {}", name(m), name(t))))
                .collect();
            inner.join(", ")
        })
        .collect();
    assert!(found.is_empty(), "{krate}: import cycles among {what}: {described:#?}");
}

#[test]
fn no_crate_has_an_import_cycle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for krate in ["common", "kernels", "node", "coordinator"] {
        let g = graph(&root.join(krate).join("src"));
        assert!(g.len() > 3, "{krate}: the walk found its modules");
        assert_acyclic(krate, &g, "modules");
        assert_acyclic(krate, &collapse(&g), "top-level modules");
    }
}

/// The checker itself finds a cycle when there is one (so a passing run means something).
#[test]
fn the_checker_sees_a_cycle() {
    let dir = zerolayer_tests::temp_dir("modgraph");
    std::fs::create_dir_all(dir.join("b")).unwrap();
    std::fs::write(dir.join("lib.rs"), "mod a; mod b; mod c;").unwrap();
    std::fs::write(dir.join("a.rs"), "use crate::b::x::Thing; pub fn f() {}").unwrap();
    std::fs::write(dir.join("b/mod.rs"), "pub mod x; pub fn g() { super::c::h() }").unwrap();
    std::fs::write(dir.join("b/x.rs"), "pub struct Thing; #[cfg(test)] mod tests { use crate::a::f; }").unwrap();
    std::fs::write(dir.join("c.rs"), "pub fn h() { crate::a::f() }").unwrap();
    let g = graph(&dir);
    assert!(cycles(&g).is_empty(), "file level: a -> b::x, b -> c -> a: no cycle ({g:?})");
    let top = collapse(&g);
    assert_eq!(cycles(&top).len(), 1, "top level: a -> b -> c -> a ({top:?})");
    // A parent using its child and the child using its parent is a cycle at file level.
    std::fs::write(dir.join("b/x.rs"), "pub struct Thing; pub fn k() { super::g() }").unwrap();
    std::fs::write(dir.join("b/mod.rs"), "pub mod x; pub fn g() { x::k() }").unwrap();
    assert_eq!(cycles(&graph(&dir)).len(), 1);
}

#[test]
#[ignore]
fn print_graph() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let krate = std::env::var("CRATE").unwrap_or("kernels".into());
    for (k, v) in graph(&root.join(krate).join("src")) {
        eprintln!("{} -> {:?}", name(&k), v.iter().map(name).collect::<Vec<_>>());
    }
}
