//! The workspace's structural invariants, checked on its source text (ARCHITECTURE.md,
//! "Invariants"): module imports form no cycle in any crate; attn-dsl knows no backend; crates
//! depend one way; in attn-runtime, `host/` imports neither `cpu/` nor `gpu/`, and `cpu/` and
//! `gpu/` do not import each other; `unsafe` appears only in attn-runtime and in the two files of
//! attn-py that meet torch's memory, each block under a `SAFETY:` comment; ARCHITECTURE.md stays a short map of files that exist; no library function
//! is over 150 lines nor file over 800; settings are read in one file; comments name files that
//! exist; the workspace has at most 8 integration-test binaries.
//!
//! A module is a source file (`a/mod.rs` is `a`). Module `m` imports module `n` when a `use` of
//! `m`, or a `crate::`, `super::` or `self::` path in its code, names an item of `n`. Paths are
//! followed through `pub use` re-exports to the module that defines the item, so a parent that
//! only declares and re-exports its children imports nothing. Test modules (`#[cfg(test)]`
//! onwards) are not read.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

/// The crates of the workspace: name, source folder.
const CRATES: [(&str, &str); 7] = [
    ("attn", "src"),
    ("attnc", "src/bin/attnc"),
    ("attn_dsl", "attn-dsl/src"),
    ("attn_macros", "attn-macros/src"),
    ("codegen", "codegen/src"),
    ("attn_runtime", "attn-runtime/src"),
    ("attn_py", "attn-py/src"),
];

/// The files of attn-py that read torch's memory and hand it outputs, its only `unsafe`.
const PY_UNSAFE_FILES: [&str; 2] = ["torch_memory.rs", "dlpack.rs"];

type Module = Vec<String>;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn name(m: &[String]) -> String {
    if m.is_empty() {
        "<root>".to_string()
    } else {
        m.join("::")
    }
}

/// Every `.rs` file below `dir`, recursively.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

/// A crate's modules by path, each with its source text (binaries under `bin/` are their own
/// crates and left out).
fn modules(src: &Path) -> BTreeMap<Module, String> {
    let mut out = BTreeMap::new();
    for path in rust_files(src) {
        let rel = path.strip_prefix(src).unwrap().with_extension("");
        let mut parts: Module = rel
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        if parts.first().is_some_and(|p| p == "bin") {
            continue;
        }
        if parts
            .last()
            .is_some_and(|p| p == "mod" || p == "lib" || p == "main")
        {
            parts.pop();
        }
        out.insert(parts, std::fs::read_to_string(&path).unwrap());
    }
    out
}

/// `text` without comments, string and char contents, and everything from `#[cfg(test)]` on.
fn code(text: &str) -> String {
    let text = text.split("#[cfg(test)]").next().unwrap();
    let bytes = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'/' if bytes.get(i + 1) == Some(&b'/') => {
                while i < bytes.len() && bytes[i] != b'\n' {
                    i += 1;
                }
            }
            b'/' if bytes.get(i + 1) == Some(&b'*') => {
                i += 2;
                while i + 1 < bytes.len() && !(bytes[i] == b'*' && bytes[i + 1] == b'/') {
                    i += 1;
                }
                i += 2;
            }
            b'"' => {
                out.push_str("\"\"");
                i += 1;
                while i < bytes.len() && bytes[i] != b'"' {
                    i += if bytes[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
            }
            c => {
                out.push(c as char);
                i += 1;
            }
        }
    }
    out
}

/// The paths a `use` tree names (`a::{b, c::{d as e}}` gives `a::b` and `a::c::d`).
fn use_paths(tree: &str, prefix: &[String]) -> Vec<Module> {
    let tree = tree.trim();
    if let Some(open) = tree.find('{')
        && tree.ends_with('}')
    {
        let mut base = prefix.to_vec();
        base.extend(segments(tree[..open].trim_end_matches("::")));
        let inner = &tree[open + 1..tree.len() - 1];
        let (mut depth, mut start, mut out) = (0, 0, Vec::new());
        for (i, c) in inner.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    out.extend(use_paths(&inner[start..i], &base));
                    start = i + 1;
                }
                _ => {}
            }
        }
        out.extend(use_paths(&inner[start..], &base));
        return out;
    }
    if tree.is_empty() {
        return Vec::new();
    }
    let tree = tree.split(" as ").next().unwrap();
    let mut path = prefix.to_vec();
    path.extend(segments(tree));
    vec![path]
}

