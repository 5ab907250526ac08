//! What ferry ships beside its binary: the man pages under man/ (current with the
//! command line, rendering without warnings), the shell completion scripts, and
//! `--version`'s features and library versions.

use crate::common::*;
use std::path::{Path, PathBuf};
use std::process::Command;

const REGENERATE: &str = "run `cargo run --release -p ferry -- generate-man man`";

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn ferry(args: &[&str]) -> Command {
    let mut c = Command::new(ferry_bin());
    c.args(args);
    c
}

/// The names of the files directly in `dir` ending in `.1`, sorted.
fn pages_in(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".1"))
        .collect();
    v.sort();
    v
}

/// The first line where `a` and `b` differ, for the failure message.
fn first_difference(a: &str, b: &str) -> String {
    let (mut la, mut lb) = (a.lines(), b.lines());
    for n in 1.. {
        match (la.next(), lb.next()) {
            (None, None) => return "only in line ends".into(),
            (x, y) if x != y => return format!("line {n}: committed {x:?}, generated {y:?}"),
            _ => {}
        }
    }
    unreachable!()
}

#[test]
fn pages_are_current() {
    let tmp = tempfile::tempdir().unwrap();
    let extra = repo_root().join("man/extra");
    run_ok(&mut ferry(&["generate-man", "--extra", extra.to_str().unwrap(), tmp.path().to_str().unwrap()]));
    let generated = pages_in(tmp.path());
    for page in ["ferry.1", "ferry-serve.1", "ferry-copy.1", "ferry-repo.1", "ferry-completions.1"] {
        assert!(generated.iter().any(|g| g == page), "generate-man wrote no {page}: {generated:?}");
    }
    let man = repo_root().join("man");
    for page in &generated {
        let new = std::fs::read_to_string(tmp.path().join(page)).unwrap();
        let old = std::fs::read_to_string(man.join(page))
            .unwrap_or_else(|_| panic!("man/{page} is missing: {REGENERATE}, and commit it"));
        assert!(
            old == new,
            "man/{page} is out of date with the command line or man/extra ({}): {REGENERATE}",
            first_difference(&old, &new)
        );
    }
    for page in pages_in(&man) {
        assert!(generated.contains(&page), "man/{page} is no page ferry generates: remove it ({REGENERATE})");
    }
    // The package installs man/*.1: the top of man/ holds the pages and extra/ only.
    for entry in std::fs::read_dir(&man).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        assert!(name.ends_with(".1") || name == "extra", "man/{name}: only pages (*.1) and extra/ belong in man/");
    }
}

