//! The docs cannot rot: every `ferry ...` command line in README.md and docs/*.md (in
//! fenced code blocks and in inline code) names a real subcommand, and every flag it
//! uses is one of that subcommand's flags, as `ferry SUB... --help` lists them.
//!
//! What counts as a command line: a code-block line (continuations with `\` joined, a
//! `$ ` prompt and a trailing `# comment` taken off, split at ` | `, ` & `, `&&`, `||`
//! and `;`) or an inline code span whose first word is `ferry` (or a path ending in
//! `/ferry`, after `sudo`, `env`, `VAR=value` or `ExecStart=`). Placeholders (FILE, URI, `[...]`)
//! are positionals and not checked; `serve/copy` or `init|list` in the place of a
//! subcommand checks each one; a flag is checked by its name (`--map=CONTEXT` as `--map`,
//! `[-U]` as `-U`, `-vv` and `-C4` as clusters of short flags).

use crate::common::ferry_bin;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

/// One command line found in a document.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Found {
    file: String,
    line: usize,
    /// The words after `ferry`.
    words: Vec<String>,
}

/// Splits `s` into words as a shell would, quotes removed (no expansion).
fn shell_words(s: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut cur = String::new();
    let mut in_word = false;
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\'' => {
                in_word = true;
                for d in chars.by_ref() {
                    if d == '\'' {
                        break;
                    }
                    cur.push(d);
                }
            }
            '"' => {
                in_word = true;
                while let Some(d) = chars.next() {
                    match d {
                        '"' => break,
                        '\\' => cur.extend(chars.next()),
                        _ => cur.push(d),
                    }
                }
            }
            '\\' => {
                in_word = true;
                cur.extend(chars.next());
            }
            c if c.is_whitespace() => {
                if in_word {
                    words.push(std::mem::take(&mut cur));
                    in_word = false;
                }
            }
            c => {
                in_word = true;
                cur.push(c);
            }
        }
    }
    if in_word {
        words.push(cur);
    }
    words
}

/// Cuts a shell line at unquoted ` | `, ` & `, `&&`, `||` and `;`, and drops an unquoted
/// `# comment` (a `#` that starts a word).
fn shell_segments(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let (mut single, mut double) = (false, false);
    let chars: Vec<char> = line.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let at_word_start = i == 0 || chars[i - 1].is_whitespace();
        if !single && !double {
            if c == '#' && at_word_start {
                break;
            }
            let next = chars.get(i + 1).copied();
            let two = matches!((c, next), ('&', Some('&')) | ('|', Some('|')));
            // `|` and `&` (background) as words of their own.
            let pipe = matches!(c, '|' | '&') && at_word_start && next.is_none_or(char::is_whitespace);
            if two || pipe || c == ';' {
                out.push(std::mem::take(&mut cur));
                i += if two { 2 } else { 1 };
                continue;
            }
        }
        match c {
            '\'' if !double => single = !single,
            '"' if !single => double = !double,
            '\\' if !single => {
                cur.push(c);
                i += 1;
                if let Some(&d) = chars.get(i) {
                    cur.push(d);
                }
                i += 1;
                continue;
            }
            _ => {}
        }
        cur.push(c);
        i += 1;
    }
    out.push(cur);
    out
}

/// The words after `ferry` when `words` runs ferry, else None.
fn ferry_words(mut words: &[String]) -> Option<Vec<String>> {
    loop {
        let w = words.first()?;
        let is_assignment = w.split_once('=').is_some_and(|(k, _)| {
            !k.is_empty() && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') && k != "ExecStart"
        });
        if matches!(w.as_str(), "sudo" | "env" | "exec" | "time" | "$" | "!") || is_assignment {
            words = &words[1..];
            continue;
        }
        let w = w.strip_prefix("ExecStart=").unwrap_or(w).trim_start_matches('-');
        return (w == "ferry" || w.ends_with("/ferry")).then(|| words[1..].to_vec());
    }
}