fn segments(path: &str) -> Vec<String> {
    path.split("::")
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect()
}

/// A crate's module graph: for each module, the modules it imports.
struct Graph {
    edges: BTreeMap<Module, BTreeSet<Module>>,
}

impl Graph {
    fn of(src: &Path) -> Graph {
        let mods = modules(src);
        let codes: BTreeMap<&Module, String> = mods.iter().map(|(m, t)| (m, code(t))).collect();
        // Each module's `use` declarations, re-exports (`pub use`) apart.
        let mut uses: HashMap<&Module, Vec<Module>> = HashMap::new();
        let mut reexports: HashMap<&Module, HashMap<String, Module>> = HashMap::new();
        for (m, text) in &codes {
            for (public, at, tree) in use_declarations(text) {
                for path in use_paths(&tree, &[]) {
                    let path = outside_inline_modules(text, at, path);
                    if public {
                        if let Some(last) = path.last() {
                            reexports.entry(m).or_default().insert(last.clone(), path);
                        }
                    } else {
                        uses.entry(m).or_default().push(path);
                    }
                }
            }
        }
        let absolute = |m: &Module, path: &[String]| -> Option<Module> {
            match path.first()?.as_str() {
                "crate" => Some(path[1..].to_vec()),
                "self" => Some([m.as_slice(), &path[1..]].concat()),
                "super" => {
                    let mut base = m.clone();
                    let mut rest = path;
                    while rest.first().is_some_and(|s| s == "super") {
                        base.pop();
                        rest = &rest[1..];
                    }
                    Some([base.as_slice(), rest].concat())
                }
                child => {
                    let mut own = m.clone();
                    own.push(child.to_string());
                    mods.contains_key(&own)
                        .then(|| [m.as_slice(), path].concat())
                }
            }
        };
        // The module that defines what `path` names: its longest module prefix, through
        // re-exports of the next segment.
        let resolve = |path: Module| -> Option<Module> {
            let mut path = path;
            for _ in 0..16 {
                let n = (0..=path.len())
                    .rev()
                    .find(|&n| mods.contains_key(&path[..n]))?;
                let module = path[..n].to_vec();
                let target = path.get(n).and_then(|item| {
                    let via = reexports.get(&module)?.get(item)?;
                    absolute(&module, via)
                });
                match target {
                    Some(target) => path = [target.as_slice(), &path[n + 1..]].concat(),
                    None => return Some(module),
                }
            }
            None
        };
        let mut edges: BTreeMap<Module, BTreeSet<Module>> = BTreeMap::new();
        for (m, text) in &codes {
            let mut refs = uses.get(m).cloned().unwrap_or_default();
            refs.extend(qualified_paths(text));
            let targets = edges.entry((*m).clone()).or_default();
            for path in refs {
                if let Some(target) = absolute(m, &path).and_then(&resolve)
                    && &target != *m
                {
                    targets.insert(target);
                }
            }
        }
        Graph { edges }
    }

    /// The import cycles: each strongly connected set of two or more modules, sorted.
    fn cycles(&self) -> Vec<Vec<String>> {
        struct Tarjan<'g> {
            graph: &'g Graph,
            index: HashMap<&'g Module, usize>,
            low: HashMap<&'g Module, usize>,
            stack: Vec<&'g Module>,
            on_stack: BTreeSet<&'g Module>,
            out: Vec<Vec<String>>,
        }
        impl<'g> Tarjan<'g> {
            fn visit(&mut self, v: &'g Module) {
                let i = self.index.len();
                self.index.insert(v, i);
                self.low.insert(v, i);
                self.stack.push(v);
                self.on_stack.insert(v);
                for w in self.graph.edges.get(v).into_iter().flatten() {
                    if !self.index.contains_key(w) {
                        self.visit(w);
                        let lw = self.low[w];
                        self.low.entry(v).and_modify(|l| *l = (*l).min(lw));
                    } else if self.on_stack.contains(w) {
                        let iw = self.index[w];
                        self.low.entry(v).and_modify(|l| *l = (*l).min(iw));
                    }
                }
                if self.low[v] == self.index[v] {
                    let mut set = Vec::new();
                    while let Some(w) = self.stack.pop() {
                        self.on_stack.remove(w);
                        set.push(name(w));
                        if w == v {
                            break;
                        }
                    }
                    if set.len() > 1 {
                        set.sort();
                        self.out.push(set);
                    }
                }
            }
        }
        let mut t = Tarjan {
            graph: self,
            index: HashMap::new(),
            low: HashMap::new(),
            stack: Vec::new(),
            on_stack: BTreeSet::new(),
            out: Vec::new(),
        };
        for v in self.edges.keys() {
            if !t.index.contains_key(v) {
                t.visit(v);
            }
        }
        t.out.sort();
        t.out
    }

    /// The imports from modules under `from` into modules under `to`, as `a -> b` lines.
    fn imports_between(&self, from: &str, to: &str) -> Vec<String> {
        let under = |m: &Module, top: &str| m.first().is_some_and(|p| p == top);
        self.edges
            .iter()
            .filter(|(m, _)| under(m, from))
            .flat_map(|(m, targets)| {
                targets
                    .iter()
                    .filter(|t| under(t, to))
                    .map(move |t| format!("{} -> {}", name(m), name(t)))
            })
            .collect()
    }
}

