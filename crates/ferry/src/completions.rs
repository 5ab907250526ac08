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
    let mut cmd = crate::command();
    // Into memory first: clap_complete panics on a failed write (a closed pipe).
    let mut script = Vec::new();
    clap_complete::generate(args.shell, &mut cmd, "ferry", &mut script);
    let mut out = std::io::stdout().lock();
    out.write_all(&script).and_then(|()| out.flush()).context("writing the completion script")?;
    Ok(0)
}
