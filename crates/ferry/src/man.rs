//! `ferry generate-man DIR` (hidden): the man pages, `ferry(1)` and one per command
//! (`ferry-serve(1)`, ...), written from the command line's one definition (the clap
//! derive in main.rs and each command's `Args`) and the hand-written sections a
//! generator cannot say, kept in `man/extra/PAGE.roff`.
//!
//! An extra file is roff split by `.SH` lines. Its `DESCRIPTION` follows the command's
//! generated description; an `OPTIONS` heading marks where the generated options (and,
//! for a command with subcommands, `COMMANDS`) go, else they follow `DESCRIPTION`; every
//! other section comes out in the file's order. NAME and SYNOPSIS are always generated;
//! every page must have an extra file with a SEE ALSO section. Nothing depends on the
//! clock or the machine, so the committed pages under `man/` can be compared with what
//! the build generates (tests/man.rs).

use anyhow::{bail, Context, Result};
use clap::Args;
use clap_mangen::Man;
use std::path::{Path, PathBuf};

#[derive(Args, Debug)]
pub struct GenerateManArgs {
    /// Directory to write the pages into (made if missing).
    #[arg(value_name = "DIR")]
    dir: PathBuf,
    /// Directory of the hand-written sections (PAGE.roff).
    #[arg(long, value_name = "DIR", default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../../man/extra"))]
    extra: PathBuf,
}

pub fn run(args: GenerateManArgs) -> Result<i32> {
    let pages = pages(&args.extra)?;
    std::fs::create_dir_all(&args.dir).with_context(|| format!("cannot make {}", args.dir.display()))?;
    for (name, text) in &pages {
        let path = args.dir.join(format!("{name}.1"));
        std::fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))?;
    }
    log::info!("wrote {} pages into {}", pages.len(), args.dir.display());
    Ok(0)
}

/// Every page: `(name, roff)`, `ferry` first, then the visible commands in their order.
pub fn pages(extra: &Path) -> Result<Vec<(String, String)>> {
    let mut cmd = crate::command().disable_help_subcommand(true).subcommand_help_heading("COMMANDS");
    cmd.build();
    let mut pages = vec![("ferry".to_string(), page(&cmd, "ferry", extra)?)];
    for sub in visible(&cmd) {
        let name = format!("ferry-{}", sub.get_name());
        let text = page(sub, &name, extra)?;
        pages.push((name, text));
    }
    // An extra file no page uses is a misspelt page name, or a command gone.
    for entry in std::fs::read_dir(extra).with_context(|| format!("cannot read {}", extra.display()))? {
        let file = entry?.file_name();
        let file = file.to_string_lossy();
        let stem = file.strip_suffix(".roff").unwrap_or(&file);
        if !pages.iter().any(|(n, _)| n == stem) {
            bail!("{}/{file}: no page {stem}(1); pages are {}", extra.display(), names(&pages));
        }
    }
    Ok(pages)
}

fn names(pages: &[(String, String)]) -> String {
    pages.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>().join(", ")
}

/// The subcommands a page lists: not hidden, not clap's `help`.
fn visible(cmd: &clap::Command) -> impl Iterator<Item = &clap::Command> {
    cmd.get_subcommands().filter(|s| !s.is_hide_set() && s.get_name() != "help")
}

fn man(cmd: &clap::Command, name: &str) -> Man {
    Man::new(cmd.clone())
        .title(name.to_uppercase())
        .section("1")
        .date("")
        .source(format!("ferry {}", env!("CARGO_PKG_VERSION")))
        .manual("ferry")
}

/// The pages' date (`.TH`): of their last substantive change, set by hand when a
/// release changes them, never from the clock (the committed pages must equal what any
/// build generates).
const DATE: &str = "2026-11-27";

/// What the roff crate puts before everything it renders (`\\*(Aq` is its apostrophe):
/// once at the top of a page.
const PREAMBLE: &str = ".ie \\n(.g .ds Aq \\(aq\n.el .ds Aq '\n";