/// The `use` declarations of `code`: whether each is public (`pub` or `pub(...)`), where it
/// stands, and its tree.
fn use_declarations(code: &str) -> Vec<(bool, usize, String)> {
    let mut out = Vec::new();
    let mut rest = code;
    let mut offset = 0;
    while let Some(at) = rest.find("use ") {
        let before = &rest[..at];
        let boundary = before
            .chars()
            .last()
            .is_none_or(|c| !(c.is_alphanumeric() || c == '_'));
        let Some(end) = rest[at..].find(';') else {
            break;
        };
        if boundary {
            let head = before.trim_end();
            let public = head.ends_with("pub") || (head.ends_with(')') && head.contains("pub("));
            let line_start = before.rfind(['\n', ';', '{', '}']).map_or(0, |i| i + 1);
            let statement_start = before[line_start..].trim();
            if statement_start.is_empty() || statement_start.starts_with("pub") {
                out.push((public, offset + at, rest[at + 4..at + end].to_string()));
            }
        }
        offset += at + end + 1;
        rest = &rest[at + end + 1..];
    }
    out
}

/// The byte ranges of the inline modules (`mod name { … }`) of `code`.
fn inline_modules(code: &str) -> Vec<std::ops::Range<usize>> {
    let bytes = code.as_bytes();
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(at) = code[from..].find("mod ") {
        let at = from + at;
        from = at + 4;
        if at > 0 && (bytes[at - 1].is_ascii_alphanumeric() || bytes[at - 1] == b'_') {
            continue;
        }
        let rest = &code[at + 4..];
        let name_end = rest
            .find(|c: char| !(c.is_alphanumeric() || c == '_'))
            .unwrap_or(rest.len());
        let after = rest[name_end..].trim_start();
        if name_end == 0 || !after.starts_with('{') {
            continue;
        }
        let open = at + 4 + name_end + (rest[name_end..].len() - after.len());
        let mut depth = 0;
        for (i, b) in bytes.iter().enumerate().skip(open) {
            match b {
                b'{' => depth += 1,
                b'}' => {
                    depth -= 1;
                    if depth == 0 {
                        out.push(open..i);
                        break;
                    }
                }
                _ => {}
            }
        }
    }
    out
}

/// `path`, found at byte `at` of `code`, with the `super`s that only leave inline modules
/// (which are part of the file's module) turned into `self`.
fn outside_inline_modules(code: &str, at: usize, path: Module) -> Module {
    let depth = inline_modules(code)
        .iter()
        .filter(|r| r.contains(&at))
        .count();
    let supers = path.iter().take_while(|s| *s == "super").count();
    let inner = supers.min(depth);
    if inner == 0 {
        return path;
    }
    let mut out = vec!["self".to_string()];
    out.extend(path[inner..].iter().filter(|s| *s != "self").cloned());
    if supers > inner {
        // What is left still starts with `super`, relative to the file's module.
        out.remove(0);
    }
    out
}

/// Every `crate::…`, `super::…` and `self::…` path in `code`.
fn qualified_paths(code: &str) -> Vec<Module> {
    let bytes = code.as_bytes();
    let mut out = Vec::new();
    for start in ["crate::", "super::", "self::"] {
        let mut from = 0;
        while let Some(at) = code[from..].find(start) {
            let at = from + at;
            from = at + start.len();
            if at > 0 && (bytes[at - 1].is_ascii_alphanumeric() || bytes[at - 1] == b'_') {
                continue;
            }
            let end = code[at..]
                .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
                .map_or(code.len(), |e| at + e);
            let path = segments(&code[at..end]);
            if path.len() > 1 {
                out.push(outside_inline_modules(code, at, path));
            }
        }
    }
    out
}