/// Every `ferry ...` command line of a Markdown text.
fn extract(file: &str, text: &str) -> Vec<Found> {
    let mut found = Vec::new();
    let lines: Vec<&str> = text.lines().collect();
    let mut prose = String::new();
    // Byte offset in `prose` of each line's start, to give inline spans their line.
    let mut prose_lines: Vec<(usize, usize)> = Vec::new();
    let mut fence: Option<String> = None;
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        let trimmed = line.trim_start();
        if let Some(f) = &fence {
            if trimmed.starts_with(f.as_str())
                && trimmed.trim_start_matches(f.chars().next().unwrap()).trim().is_empty()
            {
                fence = None;
                i += 1;
                continue;
            }
            // A code line, with its continuations joined.
            let start = i;
            let mut joined = String::new();
            let mut l = line;
            loop {
                let t = l.trim_end();
                match t.strip_suffix('\\') {
                    Some(head) if i + 1 < lines.len() => {
                        joined.push_str(head);
                        joined.push(' ');
                        i += 1;
                        l = lines[i];
                    }
                    _ => {
                        joined.push_str(t);
                        break;
                    }
                }
            }
            let cmd = joined.trim_start();
            let cmd = cmd.strip_prefix("$ ").unwrap_or(cmd);
            for seg in shell_segments(cmd) {
                if let Some(words) = ferry_words(&shell_words(&seg)) {
                    found.push(Found { file: file.to_string(), line: start + 1, words });
                }
            }
            i += 1;
            continue;
        }
        if trimmed.starts_with("```") || trimmed.starts_with("~~~") {
            let c = trimmed.chars().next().unwrap();
            fence = Some(trimmed.chars().take_while(|&d| d == c).collect());
            i += 1;
            continue;
        }
        prose_lines.push((prose.len(), i + 1));
        prose.push_str(line);
        prose.push('\n');
        i += 1;
    }
    // Inline code spans of the prose: a run of N backticks up to the next run of N.
    let bytes = prose.as_bytes();
    let mut p = 0;
    while p < bytes.len() {
        if bytes[p] != b'`' {
            p += 1;
            continue;
        }
        let n = bytes[p..].iter().take_while(|&&b| b == b'`').count();
        let body_start = p + n;
        let mut q = body_start;
        let mut end = None;
        while q < bytes.len() {
            if bytes[q] == b'`' {
                let m = bytes[q..].iter().take_while(|&&b| b == b'`').count();
                if m == n {
                    end = Some(q);
                    break;
                }
                q += m;
            } else if bytes[q] == b'\n' && bytes.get(q + 1) == Some(&b'\n') {
                break; // spans do not cross paragraphs
            } else {
                q += 1;
            }
        }
        let Some(end) = end else {
            p = body_start;
            continue;
        };
        let span = prose[body_start..end].replace('\n', " ");
        let line = prose_lines.iter().rev().find(|(o, _)| *o <= p).map_or(1, |(_, l)| *l);
        for seg in shell_segments(span.trim()) {
            if let Some(words) = ferry_words(&shell_words(&seg)) {
                found.push(Found { file: file.to_string(), line, words });
            }
        }
        p = end + n;
    }
    found.sort_by_key(|f| f.line);
    found
}

/// What `ferry PATH... --help` says a (sub)command takes.
#[derive(Debug, Default, Clone)]
struct Spec {
    /// Flag (`-C`, `--connections`) to whether it takes a value in the next word.
    flags: HashMap<String, bool>,
    subcommands: Vec<String>,
}