/// Roff from the roff crate without its preamble.
fn strip_preamble(roff: String) -> String {
    match roff.strip_prefix(PREAMBLE) {
        Some(rest) => rest.to_string(),
        None => roff,
    }
}

/// Runs one of `Man`'s section renderers into a string.
fn render(f: impl FnOnce(&mut Vec<u8>) -> std::io::Result<()>) -> Result<String> {
    let mut out = Vec::new();
    f(&mut out)?;
    Ok(strip_preamble(String::from_utf8(out)?))
}

/// `cmd`'s usage as `--help` prints it (`ferry serve [OPTIONS] <SPEC>`), one line per
/// form, the command in bold and each `<PLACEHOLDER>` in italics.
fn synopsis(cmd: &clap::Command) -> String {
    use clap_mangen::roff::{bold, italic, roman, Roff};
    let usage = cmd.clone().render_usage().to_string();
    let bin = cmd.get_bin_name().unwrap_or(cmd.get_name()).to_string();
    let mut roff = Roff::new();
    for (n, line) in usage.lines().map(str::trim).filter(|l| !l.is_empty()).enumerate() {
        let line = line.strip_prefix("Usage:").unwrap_or(line).trim_start();
        let line = line.strip_prefix("usage:").unwrap_or(line).trim_start();
        if n > 0 {
            roff.control("br", []);
        }
        let mut inline = Vec::new();
        let mut rest = match line.strip_prefix(bin.as_str()) {
            Some(rest) => {
                inline.push(bold(bin.as_str()));
                rest
            }
            None => line,
        };
        while let Some((i, j)) = rest.find('<').and_then(|i| rest[i..].find('>').map(|j| (i, i + j))) {
            inline.push(roman(&rest[..i]));
            inline.push(italic(&rest[i + 1..j]));
            rest = &rest[j + 1..];
        }
        inline.push(roman(rest));
        roff.text(inline);
    }
    strip_preamble(roff.to_roff())
}

/// `cmd` without the global options (-v, -q) and -h in its synopsis and options: a
/// command's page says where they are instead.
fn without_globals(cmd: &clap::Command) -> clap::Command {
    cmd.clone().mut_args(|a| if a.is_global_set() || a.get_id() == "help" { a.hide(true) } else { a })
}

/// A rendered section without its `.SH` line(s): its body, to go under another heading.
fn body(section: &str) -> String {
    section.lines().filter(|l| !l.starts_with(".SH ")).map(|l| format!("{l}\n")).collect()
}

/// Rendered options with clap_mangen's `.br`, empty line, `.br` (before "Possible
/// values", which mandoc -Tlint finds redundant) as the one blank line it shows.
fn tidy(options: String) -> String {
    options.replace(".br\n\n.br\n", ".sp\n")
}

/// The generated part after DESCRIPTION: OPTIONS, then COMMANDS where there are any.
fn options_and_commands(cmd: &clap::Command, m: &Man, top: bool) -> Result<String> {
    let mut out = String::new();
    let options = cmd.get_arguments().any(|a| !a.is_hide_set());
    if options || !top {
        out += ".SH OPTIONS\n";
    }
    if !top {
        out += &global_options();
    }
    if options {
        out += &tidy(body(&render(|w| m.render_options_section(w))?));
    }
    if cmd.get_name() == "bitmap" {
        // Its operations are parsed by hand, in order (qemu-img bitmap's spelling): the
        // help it prints is their one description.
        out += ".SH OPERATIONS\n";
        out += &help_block(crate::bitmap::HELP);
    }
    if visible(cmd).next().is_none() {
        return Ok(out);
    }
    if cmd.get_name() == "ferry" {
        // The commands are pages of their own: a list of them.
        out += &render(|w| m.render_subcommands_section(w))?;
        return Ok(out);
    }
    // `ferry repo`, `ferry bench`: each subcommand on this page, with its synopsis and
    // options, the global ones (-v, -q, -h: see OPTIONS above) left out.
    out += ".SH COMMANDS\n";
    commands(cmd, &mut out)?;
    Ok(out)
}