#[test]
fn no_crate_has_a_module_import_cycle() {
    let mut found = Vec::new();
    for (krate, src) in CRATES {
        for cycle in Graph::of(&root().join(src)).cycles() {
            found.push(format!("{krate}: {}", cycle.join(", ")));
        }
    }
    assert_eq!(found, Vec::<String>::new(), "module import cycles");
}

#[test]
fn the_host_layer_imports_neither_backend_and_the_backends_not_each_other() {
    let graph = Graph::of(&root().join("attn-runtime/src"));
    for (from, to) in [
        ("host", "cpu"),
        ("host", "gpu"),
        ("cpu", "gpu"),
        ("gpu", "cpu"),
    ] {
        assert_eq!(
            graph.imports_between(from, to),
            Vec::<String>::new(),
            "{from}/ imports {to}/"
        );
    }
}

/// The packages a manifest depends on, in any dependency table (normal, dev, build, per
/// target); a `[workspace.dependencies]` table only declares versions and is not read.
fn dependencies(manifest: &str) -> Vec<String> {
    let text = std::fs::read_to_string(root().join(manifest)).unwrap();
    let mut out = Vec::new();
    let mut in_table = false;
    for line in text.lines().map(str::trim) {
        if line.starts_with('[') {
            let table = line.trim_matches(|c| c == '[' || c == ']');
            in_table = !table.starts_with("workspace")
                && table.split('.').any(|part| part.ends_with("dependencies"));
        } else if in_table
            && !line.starts_with('#')
            && let Some(key) = line.split(['=', '.', ' ']).next().filter(|k| !k.is_empty())
        {
            out.push(key.to_string());
        }
    }
    out
}

#[test]
fn attn_dsl_knows_no_backend() {
    let sources: String = rust_files(&root().join("attn-dsl/src"))
        .iter()
        .map(|p| code(&std::fs::read_to_string(p).unwrap()))
        .collect();
    let deps = dependencies("attn-dsl/Cargo.toml");
    for backend in [
        "attn-codegen",
        "attn-runtime",
        "attn-macros",
        "cranelift",
        "cudarc",
        "inkwell",
        "llvm-sys",
    ] {
        assert!(
            !deps.iter().any(|d| d.starts_with(backend)),
            "attn-dsl depends on {backend}"
        );
        let ident = backend.replace('-', "_");
        assert!(!sources.contains(&ident), "attn-dsl names {ident}");
    }
    assert!(!sources.contains("codegen::"), "attn-dsl names codegen");
}

#[test]
fn crates_depend_one_way_and_only_the_runtime_on_cudarc() {
    for (manifest, forbidden) in [
        ("codegen/Cargo.toml", ["attn-runtime", "cudarc"]),
        ("attn-macros/Cargo.toml", ["attn-runtime", "cudarc"]),
        ("Cargo.toml", ["cudarc", "cudarc"]),
    ] {
        let deps = dependencies(manifest);
        for name in forbidden {
            assert!(
                !deps.iter().any(|d| d == name),
                "{manifest} depends on {name}"
            );
        }
    }
    // The reader finds what is there: the runtime does depend on codegen and cudarc.
    let runtime = dependencies("attn-runtime/Cargo.toml");
    assert!(runtime.iter().any(|d| d == "attn-codegen"), "{runtime:?}");
    assert!(runtime.iter().any(|d| d == "cudarc"), "{runtime:?}");
}

/// Paragraphs of a Markdown text: runs of lines between blank lines, a list item each.
fn paragraphs(text: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut open = false;
    for line in text.lines() {
        let trimmed = line.trim_start();
        let item = trimmed.starts_with("- ")
            || trimmed
                .split_once(". ")
                .is_some_and(|(n, _)| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()));
        if trimmed.is_empty() {
            open = false;
        } else if open && !item {
            let last = out.last_mut().unwrap();
            last.push(' ');
            last.push_str(trimmed);
        } else {
            out.push(trimmed.to_string());
            open = true;
        }
    }
    out
}

