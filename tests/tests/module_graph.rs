//! The module graph of every crate has no cycles: within each module, its child modules depend
//! on one another in one direction only (a layer uses the ones below it, never one above).
//!
//! Read from the sources: each `crate::`, `super::` and `self::` path outside test code,
//! `use` trees included, is resolved to the module it names (through `pub use` re-exports), and
//! a path from module `a::b::x` to `a::c::y` is an edge `b -> c` among the children of `a`. A
//! child naming its ancestors' own items is not an edge (a parent assembles its children).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

type ModPath = Vec<String>;

/// The source roots checked, relative to the workspace.
const ROOTS: &[&str] = &[
    "portability-verbs/src",
    "portability-verbs/sync/src",
    "madeleine/src",
    "sockets-compat/src",
    "sockets-compat/preload/src",
    "sockets-compat/exs-c/src",
    "benches/src",
    "benches/src/bin/stack_bench",
    "tests/src",
];

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the workspace").to_path_buf()
}

/// Every module file under `root` (a `bin` directory holds other crates' roots).
fn modules(root: &Path) -> BTreeMap<ModPath, PathBuf> {
    fn walk(dir: &Path, root: &Path, out: &mut BTreeMap<ModPath, PathBuf>) {
        for entry in std::fs::read_dir(dir).expect("a source directory") {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                if !(dir == root && path.file_name().is_some_and(|n| n == "bin")) {
                    walk(&path, root, out);
                }
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path.strip_prefix(root).expect("under the root").with_extension("");
            let mut m: ModPath = rel.iter().map(|c| c.to_string_lossy().into_owned()).collect();
            if matches!(m.last().map(String::as_str), Some("lib" | "main" | "mod")) {
                m.pop();
            }
            out.insert(m, path);
        }
    }
    let mut out = BTreeMap::new();
    walk(root, root, &mut out);
    out
}

/// The code of a file without its tests and comments.
fn code(path: &Path) -> String {
    let text = std::fs::read_to_string(path).expect("a readable source file");
    let mut out = String::new();
    for line in text.lines() {
        if line.starts_with("#[cfg(test)]") {
            break;
        }
        out.push_str(line.split("//").next().unwrap_or(""));
        out.push('\n');
    }
    out
}

fn ident_at(s: &[u8], i: usize) -> Option<(String, usize)> {
    let mut j = i;
    while j < s.len() && s[j].is_ascii_whitespace() {
        j += 1;
    }
    if j < s.len() && s[j] == b'*' {
        return Some(("*".into(), j + 1));
    }
    let start = j;
    while j < s.len() && (s[j].is_ascii_alphanumeric() || s[j] == b'_') {
        j += 1;
    }
    (j > start).then(|| (String::from_utf8_lossy(&s[start..j]).into_owned(), j))
}

fn skip_ws(s: &[u8], mut i: usize) -> usize {
    while i < s.len() && s[i].is_ascii_whitespace() {
        i += 1;
    }
    i
}

/// The paths of a use tree (or a plain path) starting at `i`: `a::{b, c::d}` gives `[a, b]`,
/// `[a, c, d]`.
fn use_tree(s: &[u8], i: usize) -> Vec<ModPath> {
    let i = skip_ws(s, i);
    if i < s.len() && s[i] == b'{' {
        let mut out = Vec::new();
        let mut j = i + 1;
        let mut depth = 0;
        let mut item_start = j;
        while j < s.len() {
            match s[j] {
                b'{' => depth += 1,
                b'}' if depth == 0 => {
                    out.extend(use_tree(s, item_start));
                    return out;
                }
                b'}' => depth -= 1,
                b',' if depth == 0 => {
                    out.extend(use_tree(s, item_start));
                    item_start = j + 1;
                }
                _ => {}
            }
            j += 1;
        }
        return out;
    }
    let Some((name, j)) = ident_at(s, i) else { return vec![vec![]] };
    let k = skip_ws(s, j);
    if s[k..].starts_with(b"::") {
        return use_tree(s, k + 2).into_iter().map(|p| std::iter::once(name.clone()).chain(p).collect()).collect();
    }
    vec![vec![name]]
}

/// The absolute paths that `crate::`, `super::` and `self::` paths in `text` (of module
/// `here`) name.
fn references(text: &str, here: &ModPath) -> Vec<ModPath> {
    let s = text.as_bytes();
    let mut out = Vec::new();
    for (i, _) in text.match_indices("::") {
        let start = s[..i].iter().rposition(|c| !(c.is_ascii_alphanumeric() || *c == b'_')).map_or(0, |p| p + 1);
        if start > 0 && s[start - 1] == b':' {
            continue;
        }
        let mut base: ModPath = match &text[start..i] {
            "crate" => vec![],
            "self" => here.clone(),
            "super" => here[..here.len().saturating_sub(1)].to_vec(),
            _ => continue,
        };
        let mut j = i + 2;
        while text[j..].starts_with("super::") {
            base.pop();
            j += "super::".len();
        }
        for p in use_tree(s, j) {
            let mut full = base.clone();
            full.extend(p.into_iter().filter(|x| x != "self" && x != "*"));
            out.push(full);
        }
    }
    out
}