/// Each subcommand of `cmd` with its synopsis and options, and those of its own
/// subcommands after it (`ferry repo key list`).
fn commands(cmd: &clap::Command, out: &mut String) -> Result<()> {
    for sub in visible(cmd) {
        let sub = without_globals(sub);
        let sm = man(&sub, sub.get_name());
        let bin = sub.get_bin_name().unwrap_or(sub.get_name()).to_string();
        *out += &format!(".SS \"{bin}\"\n");
        *out += &body(&render(|w| sm.render_description_section(w))?);
        *out += ".PP\n";
        *out += &synopsis(&sub);
        if sub.get_arguments().any(|a| !a.is_hide_set()) {
            *out += &tidy(body(&render(|w| sm.render_options_section(w))?));
        }
        commands(&sub, out)?;
    }
    Ok(())
}

/// A `--help` text of paragraphs and `  TERM  DESCRIPTION` lines (indented further:
/// nested under the term above) as roff.
fn help_block(text: &str) -> String {
    use clap_mangen::roff::{bold, roman, Roff};
    let mut roff = Roff::new();
    let mut nested = false;
    for (n, line) in text.lines().enumerate() {
        let indent = line.len() - line.trim_start().len();
        let line = line.trim();
        if nested != (indent >= 4) {
            roff.control(if nested { "RE" } else { "RS" }, []);
            nested = !nested;
        }
        if indent == 0 {
            // A paragraph (none needed right after the heading).
            if n > 0 {
                roff.control("PP", []);
            }
            roff.text([roman(line)]);
            continue;
        }
        let (term, desc) = line.split_once("  ").map_or((line, ""), |(t, d)| (t.trim(), d.trim()));
        roff.control("TP", []).text([bold(term)]).text([roman(desc)]);
    }
    if nested {
        roff.control("RE", []);
    }
    strip_preamble(roff.to_roff())
}

/// What a command's page says of the options every command takes (-v, -q, -h).
fn global_options() -> String {
    let mut cmd = crate::command();
    cmd.build();
    let flag = |a: &clap::Arg| match (a.get_short(), a.get_long()) {
        (Some(s), Some(l)) => format!("\\fB\\-{s}\\fR/\\fB\\-\\-{l}\\fR"),
        (None, Some(l)) => format!("\\fB\\-\\-{l}\\fR"),
        (Some(s), None) => format!("\\fB\\-{s}\\fR"),
        (None, None) => String::new(),
    };
    let flags: Vec<String> =
        cmd.get_arguments().filter(|a| a.is_global_set() || a.get_id() == "help").map(flag).collect();
    let list = match flags.split_last() {
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} and {last}", rest.join(", ")),
        None => return String::new(),
    };
    format!("Every command also takes {list}: see \\fBferry\\fR(1).\n")
}

/// One hand-written section: its `.SH` line as written, its heading, its body.
struct Section {
    line: String,
    heading: String,
    body: String,
}

fn parse_extra(path: &Path, text: &str) -> Result<Vec<Section>> {
    let mut sections: Vec<Section> = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if let Some(h) = line.strip_prefix(".SH ") {
            let heading = h.trim().trim_matches('"').to_string();
            if heading == "NAME" || heading == "SYNOPSIS" {
                bail!("{}:{}: {heading} is generated; leave it out", path.display(), n + 1);
            }
            if sections.iter().any(|s| s.heading == heading) {
                bail!("{}:{}: a second {heading} section", path.display(), n + 1);
            }
            sections.push(Section { line: line.to_string(), heading, body: String::new() });
        } else if let Some(s) = sections.last_mut() {
            s.body.push_str(line);
            s.body.push('\n');
        } else if !(line.trim().is_empty() || line.starts_with(".\\\"")) {
            bail!("{}:{}: text before the first .SH", path.display(), n + 1);
        }
    }
    if !sections.iter().any(|s| s.heading == "SEE ALSO") {
        bail!("{}: every page needs a SEE ALSO section", path.display());
    }
    Ok(sections)
}

