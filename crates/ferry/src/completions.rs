//! `ferry completions SHELL`: a completion script for the shell, from the command line's
//! one definition (clap_complete), printed on stdout.

use anyhow::{Context, Result};
use clap::builder::TypedValueParser;
use clap::Args;
use clap_complete::Shell;
use std::io::Write;

#[derive(Args, Debug)]
pub struct CompletionsArgs {
    /// The shell: bash (source the output, or install it as
    /// /usr/share/bash-completion/completions/ferry), zsh (as _ferry in a directory of
    /// $fpath) or fish (as ~/.config/fish/completions/ferry.fish); elvish and powershell
    /// too.
    #[arg(value_name = "SHELL")]
    shell: Shell,
}

pub fn run(args: CompletionsArgs) -> Result<i32> {
    let mut cmd = without_hidden(crate::command());
    // Into memory first: clap_complete panics on a failed write (a closed pipe).
    let mut script = Vec::new();
    clap_complete::generate(args.shell, &mut cmd, "ferry", &mut script);
    let mut out = std::io::stdout().lock();
    match out.write_all(&script).and_then(|()| out.flush()) {
        // `ferry completions zsh | head`: the reader has what it wanted. Quiet, with the
        // status of a program SIGPIPE stopped, as every other command's closed stdout.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => std::process::exit(141),
        r => r.context("writing the completion script")?,
    }
    Ok(0)
}

/// The formats `--format`, `-f` and `-O` take, for parsing and completion.
pub(crate) fn format_values() -> impl clap::builder::TypedValueParser<Value = ferry_open::Format> {
    clap::builder::PossibleValuesParser::new(["raw", "qcow2"]).try_map(|s| s.parse::<ferry_open::Format>())
}

/// The hash functions `--digest` takes, for parsing and completion.
pub(crate) fn digest_values() -> impl clap::builder::TypedValueParser<Value = ferry_hash::Algorithm> {
    clap::builder::PossibleValuesParser::new(["sha256", "sha512", "sha1", "md5", "blake3"])
        .try_map(|s| s.parse::<ferry_hash::Algorithm>())
}

/// `cmd` without its hidden subcommands (`generate-man`), which clap_complete would offer.
fn without_hidden(cmd: clap::Command) -> clap::Command {
    let subcommands: Vec<clap::Command> = cmd
        .get_subcommands()
        .filter(|s| !s.is_hide_set())
        .map(|s| match s.get_name() {
            "bitmap" => crate::bitmap::for_completion(s),
            _ => s.clone(),
        })
        .collect();
    let args: Vec<clap::Arg> = cmd.get_arguments().cloned().collect();
    clap::Command::new("ferry").version(env!("CARGO_PKG_VERSION")).args(args).subcommands(subcommands)
}