/// The file paths a Markdown text names in backticks: a token with no spaces that has a `/` or
/// a file extension of the tree's, globs left out.
fn named_paths(text: &str) -> Vec<String> {
    text.split('`')
        .skip(1)
        .step_by(2)
        .filter(|t| !t.contains(char::is_whitespace) && !t.contains('*') && !t.contains("::"))
        .filter(|t| t.chars().any(char::is_alphanumeric))
        .filter(|t| {
            t.contains('/')
                || [".rs", ".md", ".sh", ".toml", ".py"]
                    .iter()
                    .any(|e| t.ends_with(e))
        })
        .map(|t| t.trim_end_matches('/').to_string())
        .collect()
}

/// Every file and folder of the tree, relative to the root (build output and `.git` left out).
fn tree_paths() -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![root()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            let rel = path
                .strip_prefix(root())
                .unwrap()
                .to_string_lossy()
                .into_owned();
            if rel == "target" || rel == ".git" {
                continue;
            }
            if path.is_dir() {
                stack.push(path.clone());
            }
            out.push(rel);
        }
    }
    out
}

#[test]
fn architecture_md_is_a_short_map_of_files_that_exist() {
    let text = std::fs::read_to_string(root().join("ARCHITECTURE.md")).unwrap();
    let words = text.split_whitespace().count();
    assert!(words < 3000, "ARCHITECTURE.md has {words} words");
    for p in paragraphs(&text) {
        let words = p.split_whitespace().count();
        assert!(words <= 150, "a paragraph of {words} words: {p}");
    }
    let tree = tree_paths();
    let missing: Vec<String> = named_paths(&text)
        .into_iter()
        .filter(|name| {
            !tree
                .iter()
                .any(|p| p == name || p.ends_with(&format!("/{name}")))
        })
        .collect();
    assert_eq!(
        missing,
        Vec::<String>::new(),
        "ARCHITECTURE.md names files that do not exist"
    );
}

#[test]
fn the_map_readers_find_paragraphs_and_paths() {
    let text =
        "One\ntwo.\n\n- an item\n  continued\n- `a/b.rs` and `c.rs`\n1. `x y/z` `*.gir` `//!`\n";
    assert_eq!(
        paragraphs(text),
        [
            "One two.",
            "- an item continued",
            "- `a/b.rs` and `c.rs`",
            "1. `x y/z` `*.gir` `//!`"
        ]
    );
    assert_eq!(named_paths(text), ["a/b.rs", "c.rs"]);
}

/// Whether line `i` of `lines` has a `SAFETY:` comment on it, or in the comment lines right
/// above the statement it continues (attributes between are allowed).
fn has_safety_comment(lines: &[&str], i: usize) -> bool {
    if lines[i].contains("SAFETY:") {
        return true;
    }
    let mut j = i;
    // Up to the first line of the statement: a line that continues the one above.
    while j > 0 {
        let above = lines[j - 1].split("//").next().unwrap().trim();
        if above.is_empty() || above.ends_with([';', '{', '}']) {
            break;
        }
        j -= 1;
    }
    while j > 0 {
        j -= 1;
        let l = lines[j].trim();
        if l.contains("SAFETY:") {
            return true;
        }
        if !(l.starts_with("//") || l.starts_with("#[")) {
            return false;
        }
    }
    false
}

#[test]
fn unsafe_stays_in_its_files_each_block_under_a_safety_comment() {
    let mut missing = Vec::new();
    let mut outside = Vec::new();
    for (krate, src) in CRATES {
        let dir = root().join(src);
        if krate == "attn_runtime" || krate == "attn_py" {
            for path in rust_files(&dir) {
                let text = std::fs::read_to_string(&path).unwrap();
                let lines: Vec<&str> = text.lines().collect();
                let file = path.file_name().unwrap().to_str().unwrap();
                let allowed = krate == "attn_runtime" || PY_UNSAFE_FILES.contains(&file);
                for (i, line) in lines.iter().enumerate() {
                    let code = line.split("//").next().unwrap();
                    if !allowed && code.contains("unsafe") {
                        outside.push(format!("{}:{}", path.display(), i + 1));
                    }
                    let block = code
                        .match_indices("unsafe")
                        .any(|(at, _)| code[at + "unsafe".len()..].trim_start().starts_with('{'));
                    if block && !has_safety_comment(&lines, i) {
                        missing.push(format!("{}:{}", path.display(), i + 1));
                    }
                }
            }
            continue;
        }
        let root_file = ["lib.rs", "main.rs"]
            .iter()
            .map(|f| dir.join(f))
            .find(|p| p.exists())
            .unwrap();
        let text = std::fs::read_to_string(&root_file).unwrap();
        assert!(
            text.contains("#![forbid(unsafe_code)]"),
            "{krate} does not forbid unsafe code"
        );
    }
    assert_eq!(
        missing,
        Vec::<String>::new(),
        "unsafe blocks without SAFETY"
    );
    assert_eq!(outside, Vec::<String>::new(), "unsafe outside its files");
    // The CLI is a crate of its own.
    let cli = std::fs::read_to_string(root().join("src/bin/attnc/main.rs")).unwrap();
    assert!(
        cli.contains("#![forbid(unsafe_code)]"),
        "attnc allows unsafe code"
    );
}