/// Reads flags and subcommands from a help text: clap's (`  -C, --connections <N>  ...`,
/// `[aliases: ...]`, `Commands:`) and `ferry bitmap`'s own.
fn parse_help(help: &str) -> Spec {
    let mut spec = Spec::default();
    let mut in_commands = false;
    for line in help.lines() {
        if line.trim_end().ends_with(':') && !line.starts_with(' ') {
            in_commands = line.trim_end() == "Commands:";
            continue;
        }
        if in_commands {
            if let Some(name) = line.split_whitespace().next() {
                spec.subcommands.push(name.to_string());
            }
            continue;
        }
        let t = line.trim_start();
        if !t.starts_with('-') || t.len() == line.len() {
            continue;
        }
        // The flag column ends at the first run of two spaces.
        let column = t.split("  ").next().unwrap_or("");
        let mut names = Vec::new();
        let mut value = false;
        for w in column.split(|c: char| c.is_whitespace() || c == ',') {
            if w.starts_with('-') && w.len() > 1 {
                let name = w.split(['=', '[', '.']).next().unwrap_or(w);
                names.push(name.to_string());
                if w.contains("[=") {
                    continue; // an optional value, given with `=`
                }
            } else if w.starts_with('<') || (!w.is_empty() && w.chars().all(|c| c.is_ascii_uppercase() || c == '_')) {
                value = true;
            } else if w.starts_with("[<") {
                // An optional value: not taken from the next word.
            }
        }
        // Visible aliases, in either of clap's spellings.
        for tag in ["[aliases: ", "[alias: ", "[short aliases: ", "[short alias: "] {
            if let Some(rest) = line.split(tag).nth(1) {
                let list = rest.split(']').next().unwrap_or("");
                for a in list.split(',').map(str::trim).filter(|a| !a.is_empty()) {
                    let a = if a.starts_with('-') {
                        a.to_string()
                    } else if tag.starts_with("[short") {
                        format!("-{a}")
                    } else {
                        format!("--{a}")
                    };
                    names.push(a);
                }
            }
        }
        for n in names {
            spec.flags.insert(n, value);
        }
    }
    for f in ["-h", "--help"] {
        spec.flags.entry(f.to_string()).or_insert(false);
    }
    spec
}

/// Help texts, asked once per subcommand path.
struct Helps {
    bin: PathBuf,
    cache: HashMap<Vec<String>, Option<Spec>>,
}

impl Helps {
    fn new(bin: PathBuf) -> Helps {
        Helps { bin, cache: HashMap::new() }
    }

    /// The spec of `ferry PATH...`, or None when that is no command (its `--help` fails).
    fn spec(&mut self, path: &[String]) -> Option<Spec> {
        if let Some(s) = self.cache.get(path) {
            return s.clone();
        }
        let out = Command::new(&self.bin).args(path).arg("--help").env("RUST_LOG", "off").output().unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        // `ferry bitmap --help` prints its own usage (exit 1); any other failure means
        // the path is no command.
        let ok = out.status.success() || text.contains("usage: ferry ");
        let spec = ok.then(|| {
            let mut s = parse_help(&text);
            if path.is_empty() {
                s.flags.insert("-V".into(), false);
                s.flags.insert("--version".into(), false);
            }
            s
        });
        self.cache.insert(path.to_vec(), spec.clone());
        spec
    }
}

/// Takes a documentation word apart: `[--map[=CONTEXT]]` is the flag `--map`, `[-U]`
/// is `-U`; anything else is not a flag (None).
fn flag_of(word: &str) -> Option<&str> {
    let w = word.trim_start_matches(['[', '(']);
    if !w.starts_with('-') || w == "-" || w == "--" || w.starts_with("-[") {
        return None;
    }
    let w = w.trim_end_matches([']', ')', ',', '.', ':', '`']);
    let w = w.split(['=', '[']).next().unwrap_or(w);
    // `-1`, `--` followed by nothing, `-...`: not flags.
    let name = w.trim_start_matches('-');
    if name.is_empty() || !name.chars().next().unwrap().is_ascii_alphabetic() {
        return None;
    }
    Some(w)
}

/// Checks one command line; returns what is wrong with it.
fn check(helps: &mut Helps, words: &[String]) -> Vec<String> {
    let mut problems = Vec::new();
    check_from(helps, Vec::new(), words, &mut problems);
    problems
}

