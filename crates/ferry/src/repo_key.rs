//! `ferry repo key list|add|passwd|remove`: the passphrases of an encrypted repository
//! (its config's key and key objects, FORMAT.md §3a). None of them changes the master key:
//! docs/repo.md says what that does and does not protect.

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use ferry_backend::parse_size;
use ferry_repo::format::KdfCost;
use ferry_repo::{Passphrase, Repository};
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Args, Debug)]
pub struct KeyArgs {
    #[command(subcommand)]
    command: KeyCommand,
}

#[derive(Subcommand, Debug)]
enum KeyCommand {
    /// The keys (passphrases) of an encrypted repository: id, creation time, host, KDF cost,
    /// and which one the passphrase given opened.
    List(KeyListArgs),
    /// Add a passphrase: the master key wrapped under a new passphrase (--new-password-file,
    /// FERRY_NEW_PASSWORD or FERRY_NEW_PASSWORD_FILE), beside the others.
    Add(KeyNewArgs),
    /// Change the passphrase of the key the passphrase given opens (the master key stays:
    /// see docs/repo.md for what that does not protect).
    Passwd(KeyNewArgs),
    /// Remove a key by its id (`ferry repo key list`), giving another key's passphrase: the
    /// one the passphrase given opened (the only key known to open) is never removed.
    Remove(KeyRemoveArgs),
}

#[derive(Args, Debug)]
struct KeyCommon {
    /// The repository: a directory or s3://BUCKET/PREFIX (FERRY_REPOSITORY when not
    /// written).
    #[arg(env = "FERRY_REPOSITORY")]
    repo: String,
    /// A current passphrase of the repository.
    #[command(flatten)]
    password: crate::password_args::PasswordArgs,
    #[command(flatten)]
    remote: crate::remote_args::RemoteArgs,
}

impl KeyCommon {
    fn open(&self) -> Result<Arc<Repository>> {
        ferry_open::repo::open_repository(&self.repo, &self.remote.remote(), self.password.install())
    }
}

#[derive(Args, Debug)]
struct KeyListArgs {
    #[command(flatten)]
    common: KeyCommon,
    /// One JSON array of the keys.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
struct KeyNewArgs {
    #[command(flatten)]
    common: KeyCommon,
    /// The new passphrase: the first line of FILE (else FERRY_NEW_PASSWORD, else
    /// FERRY_NEW_PASSWORD_FILE, else typed twice on a terminal). Never given on the
    /// command line.
    #[arg(long, value_name = "FILE")]
    new_password_file: Option<PathBuf>,
    /// Memory the new key's derivation takes (Argon2id's m; 3 passes, 4 lanes).
    #[arg(long, default_value = "64M", value_name = "BYTES")]
    kdf_memory: String,
}

#[derive(Args, Debug)]
struct KeyRemoveArgs {
    #[command(flatten)]
    common: KeyCommon,
    /// The key's id, as `ferry repo key list` shows it (`config` for the config's key).
    id: String,
}

pub fn run(args: KeyArgs) -> Result<i32> {
    match args.command {
        KeyCommand::List(a) => list(a),
        KeyCommand::Add(a) => change(a, false),
        KeyCommand::Passwd(a) => change(a, true),
        KeyCommand::Remove(a) => {
            let repo = a.common.open()?;
            let done = repo.remove_key(&a.id).with_context(|| format!("removing a key of {}", a.common.repo))?;
            println!("{}: {done}", a.common.repo);
            Ok(0)
        }
    }
}

/// The KDF cost of a new key from `--kdf-memory` (as `ferry repo init` takes it).
pub(crate) fn kdf_cost(kdf_memory: &str) -> Result<KdfCost> {
    let mem = parse_size(kdf_memory).context("--kdf-memory")?;
    if !(8 << 20..=4 << 30).contains(&mem) {
        bail!("--kdf-memory must be from 8M to 4G");
    }
    Ok(KdfCost { m_kib: (mem >> 10) as u32, ..ferry_repo::crypto::DEFAULT_KDF })
}

/// The current and the new passphrase, both given (else typed on a terminal, the new one
/// twice), and different.
fn passphrases(repo: &str, current: Option<&Path>, new: Option<&Path>) -> Result<(Passphrase, Passphrase)> {
    let now = match ferry_open::repo::passphrase(current)? {
        Some(p) => Some(p),
        None => ferry_open::repo::prompt(repo)?,
    };
    let Some(now) = now else {
        bail!("a current passphrase is needed: {}", ferry_open::repo::PASSPHRASE_HOW);
    };
    let new = match ferry_open::repo::new_passphrase(new)? {
        Some(p) => Some(p),
        None => ferry_open::repo::prompt_new(repo)?,
    };
    let Some(new) = new else {
        bail!(
            "a new passphrase is needed: --new-password-file FILE (its first line), FERRY_NEW_PASSWORD=... or \
             FERRY_NEW_PASSWORD_FILE=FILE (never on the command line), or run it on a terminal"
        );
    };
    if now == new {
        bail!("the new passphrase is the current one: nothing would change");
    }
    Ok((now, new))
}

fn change(a: KeyNewArgs, passwd: bool) -> Result<i32> {
    let c = &a.common;
    let cost = kdf_cost(&a.kdf_memory)?;
    let limit = ferry_open::repo::kdf_limit()?;
    let (now, new) = passphrases(&c.repo, c.password.install(), a.new_password_file.as_deref())?;
    let store = ferry_open::repo::repo_store(&c.repo, &c.remote.remote(), false)?;
    let repo = Repository::open_with(store, &|| Ok(now.clone()), limit)
        .with_context(|| format!("cannot open the repository {}", c.repo))?;
    drop(now);
    if passwd {
        let before = repo.key_slot().unwrap_or_default().to_string();
        let id = repo.change_key(&new, cost, limit).with_context(|| format!("changing a passphrase of {}", c.repo))?;
        println!("{}: the passphrase of key {before} changed (now key {id})", c.repo);
    } else {
        let id = repo.add_key(&new, cost, limit).with_context(|| format!("adding a passphrase to {}", c.repo))?;
        println!("{}: added key {id}", c.repo);
    }
    eprintln!(
        "the master key is unchanged: anyone who had an old passphrase and a copy of the old config or key object \
         can still read everything (docs/repo.md, \"Passphrases\")"
    );
    Ok(0)
}

fn list(a: KeyListArgs) -> Result<i32> {
    let repo = a.common.open()?;
    let keys = repo.keys().with_context(|| format!("listing the keys of {}", a.common.repo))?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&keys)?);
        return Ok(0);
    }
    println!("{:<17} {:<20} {:<20} KDF", "ID", "CREATED", "HOST");
    for k in &keys {
        let created = k.created.trim_end_matches('Z').replacen('T', " ", 1);
        let host = if k.host.is_empty() { "-" } else { &k.host };
        let kdf = format!("argon2id {}M t={} p={}", k.kdf.m_kib >> 10, k.kdf.t, k.kdf.p);
        let note = match (&k.damaged, k.in_use) {
            (Some(why), _) => format!("damaged: {why}"),
            (None, true) => "(opened with the passphrase given)".into(),
            (None, false) => String::new(),
        };
        println!("{:<17} {:<20} {:<20} {:<24} {note}", k.id, created, host, kdf);
    }
    Ok(0)
}
