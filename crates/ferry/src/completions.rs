//! `ferry completions SHELL`: a completion script for the shell, from the command line's
//! one definition (clap_complete), printed on stdout.

use anyhow::{Context, Result};
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
    out.write_all(&script).and_then(|()| out.flush()).context("writing the completion script")?;
    Ok(0)
}

/// `cmd` without its hidden subcommands (`generate-man`), which clap_complete would offer.
fn without_hidden(cmd: clap::Command) -> clap::Command {
    let subcommands: Vec<clap::Command> = cmd.get_subcommands().filter(|s| !s.is_hide_set()).cloned().collect();
    let args: Vec<clap::Arg> = cmd.get_arguments().cloned().collect();
    clap::Command::new("ferry").version(env!("CARGO_PKG_VERSION")).args(args).subcommands(subcommands)
}