fn check_from(helps: &mut Helps, path: Vec<String>, words: &[String], problems: &mut Vec<String>) {
    let shown = |p: &[String]| if p.is_empty() { "ferry".to_string() } else { format!("ferry {}", p.join(" ")) };
    let Some(spec) = helps.spec(&path) else {
        problems.push(format!("`{}` is no ferry command", shown(&path)));
        return;
    };
    let mut i = 0;
    while i < words.len() {
        let w = &words[i];
        i += 1;
        if w == "--" {
            return;
        }
        if let Some(flag) = flag_of(w) {
            let inline_value = w.contains('=');
            let takes_value = if flag.starts_with("--") {
                match spec.flags.get(flag) {
                    Some(v) => *v,
                    None => {
                        problems.push(format!("`{}` has no flag {flag}", shown(&path)));
                        false
                    }
                }
            } else {
                // A cluster of short flags: -vv, -rU, -C4 (a value flag takes the rest).
                let mut takes = false;
                for (k, c) in flag.char_indices().skip(1) {
                    let f = format!("-{c}");
                    match spec.flags.get(&f) {
                        Some(true) => {
                            takes = k + c.len_utf8() == flag.len();
                            break;
                        }
                        Some(false) => {}
                        None => {
                            problems.push(format!("`{}` has no flag {f}", shown(&path)));
                            break;
                        }
                    }
                }
                takes
            };
            if takes_value && !inline_value {
                i += 1;
            }
            continue;
        }
        // A positional: a subcommand where the command has them.
        if spec.subcommands.is_empty() {
            continue;
        }
        let w = w.trim_matches(['[', ']', '(', ')', '<', '>', '`', ',']);
        let placeholder = w.is_empty() || w.chars().all(|c| !c.is_ascii_lowercase()) || w.contains("...");
        if placeholder {
            return; // `ferry COMMAND --help`, `ferry repo ...`: nothing to check
        }
        for alt in w.split(['/', '|']).filter(|a| !a.is_empty()) {
            let mut p = path.clone();
            p.push(alt.to_string());
            check_from(helps, p, &words[i..], problems);
        }
        return;
    }
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap()
}

/// README.md and docs/*.md, relative names and texts.
fn documents() -> Vec<(String, String)> {
    let root = repo_root();
    let mut files = vec![root.join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "md"))
                // The benchmark history quotes command lines as they were on its day.
                .filter(|p| !p.ends_with("benchmarks-history.md"))
                .collect()
        })
        .unwrap_or_default();
    docs.sort();
    files.extend(docs);
    files
        .into_iter()
        .map(|p| {
            let name = p.strip_prefix(&root).unwrap_or(&p).display().to_string();
            let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            (name, text)
        })
        .collect()
}

/// Each problem of the documents' command lines, as `FILE:LINE: ...`.
fn problems_in(helps: &mut Helps, docs: &[(String, String)]) -> (usize, Vec<String>) {
    let mut count = 0;
    let mut out = Vec::new();
    for (name, text) in docs {
        for f in extract(name, text) {
            count += 1;
            for p in check(helps, &f.words) {
                out.push(format!("{}:{}: {p} (in `ferry {}`)", f.file, f.line, f.words.join(" ")));
            }
        }
    }
    (count, out)
}

fn words(s: &[&str]) -> Vec<String> {
    s.iter().map(|w| w.to_string()).collect()
}