#[test]
fn pages_render_without_warnings() {
    require("groff");
    let man = repo_root().join("man");
    let pages = pages_in(&man);
    assert!(pages.len() >= 10, "too few pages in man/: {pages:?}");
    for page in pages {
        let path = man.join(&page);
        let out = run(Command::new("groff").args(["-man", "-Tutf8", "-ww", "-z"]).arg(&path));
        assert!(out.status.success() && out.stderr.trim().is_empty(), "groff on man/{page}\n{}", out.describe());
        // On an 80-column terminal nothing sticks out (examples are not wrapped).
        let shown = run_ok(Command::new("groff").args(["-man", "-Tutf8", "-rLL=80n", "-P-cbou"]).arg(&path));
        for line in shown.stdout.lines() {
            assert!(line.chars().count() <= 80, "man/{page}: wider than 80 columns: {line:?}");
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let name = page.trim_end_matches(".1");
        let escaped = name.replace('-', "\\-");
        assert!(text.contains(&format!(".SH NAME\n{escaped} \\- ")), "man/{page}: no NAME line for {name}");
        for section in ["NAME", "SYNOPSIS", "DESCRIPTION", "SEE ALSO"] {
            assert!(
                text.contains(&format!(".SH {section}\n")) || text.contains(&format!(".SH \"{section}\"\n")),
                "man/{page}: no {section} section"
            );
        }
    }
}

/// `ferry completions SHELL`'s script.
fn completion(shell: &str) -> String {
    run_ok(&mut ferry(&["completions", shell])).stdout
}

const COMMANDS: [&str; 9] = ["serve", "copy", "info", "hash", "bench", "bitmap", "backup", "repo", "completions"];

#[test]
fn bash_completion_loads_and_completes() {
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("ferry.bash");
    std::fs::write(&script, completion("bash")).unwrap();
    // Sourced, it registers a completion for ferry, and its function completes
    // subcommands and flags as bash would call it.
    let probe = r#"source "$1" || exit 1
complete -p ferry || exit 1
COMP_WORDS=(ferry se); COMP_CWORD=1; _ferry ferry se ferry
echo "commands: ${COMPREPLY[*]}"
COMP_WORDS=(ferry serve --tls-); COMP_CWORD=2; _ferry ferry --tls- serve
echo "flags: ${COMPREPLY[*]}""#;
    let out = run_ok(Command::new("bash").args(["-c", probe, "probe"]).arg(&script));
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert!(
        lines.first().is_some_and(|l| l.starts_with("complete ") && l.ends_with(" ferry")),
        "complete -p ferry\n{}",
        out.describe()
    );
    assert!(out.stdout.contains("commands: serve"), "`ferry se<TAB>`\n{}", out.describe());
    for flag in ["--tls-certificates", "--tls-psk", "--tls-verify-peer"] {
        assert!(
            out.stdout.lines().any(|l| l.starts_with("flags: ") && l.split(' ').any(|w| w == flag)),
            "`ferry serve --tls-<TAB>` lacks {flag}\n{}",
            out.describe()
        );
    }
}

#[test]
fn zsh_and_fish_completions_name_every_command() {
    let zsh = completion("zsh");
    assert!(zsh.starts_with("#compdef ferry"), "zsh script:\n{zsh}");
    let fish = completion("fish");
    assert!(fish.contains("complete -c ferry"), "fish script:\n{fish}");
    for c in COMMANDS {
        assert!(zsh.contains(&format!("'{c}:")), "the zsh script does not offer {c}");
        assert!(fish.contains(&format!("-a \"{c}\"")), "the fish script does not offer {c}");
    }
    for script in [&zsh, &fish, &completion("bash")] {
        assert!(!script.contains("generate-man"), "a hidden command is offered");
    }
    // And each a flag of its own.
    assert!(zsh.contains("--dirty-bitmap") && fish.contains("-l dirty-bitmap"), "copy's --dirty-bitmap is missing");
    let out = run(&mut ferry(&["completions", "tcsh"]));
    assert!(!out.status.success(), "an unknown shell must be refused\n{}", out.describe());
}

#[test]
fn version_names_features_and_libraries() {
    let version = env!("CARGO_PKG_VERSION");
    let short = run_ok(&mut ferry(&["-V"])).stdout;
    assert_eq!(short, format!("ferry {version}\n"), "-V stays one line");
    let out = run_ok(&mut ferry(&["--version"]));
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(lines[0], format!("ferry {version}"), "the first line is what other tools parse");
    let field = |key: &str| lines.iter().find_map(|l| l.strip_prefix(&format!("{key}: "))).map(str::to_string);
    let dotted = |v: &str| {
        let parts: Vec<&str> = v.split('.').collect();
        parts.len() == 3 && parts.iter().all(|p| !p.is_empty() && p.chars().all(|c| c.is_ascii_digit()))
    };
    if cfg!(feature = "rbd") {
        assert_eq!(field("rbd").as_deref(), Some("on"), "{}", out.describe());
        let librbd = field("librbd").unwrap_or_else(|| panic!("no librbd line\n{}", out.describe()));
        assert!(dotted(&librbd) && !librbd.starts_with("0."), "librbd: {librbd:?}");
    } else {
        assert!(field("rbd").is_some_and(|v| v.starts_with("off")), "{}", out.describe());
        assert!(field("librbd").is_none(), "{}", out.describe());
    }
    let openssl = field("openssl").unwrap_or_else(|| panic!("no openssl line\n{}", out.describe()));
    let number = openssl.strip_prefix("OpenSSL ").and_then(|r| r.split(' ').next()).unwrap_or_default();
    assert!(dotted(number.trim_end_matches(|c: char| c.is_ascii_alphabetic())), "openssl: {openssl:?}");
    let zstd = field("zstd").unwrap_or_else(|| panic!("no zstd line\n{}", out.describe()));
    assert!(dotted(&zstd) && zstd.starts_with("1."), "zstd: {zstd:?}");
}