fn page(cmd: &clap::Command, name: &str, extra: &Path) -> Result<String> {
    let path = extra.join(format!("{name}.roff"));
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {} (the hand-written sections of {name}(1))", path.display()))?;
    let sections = parse_extra(&path, &text)?;
    // A command's page leaves the global options to ferry(1), and says so.
    let top = name == "ferry";
    let cmd = &if top { cmd.clone() } else { without_globals(cmd) };
    let m = man(cmd, name);
    // The title line by hand: the roff crate drops an empty argument.
    let mut out = format!(
        "{PREAMBLE}.TH \"{}\" \"1\" \"{DATE}\" \"ferry {}\" \"ferry\"\n",
        name.to_uppercase(),
        env!("CARGO_PKG_VERSION")
    );
    out += &render(|w| m.render_name_section(w))?;
    out += ".SH SYNOPSIS\n";
    if top || visible(cmd).next().is_none() {
        out += &synopsis(cmd);
    } else {
        // One line per subcommand.
        for (n, sub) in visible(cmd).enumerate() {
            if n > 0 {
                out += ".br\n";
            }
            out += &synopsis(&without_globals(sub));
        }
    }
    out += &render(|w| m.render_description_section(w))?;
    if let Some(d) = sections.iter().find(|s| s.heading == "DESCRIPTION") {
        out += ".PP\n";
        out += &d.body;
    }
    let generated = options_and_commands(cmd, &m, top)?;
    if !sections.iter().any(|s| s.heading == "OPTIONS") {
        out += &generated;
    }
    for s in sections.iter().filter(|s| s.heading != "DESCRIPTION") {
        if s.heading == "OPTIONS" {
            out += &generated;
        } else {
            out += &s.line;
            out += "\n";
        }
        if s.heading == "SEE ALSO" {
            // Page names and addresses are not hyphenated or stretched.
            out += ".ad l\n.nh\n";
        }
        out += &s.body;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Vec<Section>> {
        parse_extra(Path::new("x.roff"), text)
    }

    #[test]
    fn extra_sections_are_checked() {
        let ok = parse(".\\\" a comment\n.SH DESCRIPTION\nMore.\n.SH \"SEE ALSO\"\n.BR ferry (1)\n").unwrap();
        assert_eq!(ok.iter().map(|s| s.heading.as_str()).collect::<Vec<_>>(), ["DESCRIPTION", "SEE ALSO"]);
        assert_eq!(ok[1].body, ".BR ferry (1)\n");
        for (bad, why) in [
            (".SH EXAMPLES\nx\n", "needs a SEE ALSO"),
            ("text\n.SH \"SEE ALSO\"\n", "before the first .SH"),
            (".SH NAME\nx\n.SH \"SEE ALSO\"\n", "generated"),
            (".SH \"SEE ALSO\"\n.SH \"SEE ALSO\"\n", "a second"),
        ] {
            let e = parse(bad).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(e.contains(why), "{bad:?}: {e:?}");
        }
    }

    #[test]
    fn help_blocks_become_tagged_paragraphs() {
        let roff =
            help_block("Intro:\n  --add      make it\n    -g, --gran SIZE  its size\n  --remove   drop it\nEnd.");
        assert!(!roff.starts_with(".PP"), "{roff}");
        for want in
            ["\\fB\\-\\-add\\fR\nmake it\n", ".RS\n.TP\n\\fB\\-g, \\-\\-gran SIZE\\fR\nits size\n.RE\n", ".PP\nEnd.\n"]
        {
            assert!(roff.contains(want), "{want:?} not in\n{roff}");
        }
    }
}