#[test]
fn extractor_finds_command_lines_in_blocks_and_inline_code() {
    let md = "Intro `ferry info --size URI` and `cargo build`.\n\
              ```sh\n\
              $ ferry copy -p \\\n  disk.img nbd://h/x   # a comment --not-a-flag\n\
              qemu-img info x | grep y && sudo ferry hash - | sort\n\
              FOO=1 /usr/bin/ferry serve -r 'a b.img'\n\
              ferry serve -U s x 2>&1 & ferry info -L u\n\
              ferry: error: output, not a command\n\
              ```\n\
              Wrapped `ferry serve\n-B b0` span; ``ferry bitmap --add` x``.\n";
    let f = extract("t.md", md);
    let got: Vec<(usize, Vec<String>)> = f.into_iter().map(|f| (f.line, f.words)).collect();
    assert_eq!(
        got,
        vec![
            (1, words(&["info", "--size", "URI"])),
            (3, words(&["copy", "-p", "disk.img", "nbd://h/x"])),
            (5, words(&["hash", "-"])),
            (6, words(&["serve", "-r", "a b.img"])),
            (7, words(&["serve", "-U", "s", "x", "2>&1"])),
            (7, words(&["info", "-L", "u"])),
            (10, words(&["serve", "-B", "b0"])),
            (11, words(&["bitmap", "--add`", "x"])),
        ]
    );
}

#[test]
fn help_parser_reads_flags_values_aliases_and_subcommands() {
    let help = "Usage: x\n\nCommands:\n  init  Make\n  list  The\n\nOptions:\n  \
                -C, --connections <N>  Connections [aliases: --conns]\n  \
                -k, --socket <PATH>  S [short aliases: -z]\n      \
                --map[=<CONTEXT>]  Map\n      --sparse [<BOOL>]  S\n  -r, --read-only  R\n    \
                -g, --granularity SIZE  its granularity\n";
    let s = parse_help(help);
    assert_eq!(s.subcommands, words(&["init", "list"]));
    for (f, v) in [
        ("-C", true),
        ("--connections", true),
        ("--conns", true),
        ("-z", true),
        ("--map", false),
        ("--sparse", false),
        ("-r", false),
        ("--read-only", false),
        ("-g", true),
        ("--granularity", true),
    ] {
        assert_eq!(s.flags.get(f), Some(&v), "{f}");
    }
}

/// The check is not trivially passing: made-up flags and subcommands are named with
/// their file and line, and real ones pass (against the real binary's help).
#[test]
fn checker_names_made_up_flags_and_subcommands() {
    let md = "```\n\
              ferry copy -p --sparse=false -C4 -vv src.img nbd://h/x\n\
              ferry copy --no-such-flag a b\n\
              ferry repo list --json REPO\n\
              ferry frobnicate x\n\
              ferry repo init --keep-last 3 R\n\
              ferry info -Z URI\n\
              ```\n\
              Also `ferry serve/copy --frob PATH` and `ferry info [--json] [--map[=CONTEXT]] URI`.\n";
    let mut helps = Helps::new(ferry_bin());
    let (count, problems) = problems_in(&mut helps, &[("t.md".to_string(), md.to_string())]);
    assert_eq!(count, 8, "{problems:#?}");
    assert_eq!(
        problems,
        vec![
            "t.md:3: `ferry copy` has no flag --no-such-flag (in `ferry copy --no-such-flag a b`)",
            "t.md:5: `ferry frobnicate` is no ferry command (in `ferry frobnicate x`)",
            "t.md:6: `ferry repo init` has no flag --keep-last (in `ferry repo init --keep-last 3 R`)",
            "t.md:7: `ferry info` has no flag -Z (in `ferry info -Z URI`)",
            "t.md:9: `ferry serve` has no flag --frob (in `ferry serve/copy --frob PATH`)",
            "t.md:9: `ferry copy` has no flag --frob (in `ferry serve/copy --frob PATH`)",
        ]
    );
}

/// Every `ferry ...` command line of README.md and docs/*.md exists.
#[test]
fn every_documented_command_line_exists() {
    let docs = documents();
    let mut helps = Helps::new(ferry_bin());
    let (count, problems) = problems_in(&mut helps, &docs);
    // README alone shows dozens: finding few means the extractor broke.
    assert!(count >= 20, "only {count} `ferry` command lines found in README.md and docs/*.md");
    assert!(problems.is_empty(), "command lines in the docs that ferry does not take:\n{}", problems.join("\n"));
}