/// `pub use` re-exports: (module, name) -> what it names.
fn reexports(
    mods: &BTreeMap<ModPath, PathBuf>,
    texts: &HashMap<ModPath, String>,
) -> HashMap<(ModPath, String), ModPath> {
    let mut out = HashMap::new();
    for here in mods.keys() {
        let text = &texts[here];
        for (i, _) in text.match_indices("use ") {
            let before = text[..i].trim_end();
            if !(before.ends_with("pub") || before.ends_with(')') && before.contains("pub(")) {
                continue;
            }
            let stmt = &text[i + 4..];
            let stmt = &stmt[..stmt.find(';').unwrap_or(stmt.len())];
            let rooted = ["crate::", "super::", "self::"].iter().any(|p| stmt.trim_start().starts_with(p));
            let stmt = if rooted { stmt.to_string() } else { format!("self::{}", stmt.trim_start()) };
            for p in references(&stmt, here) {
                let Some(last) = p.last().cloned() else { continue };
                let alias = stmt
                    .split(&format!("{last} as "))
                    .nth(1)
                    .and_then(|rest| ident_at(rest.as_bytes(), 0))
                    .map_or(last, |(a, _)| a);
                out.insert((here.clone(), alias), p);
            }
        }
    }
    out
}

/// The module a path names: its longest prefix that is a module, after re-exports.
fn resolve(mut t: ModPath, mods: &BTreeMap<ModPath, PathBuf>, rx: &HashMap<(ModPath, String), ModPath>) -> ModPath {
    for _ in 0..8 {
        let mut k = t.len();
        while k > 0 && !mods.contains_key(&t[..k]) {
            k -= 1;
        }
        match t.get(k).and_then(|name| rx.get(&(t[..k].to_vec(), name.clone()))) {
            Some(target) => t = target.iter().cloned().chain(t[k + 1..].iter().cloned()).collect(),
            None => return t[..k].to_vec(),
        }
    }
    t
}

/// Cycles among the children of each module of the crate at `root`, each with the references
/// that make its edges.
fn cycles(root: &Path) -> Vec<String> {
    let mods = modules(root);
    let texts: HashMap<ModPath, String> = mods.iter().map(|(m, p)| (m.clone(), code(p))).collect();
    let rx = reexports(&mods, &texts);
    // parent -> child -> (child it uses -> an example reference)
    let mut edges: BTreeMap<ModPath, BTreeMap<String, BTreeMap<String, String>>> = BTreeMap::new();
    for here in mods.keys() {
        for t in references(&texts[here], here) {
            let shown = t.join("::");
            let t = resolve(t, &mods, &rx);
            let n = here.iter().zip(&t).take_while(|(a, b)| a == b).count();
            if n == here.len() || n == t.len() {
                continue;
            }
            edges
                .entry(here[..n].to_vec())
                .or_default()
                .entry(here[n].clone())
                .or_default()
                .entry(t[n].clone())
                .or_insert_with(|| format!("{} -> {shown}", here.join("::")));
        }
    }
    let mut found = Vec::new();
    for (parent, graph) in &edges {
        // Depth-first search for a back edge.
        fn visit(
            v: &str,
            graph: &BTreeMap<String, BTreeMap<String, String>>,
            state: &mut HashMap<String, u8>,
            stack: &mut Vec<String>,
            found: &mut Option<Vec<String>>,
        ) {
            state.insert(v.to_string(), 1);
            stack.push(v.to_string());
            for w in graph.get(v).map(|m| m.keys().cloned().collect::<Vec<_>>()).unwrap_or_default() {
                if found.is_some() {
                    return;
                }
                match state.get(&w) {
                    Some(1) => {
                        let from = stack.iter().position(|x| *x == w).expect("on the stack");
                        *found = Some(stack[from..].iter().cloned().chain([w]).collect());
                    }
                    Some(_) => {}
                    None => visit(&w, graph, state, stack, found),
                }
            }
            stack.pop();
            state.insert(v.to_string(), 2);
        }
        let mut state = HashMap::new();
        for v in graph.keys() {
            if state.contains_key(v) {
                continue;
            }
            let mut cycle = None;
            visit(v, graph, &mut state, &mut Vec::new(), &mut cycle);
            if let Some(c) = cycle {
                let why: Vec<_> = c.windows(2).map(|w| graph[&w[0]][&w[1]].clone()).collect();
                found.push(format!(
                    "{} in {}: {} ({})",
                    root.display(),
                    if parent.is_empty() { "the crate root".into() } else { parent.join("::") },
                    c.join(" -> "),
                    why.join("; ")
                ));
                break;
            }
        }
    }
    found
}

#[test]
fn no_crate_has_a_module_cycle() {
    let ws = workspace();
    let found: Vec<String> = ROOTS.iter().flat_map(|r| cycles(&ws.join(r))).collect();
    assert!(found.is_empty(), "module cycles:\n{}", found.join("\n"));
}

/// The checker itself finds a cycle, through a `use` tree and a re-export, and ignores a
/// child naming its parent's items.
#[test]
fn the_checker_finds_a_cycle_through_use_trees_and_reexports() {
    let dir = std::env::temp_dir().join(format!("module-graph-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("b")).unwrap();
    std::fs::write(dir.join("lib.rs"), "mod a;\nmod b;\npub use b::Thing;\npub struct Root;\n").unwrap();
    std::fs::write(dir.join("a.rs"), "use crate::{Root, Thing};\n").unwrap();
    std::fs::write(dir.join("b/mod.rs"), "mod c;\npub use c::Thing;\nuse crate::Root;\n").unwrap();
    std::fs::write(dir.join("b/c.rs"), "pub struct Thing;\n").unwrap();
    assert!(cycles(&dir).is_empty(), "a -> b only");
    std::fs::write(dir.join("b/c.rs"), "pub struct Thing;\nfn f() { super::super::a::g() }\n// crate::b::x\n").unwrap();
    let found = cycles(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].contains("a -> b -> a") || found[0].contains("b -> a -> b"), "{found:?}");
}
