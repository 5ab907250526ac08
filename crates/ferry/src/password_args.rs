//! The passphrase flags of every command that opens an encrypted repository: one
//! declaration, flattened into each command's arguments, so that the flags, their help
//! and the order in which the sources are tried are the same everywhere.

use anyhow::Result;
use clap::Args;
use ferry_repo::known::OnRollback;
use ferry_repo::Repository;
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Args, Debug, Clone, Default)]
pub struct PasswordArgs {
    /// The repository's passphrase: the first line of FILE (else --password-command,
    /// FERRY_PASSWORD, FERRY_PASSWORD_FILE, FERRY_PASSWORD_COMMAND, a prompt on a terminal).
    #[arg(long, value_name = "FILE")]
    pub password_file: Option<PathBuf>,
    /// The passphrase: the first line CMD prints, run by /bin/sh -c (its standard input
    /// and error are ferry's; a failing CMD is an error).
    #[arg(long, value_name = "CMD", conflicts_with = "password_file")]
    pub password_command: Option<String>,
}

impl PasswordArgs {
    /// Makes --password-command the source tried after --password-file (once per
    /// process: every repository the command opens uses it).
    pub fn install(&self) -> Option<&Path> {
        ferry_open::repo::set_password_command(self.password_command.as_deref());
        self.password_file.as_deref()
    }

    /// Opens the repository `repo` with these passphrase sources.
    pub fn open(&self, repo: &str, remote: &ferry_open::Remote, on: OnRollback) -> Result<Arc<Repository>> {
        let file = self.install();
        ferry_open::repo::open_repository_with(repo, remote, file, on)
    }

    /// [`PasswordArgs::open`], also returning the passphrase these sources gave (none
    /// when it was asked on the terminal, or none was needed): each source is asked
    /// once, a password command run once.
    pub fn open_giving(
        &self,
        repo: &str,
        remote: &ferry_open::Remote,
        on: OnRollback,
    ) -> Result<(Arc<Repository>, Option<ferry_repo::Passphrase>)> {
        let file = self.install();
        ferry_open::repo::open_repository_giving(repo, remote, file, on)
    }
}