/// The parser itself, on small sources: a cycle through a child's `super::` import, and none
/// where a parent only re-exports.
#[test]
fn the_module_graph_follows_imports_and_re_exports() {
    let dir = std::env::temp_dir().join(format!("attn-tidy-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    std::fs::create_dir_all(dir.join("a")).unwrap();
    let write = |path: &str, text: &str| std::fs::write(dir.join(path), text).unwrap();
    write("lib.rs", "mod a;\nmod b;\npub use a::Thing;\n");
    write("a/mod.rs", "mod inner;\npub use inner::Thing;\n");
    write("a/inner.rs", "use crate::b::helper;\npub struct Thing;\n");
    write("b.rs", "pub fn helper() {}\n");
    assert!(Graph::of(&dir).cycles().is_empty());
    // b now uses the root's re-export of a::inner::Thing: a cycle b <-> a::inner.
    write("b.rs", "pub fn helper() -> crate::Thing { crate::Thing }\n");
    assert_eq!(
        Graph::of(&dir).cycles(),
        vec![vec!["a::inner".to_string(), "b".to_string()]]
    );
    // A `use` inside a function and a grouped tree count too; comments and strings do not.
    write(
        "b.rs",
        "// use crate::a::Thing;\npub fn helper() { let _ = \"crate::a::Thing\"; }\n",
    );
    assert!(Graph::of(&dir).cycles().is_empty());
    write("b.rs", "pub fn helper() { use crate::{a::{Thing}}; }\n");
    assert_eq!(Graph::of(&dir).cycles().len(), 1);
    // `super` inside an inline module stays in the file.
    write(
        "b.rs",
        "pub fn helper() {}\nmod x86 { use super::helper; }\n",
    );
    assert!(Graph::of(&dir).cycles().is_empty());
    std::fs::remove_dir_all(&dir).ok();
}

/// The repository files a comment names: tokens ending in `.rs`, `.md`, `.sh` or `.py` after a
/// name, stripped of the punctuation around them (URLs, globs and item paths left out).
fn files_named_in(comment: &str) -> Vec<String> {
    comment
        .split(|c: char| c.is_whitespace() || "`()[]\"',;".contains(c))
        .map(|t| t.trim_end_matches(['.', ':', '!', '?']))
        .filter(|t| !t.contains("://") && !t.contains('*') && !t.contains("::"))
        .filter(|t| t.chars().next().is_some_and(char::is_alphanumeric))
        .filter(|t| [".rs", ".md", ".sh", ".py"].iter().any(|e| t.ends_with(e)))
        .map(str::to_string)
        .collect()
}

/// Every comment of the Rust sources names only files the repository has (a file's own name,
/// or a path that some file's path ends with): no pointer to a file that was moved or never
/// was here.
#[test]
fn comments_name_only_files_that_exist() {
    let tree = tree_paths();
    let mut missing = Vec::new();
    for dir in [
        "attn-dsl",
        "attn-macros",
        "codegen",
        "attn-runtime",
        "src",
        "tests",
        "benches",
        "examples",
    ] {
        // This file's own comments hold made-up names, as examples.
        let files = rust_files(&root().join(dir))
            .into_iter()
            .filter(|f| !f.ends_with("tests/api/tidy.rs"));
        for file in files {
            let text = std::fs::read_to_string(&file).unwrap();
            for (i, line) in text.lines().enumerate() {
                // Whole-line comments, doc comments among them (a `//` after code may be in a
                // string).
                let Some(comment) = line.trim_start().strip_prefix("//") else {
                    continue;
                };
                for name in files_named_in(comment) {
                    let found = tree
                        .iter()
                        .any(|p| p == &name || p.ends_with(&format!("/{name}")));
                    if !found {
                        let rel = file.strip_prefix(root()).unwrap().display().to_string();
                        missing.push(format!("{rel}:{}: {name}", i + 1));
                    }
                }
            }
        }
    }
    assert_eq!(
        missing,
        Vec::<String>::new(),
        "comments name files that do not exist"
    );
}

#[test]
fn the_comment_reader_finds_file_names() {
    assert_eq!(
        files_named_in(
            "/ see docs/semantics.md, \"At the edges\"; `tests/cli/main.rs` (and mod.rs)."
        ),
        ["docs/semantics.md", "tests/cli/main.rs", "mod.rs"]
    );
    assert!(files_named_in("/ https://example.com/a.md, crate::x.rs, *.rs, a string").is_empty());
}

/// The library and attnc sources outside their tests: each file's path relative to the
/// root, and its text up to `#[cfg(test)]`.
fn library_sources() -> Vec<(String, String)> {
    let dirs = [
        "attn-dsl/src",
        "attn-macros/src",
        "codegen/src",
        "attn-runtime/src",
        "attn-py/src",
        "src",
    ];
    dirs.iter()
        .flat_map(|dir| rust_files(&root().join(dir)))
        .map(|file| {
            let text = std::fs::read_to_string(&file).unwrap();
            let outside_tests = text.split("#[cfg(test)]").next().unwrap().to_string();
            let rel = file.strip_prefix(root()).unwrap().display().to_string();
            (rel, outside_tests)
        })
        .collect()
}

/// Every `ATTN_*` environment setting is read in `codegen/src/settings.rs`, where each has its
/// exact spellings: no other library or attnc source reads the environment by such a name.
#[test]
fn attn_settings_are_read_in_settings_rs_alone() {
    let mut readers = Vec::new();
    for (rel, text) in library_sources() {
        if rel.ends_with("codegen/src/settings.rs") {
            continue;
        }
        for (i, line) in text.lines().enumerate() {
            let read = line.contains("env::var");
            if read && !line.trim_start().starts_with("//") && line.contains("\"ATTN_") {
                readers.push(format!("{rel}:{}", i + 1));
            }
        }
    }
    assert_eq!(
        readers,
        Vec::<String>::new(),
        "ATTN_* read outside settings.rs"
    );
}

/// The functions of a source text and their lengths in lines, from the line of `fn` to the
/// line of the closing brace: `(name, first line, lines)`. Comments, strings (raw ones too)
/// and char literals are passed over, so braces inside them do not count.
fn function_lengths(text: &str) -> Vec<(String, usize, usize)> {
    let chars: Vec<char> = text.chars().collect();
    let (mut out, mut open) = (Vec::new(), Vec::<(String, usize, usize)>::new());
    let (mut i, mut line, mut depth) = (0, 1, 0usize);
    let mut pending: Option<(String, usize)> = None;
    let at = |i: usize, s: &str| {
        s.chars()
            .enumerate()
            .all(|(k, c)| chars.get(i + k) == Some(&c))
    };
    while i < chars.len() {
        let c = chars[i];
        if c == '\n' {
            line += 1;
        }
        if at(i, "//") {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
            continue;
        }
        if at(i, "/*") {
            i += 2;
            while i < chars.len() && !at(i, "*/") {
                line += usize::from(chars[i] == '\n');
                i += 1;
            }
            i += 2;
            continue;
        }
        let raw = (c == 'r' || c == 'b')
            && {
                let mut k = i + 1 + usize::from(c == 'b' && chars.get(i + 1) == Some(&'r'));
                while chars.get(k) == Some(&'#') {
                    k += 1;
                }
                chars.get(k) == Some(&'"') && (k > i + 1 || c == 'r')
            }
            && (i == 0 || !(chars[i - 1].is_alphanumeric() || chars[i - 1] == '_'));
        if raw {
            let mut k = i + 1;
            while chars[k] != '"' {
                k += 1;
            }
            let hashes = chars[i..k].iter().filter(|&&h| h == '#').count();
            let close: String = std::iter::once('"')
                .chain(std::iter::repeat_n('#', hashes))
                .collect();
            i = k + 1;
            while i < chars.len() && !at(i, &close) {
                line += usize::from(chars[i] == '\n');
                i += 1;
            }
            i += close.len();
            continue;
        }
        if c == '"' {
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                if chars[i] == '\\' {
                    i += 1;
                }
                line += usize::from(chars.get(i) == Some(&'\n'));
                i += 1;
            }
            i += 1;
            continue;
        }
        if c == '\'' {
            // A char literal ('x', '\n', '\''); otherwise a lifetime.
            if chars.get(i + 1) == Some(&'\\') {
                i += 2;
                while i < chars.len() && chars[i] != '\'' {
                    i += 1;
                }
                i += 1;
                continue;
            }
            if chars.get(i + 2) == Some(&'\'') {
                i += 3;
                continue;
            }
        }
        let word_start = i == 0 || !(chars[i - 1].is_alphanumeric() || chars[i - 1] == '_');
        if word_start && at(i, "fn ") {
            let name: String = chars[i + 3..]
                .iter()
                .take_while(|c| c.is_alphanumeric() || **c == '_')
                .collect();
            if !name.is_empty() {
                pending = Some((name, line));
            }
        }
        match c {
            ';' if pending.is_some() => {
                // A declaration without a body (a trait's), unless inside its own signature.
                pending = None;
            }
            '{' => {
                depth += 1;
                if let Some((name, start)) = pending.take() {
                    open.push((name, start, depth));
                }
            }
            '}' => {
                if open.last().is_some_and(|o| o.2 == depth) {
                    let (name, start, _) = open.pop().unwrap();
                    out.push((name, start, line - start + 1));
                }
                depth = depth.saturating_sub(1);
            }
            _ => {}
        }
        i += 1;
    }
    out
}

#[test]
fn the_function_reader_measures_bodies() {
    let text = "fn a() {\n    let s = \"}\";\n    let c = '}';\n}\ntrait T {\n    fn b(&self);\n}\n\
                fn c<'a>(x: &'a str) -> &'a str {\n    // }\n    let r = r#\"}\"#;\n    x\n}\n";
    let got: Vec<(String, usize, usize)> = function_lengths(text);
    assert_eq!(got, [("a".to_string(), 1, 4), ("c".to_string(), 8, 5)]);
}

/// No function of the library and attnc sources is over 150 lines (tests are left out).
#[test]
fn no_function_is_over_150_lines() {
    let mut long = Vec::new();
    for (rel, text) in library_sources() {
        for (name, start, lines) in function_lengths(&text) {
            if lines > 150 {
                long.push(format!("{rel}:{start}: {name}, {lines} lines"));
            }
        }
    }
    assert_eq!(long, Vec::<String>::new(), "functions over 150 lines");
}

/// The integration-test binaries of one package folder: each `tests/<name>.rs` and each
/// `tests/<name>/main.rs` is one binary, as cargo finds them.
fn test_binaries(package: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(package.join("tests")) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for entry in entries {
        let path = entry.unwrap().path();
        let binary = if path.is_dir() {
            Some(path.join("main.rs")).filter(|main| main.exists())
        } else {
            Some(path).filter(|file| file.extension().is_some_and(|e| e == "rs"))
        };
        if let Some(binary) = binary {
            out.push(binary.strip_prefix(root()).unwrap().display().to_string());
        }
    }
    out.sort();
    out
}

/// At most 8 integration-test binaries in the workspace, since each links the whole stack:
/// one per crate or area, with modules inside (ARCHITECTURE.md, "Where a test goes").
#[test]
fn at_most_eight_test_binaries() {
    let manifest = std::fs::read_to_string(root().join("Cargo.toml")).unwrap();
    let members: toml::Table = toml::from_str(&manifest).unwrap();
    let members = members["workspace"]["members"].as_array().unwrap();
    let mut binaries = test_binaries(&root());
    for member in members {
        binaries.extend(test_binaries(&root().join(member.as_str().unwrap())));
    }
    assert!(
        binaries.len() <= 8,
        "{} test binaries: {binaries:?}",
        binaries.len()
    );
    // The reader sees the binaries there are (the facade's own tests among them).
    assert!(
        binaries.contains(&"tests/api/main.rs".to_string()),
        "{binaries:?}"
    );
}

/// No file of the library and attnc sources is over 800 lines before its tests: a file that
/// grows past that holds more than one concern, and splits along its seams.
#[test]
fn no_source_file_is_over_800_lines() {
    let long: Vec<String> = library_sources()
        .into_iter()
        .map(|(rel, text)| (rel, text.lines().count()))
        .filter(|(_, lines)| *lines > 800)
        .map(|(rel, lines)| format!("{rel}: {lines} lines"))
        .collect();
    assert_eq!(long, Vec::<String>::new(), "files over 800 lines");
}
