//! `ferry repo init|list|check|verify|forget|gc|stats|key|repair|unlock|copy`: backup repositories
//! (crates/repo, its format in crates/repo/FORMAT.md).

use crate::password_args::PasswordArgs;
use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use ferry_backend::parse_size;
use ferry_repo::format::{Changes, ManifestSummary};
use ferry_repo::known::OnRollback;
use ferry_repo::maint::{self, Policy, Problem, Report, VerifyOptions};
use ferry_repo::recover::{self, RepairOptions};
use ferry_repo::retain::Within;
use ferry_repo::{InitOptions, Repository, SnapshotInfo};
use std::sync::Arc;
use std::time::Duration;

#[derive(Args, Debug)]
pub struct RepoArgs {
    #[command(subcommand)]
    command: RepoCommand,
}

#[derive(Subcommand, Debug)]
enum RepoCommand {
    /// Make a new repository in a directory (made if missing, must be empty) or at
    /// s3://BUCKET/PREFIX.
    Init(InitArgs),
    /// The snapshots, oldest first: id, time, disk name, size, change map; DAMAGED where a
    /// snapshot reads data that `ferry repo verify` found damaged and that has no good copy.
    List(ListArgs),
    /// Check the metadata (config, index, manifests and their pages) without reading data;
    /// exit status 13 when something is damaged.
    Check(CommonArgs),
    /// Check, then read every pack (or --read-data PERCENT or N/T of them) once and check
    /// every chunk; names each damaged snapshot and range; exit status 13 when something is
    /// damaged.
    Verify(VerifyArgs),
    /// Remove the snapshots a retention policy does not keep, or those named by id
    /// (their data stays until `ferry repo gc`).
    Forget(ForgetArgs),
    /// Free the data no snapshot references.
    Gc(GcArgs),
    /// Sizes: logical, deduplicated, compressed, stored.
    Stats(StatsArgs),
    /// The passphrases of an encrypted repository: list, add, passwd (change), remove.
    Key(crate::repo_key::KeyArgs),
    /// Index again the packs that no readable index object lists (from their trailers),
    /// then remove the index objects that cannot be read; list (and with --drop-damaged
    /// remove) the manifests and checkpoints that cannot be read. Exit status 13 when
    /// something stays damaged.
    Repair(RepairArgs),
    /// Remove the stale locks (left by processes that are gone), printing each; live
    /// locks are kept and listed unless --force.
    Unlock(UnlockArgs),
    /// Copy snapshots into another repository (an offsite copy: directory or S3, its own
    /// encryption, key and chunk size), sending only the chunks it lacks; snapshots it has
    /// already are skipped, so running it again continues an interrupted copy.
    Copy(crate::repo_copy::CopyArgs),
    /// Protect a snapshot: `ferry repo forget` never removes it, whatever the policy or
    /// the ids given, until `ferry repo unprotect`.
    Protect(ProtectArgs),
    /// Remove a snapshot's protection (`ferry repo protect`).
    Unprotect(ProtectArgs),
    /// Upgrade a version 1 (unencrypted) or version 2 repository to format version 3 in
    /// place: each snapshot made again saying where its chunks are, so that restores need
    /// no index (same names, times and contents; new ids). Holds the repository's
    /// exclusive lock; safe to interrupt, and run again to finish.
    Migrate(MigrateArgs),
}

#[derive(Args, Debug)]
struct MigrateArgs {
    #[command(flatten)]
    common: CommonArgs,
    /// Say what would be done; change nothing.
    #[arg(long)]
    dry_run: bool,
}

#[derive(Args, Debug)]
struct CommonArgs {
    /// The repository: a directory or s3://BUCKET/PREFIX. When not written,
    /// FERRY_REPOSITORY; when written, it is always the first argument.
    #[arg(env = "FERRY_REPOSITORY")]
    repo: String,
    #[command(flatten)]
    password: PasswordArgs,
    #[command(flatten)]
    remote: crate::remote_args::RemoteArgs,
}

impl CommonArgs {
    /// The repository, for a command that only reads it: a store that went back is
    /// warned about.
    fn open(&self) -> Result<Arc<Repository>> {
        self.open_with(OnRollback::Warn)
    }
    fn open_with(&self, on: OnRollback) -> Result<Arc<Repository>> {
        self.password.open(&self.repo, &self.remote.remote(), on)
    }
}

/// What forget and gc do when the store went back since this host last used it: refuse
/// when a disk's newest snapshot is gone (they would remove what is left of it), unless
/// accepted; a forgotten snapshot back is only warned about (forgetting it again is the
/// remedy).
fn removing(accept: bool, disk: Option<String>, repo: &str, what: &str) -> OnRollback {
    match accept {
        true => OnRollback::Accept,
        false => OnRollback::Refuse {
            disk,
            back: false,
            way_out: format!(
                "{what} now could remove for good what is left of the snapshots that are gone. Find out why first \
                 (`ferry repo list {repo}`, the store's logs); if they were removed on purpose, run it again with \
                 --accept-rollback, which makes the store's state the one this host knows"
            ),
            damaged: None,
        },
    }
}

#[derive(Args, Debug)]
struct InitArgs {
    #[command(flatten)]
    common: CommonArgs,
    /// Encrypt data and metadata (AES-256-GCM, a key wrapped by Argon2id from the
    /// passphrase: --password-file, FERRY_PASSWORD or FERRY_PASSWORD_FILE). A lost
    /// passphrase cannot be recovered, and neither can the backups.
    #[arg(long)]
    encrypt: bool,
    /// Chunk size: the unit of deduplication (a power of two; 64K makes a snapshot's
    /// `ferry hash` come from its index, as blkhash uses 64 KiB blocks).
    #[arg(long, default_value = "64K", value_name = "BYTES")]
    chunk_size: String,
    /// Memory the key derivation takes (Argon2id's m), with --encrypt.
    #[arg(long, default_value = "64M", value_name = "BYTES")]
    kdf_memory: String,
    /// The repository format version: 3 (the default: each snapshot says where its chunks
    /// are, so a restore needs no index; FORMAT.md §7c), or 2 or 1 for a repository that
    /// an older ferry uses too (version 2: snapshots read through the index; version 1
    /// also seals every encrypted object under one key, safe for about 256 TiB ever
    /// written: FORMAT.md §4a). `ferry repo migrate` upgrades a repository to 3 later.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=3))]
    format_version: Option<u32>,
}

#[derive(Args, Debug)]
struct ListArgs {
    #[command(flatten)]
    common: CommonArgs,
    /// Only the snapshots of this disk, or of the disks this pattern matches (`*` any
    /// characters, `?` one: quote it from the shell).
    name: Option<String>,
    /// Only the snapshots tagged T (`ferry backup --tag`); T1,T2: those with both.
    /// Repeatable: a snapshot matching any of them is listed.
    #[arg(long = "tag", value_name = "T", value_parser = parse_tag_list)]
    tags: Vec<Vec<String>>,
    /// Only the snapshots taken on this host (as the HOST field of --json shows it).
    #[arg(long)]
    host: Option<String>,
    /// Only the N latest snapshots of each disk (at least 1).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    latest: Option<u32>,
    /// One JSON array of the snapshots.
    #[arg(long)]
    json: bool,
}

impl ListArgs {
    /// Whether `s` passes the filters, but --latest.
    fn selects(&self, s: &SnapshotInfo) -> bool {
        let m = &s.manifest;
        self.name.as_ref().is_none_or(|n| glob(n.as_bytes(), m.name.as_bytes()))
            && self.host.as_ref().is_none_or(|h| *h == m.host)
            && (self.tags.is_empty() || self.tags.iter().any(|l| l.iter().all(|t| m.tags.contains(t))))
    }
}

/// Whether `name` matches `pattern` (`*` any bytes, `?` one; the rest as it is).
fn glob(pattern: &[u8], name: &[u8]) -> bool {
    // Where the last `*` was, and where in `name` it stopped matching: backtracking to
    // there only keeps this linear in practice and bounded by len(pattern) * len(name).
    let (mut p, mut n, mut star): (usize, usize, Option<(usize, usize)>) = (0, 0, None);
    while n < name.len() {
        match pattern.get(p) {
            Some(b'*') => {
                star = Some((p, n));
                p += 1;
            }
            Some(c) if *c == b'?' || *c == name[n] => {
                p += 1;
                n += 1;
            }
            _ => match star {
                Some((sp, sn)) => {
                    star = Some((sp, sn + 1));
                    p = sp + 1;
                    n = sn + 1;
                }
                None => return false,
            },
        }
    }
    pattern[p.min(pattern.len())..].iter().all(|c| *c == b'*')
}

#[derive(Args, Debug)]
struct VerifyArgs {
    #[command(flatten)]
    common: CommonArgs,
    /// Read this share of the packs: PERCENT (1 to 100, `10%` too; rounded up, so at least
    /// one pack) from a window that moves on each day, so that successive days cover them
    /// all; or N/T, restic's subset form: the packs (in name order) cut into T equal slices,
    /// the Nth read, the same every run.
    #[arg(long, value_name = "PERCENT|N/T", default_value = "100", value_parser = maint::ReadData::parse)]
    read_data: maint::ReadData,
    /// Packs read at once. Default: one per core.
    #[arg(short = 'j', long, value_name = "N")]
    jobs: Option<usize>,
}

#[derive(Args, Debug)]
struct ForgetArgs {
    /// REPO, or REPO::NAME for one disk's snapshots only (FERRY_REPOSITORY when not
    /// written; when written, it is always the first argument).
    #[arg(env = "FERRY_REPOSITORY")]
    target: String,
    /// Forget these snapshots (each a unique prefix of at least 4 hex digits of an id,
    /// as `ferry repo list` shows them) instead of applying a policy.
    #[arg(value_name = "ID")]
    ids: Vec<String>,
    /// Keep the N latest snapshots (of each disk).
    #[arg(long, value_name = "N")]
    keep_last: Option<u32>,
    /// Keep the latest snapshot of each of the last N hours that have one (local time).
    #[arg(long, value_name = "N")]
    keep_hourly: Option<u32>,
    /// Keep the latest snapshot of each of the last N days that have one (local time).
    #[arg(long, value_name = "N")]
    keep_daily: Option<u32>,
    /// Keep the latest snapshot of each of the last N ISO weeks that have one.
    #[arg(long, value_name = "N")]
    keep_weekly: Option<u32>,
    /// Keep the latest snapshot of each of the last N months that have one.
    #[arg(long, value_name = "N")]
    keep_monthly: Option<u32>,
    /// Keep the latest snapshot of each of the last N years that have one.
    #[arg(long, value_name = "N")]
    keep_yearly: Option<u32>,
    /// Keep every snapshot newer than DURATION before the disk's latest snapshot (not
    /// before now), written as restic writes it: 1y2m3d4h, 7d, 36h.
    #[arg(long, value_name = "DURATION", value_parser = parse_within)]
    keep_within: Option<Within>,
    /// Keep every snapshot tagged T (`ferry backup --tag`); T1,T2 keeps those with both.
    /// Repeatable.
    #[arg(long = "keep-tag", value_name = "T", value_parser = parse_tag_list)]
    keep_tags: Vec<Vec<String>>,
    /// Say what would be removed; remove nothing.
    #[arg(long)]
    dry_run: bool,
    /// One JSON object: the ids kept and removed.
    #[arg(long)]
    json: bool,
    /// Wait up to SECS for another forget or a gc to end, instead of failing.
    #[arg(long, value_name = "SECS", value_parser = crate::copy::parse_secs)]
    wait: Option<Duration>,
    #[command(flatten)]
    password: PasswordArgs,
    /// Forget even though the snapshots went back since this host last used the
    /// repository (a disk's newest gone, a forgotten one back), accepting the store's
    /// state. Without it such a forget is refused.
    #[arg(long)]
    accept_rollback: bool,
    #[command(flatten)]
    remote: crate::remote_args::RemoteArgs,
}

#[derive(Args, Debug)]
struct GcArgs {
    #[command(flatten)]
    common: CommonArgs,
    /// Wait up to SECS for another gc, a forget, a repair (or a backup by an older ferry) to
    /// end, instead of failing. Backups of this ferry run beside gc.
    #[arg(long, value_name = "SECS", value_parser = crate::copy::parse_secs)]
    wait: Option<Duration>,
    /// Delete the packs that an earlier gc condemned beside running backups only once they
    /// were condemned SECS ago (and those backups have ended). Default: FERRY_CONDEMN_MARGIN,
    /// else 3600.
    #[arg(long, value_name = "SECS", value_parser = crate::copy::parse_secs)]
    condemn_margin: Option<Duration>,
    /// Copy a pack to free its unused chunks only when they are at least PERCENT of it
    /// (0: always; a pack with no used chunk is always deleted).
    #[arg(long, value_name = "PERCENT", default_value_t = maint::DEFAULT_REPACK_PERCENT,
          value_parser = clap::value_parser!(u32).range(0..=100))]
    repack: u32,
    /// Collect even though the snapshots went back since this host last used the
    /// repository (a disk's newest gone, a forgotten one back), accepting the store's
    /// state. Without it such a gc is refused: it would free the data of the snapshots
    /// that are gone.
    #[arg(long)]
    accept_rollback: bool,
    /// Say what gc would delete, condemn and repack, and the bytes that frees; change
    /// nothing (no lock is taken).
    #[arg(long)]
    dry_run: bool,
}

#[derive(Args, Debug)]
struct ProtectArgs {
    /// The snapshot: REPO::NAME@ID (ID a unique prefix of at least 4 hex digits).
    #[arg(value_parser = parse_snapshot_with_id)]
    snapshot: String,
    #[command(flatten)]
    password: PasswordArgs,
    /// Wait up to SECS for a forget or a gc to end, instead of failing.
    #[arg(long, value_name = "SECS", value_parser = crate::copy::parse_secs)]
    wait: Option<Duration>,
    #[command(flatten)]
    remote: crate::remote_args::RemoteArgs,
}

#[derive(Args, Debug)]
struct RepairArgs {
    #[command(flatten)]
    common: CommonArgs,
    /// Also remove the manifests and checkpoints that cannot be read (each is listed).
    #[arg(long)]
    drop_damaged: bool,
    /// Say what would be done; change nothing.
    #[arg(long)]
    dry_run: bool,
    /// Wait up to SECS for running backups, forgets or a gc to end, instead of failing.
    #[arg(long, value_name = "SECS", value_parser = crate::copy::parse_secs)]
    wait: Option<Duration>,
    /// One JSON object: what was found and done.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
struct UnlockArgs {
    #[command(flatten)]
    common: CommonArgs,
    /// Remove every lock, live ones and unreadable ones too: only when you know that no
    /// ferry process uses the repository (a holder on another host that died less than
    /// 30 minutes ago).
    #[arg(long)]
    force: bool,
}

#[derive(Args, Debug)]
struct StatsArgs {
    #[command(flatten)]
    common: CommonArgs,
    #[arg(long)]
    json: bool,
}

pub fn run(args: RepoArgs) -> Result<i32> {
    match args.command {
        RepoCommand::Init(a) => init(a),
        RepoCommand::List(a) => list(a),
        RepoCommand::Check(a) => {
            let repo = a.open()?;
            let r = maint::check(&repo).with_context(|| format!("checking {}", a.repo))?;
            Ok(print_report(&a.repo, &r, false).max(went_back(&a.repo, &repo)))
        }
        RepoCommand::Verify(a) => {
            let repo = a.common.open()?;
            let threads = a.jobs.unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get())).max(1);
            let opts = VerifyOptions { read_data: a.read_data, threads };
            let r = maint::verify(&repo, &opts).with_context(|| format!("verifying {}", a.common.repo))?;
            Ok(print_report(&a.common.repo, &r, true).max(went_back(&a.common.repo, &repo)))
        }
        RepoCommand::Forget(a) => forget(a),
        RepoCommand::Key(a) => crate::repo_key::run(a),
        RepoCommand::Protect(a) => protect(a, true),
        RepoCommand::Unprotect(a) => protect(a, false),
        RepoCommand::Gc(a) if a.dry_run => {
            // The rollback check of the gc it previews: refused where gc would be.
            let repo = a.common.open_with(removing(a.accept_rollback, None, &a.common.repo, "a gc"))?;
            let condemn_margin = a.condemn_margin.unwrap_or_else(maint::condemn_margin_from_env);
            let opts = maint::GcOptions { wait: a.wait, repack_percent: a.repack, condemn_margin };
            let r = maint::gc_dry_run(&repo, &opts).with_context(|| format!("gc --dry-run of {}", a.common.repo))?;
            println!(
                "{}: gc would delete {} packs, repack {}{} and free {} unreferenced chunks: {} -> {} (nothing was \
                 changed)",
                a.common.repo,
                r.packs_deleted,
                r.packs_repacked,
                match r.packs_condemned {
                    0 => String::new(),
                    n => format!(", condemn {n} beside running backups (a later gc deletes them)"),
                },
                r.blobs_freed,
                human(r.bytes_before),
                human(r.bytes_after)
            );
            Ok(0)
        }
        RepoCommand::Gc(a) => {
            let repo = a.common.open_with(removing(a.accept_rollback, None, &a.common.repo, "a gc"))?;
            let condemn_margin = a.condemn_margin.unwrap_or_else(maint::condemn_margin_from_env);
            let opts = maint::GcOptions { wait: a.wait, repack_percent: a.repack, condemn_margin };
            let r = maint::gc_opts(&repo, &opts).with_context(|| format!("gc of {}", a.common.repo))?;
            println!(
                "{}: {} packs deleted, {} repacked, {} unreferenced chunks freed ({}); {} -> {}",
                a.common.repo,
                r.packs_deleted,
                r.packs_repacked,
                r.blobs_freed,
                human(r.bytes_freed),
                human(r.bytes_before),
                human(r.bytes_after)
            );
            if r.packs_condemned + r.packs_waiting + r.packs_spared > 0 {
                println!(
                    "{}: {} packs condemned beside running backups, {} condemned earlier still waiting (a later gc \
                     deletes them once the backups that ran then have ended and {}s have passed), {} in use again",
                    a.common.repo,
                    r.packs_condemned,
                    r.packs_waiting,
                    condemn_margin.as_secs(),
                    r.packs_spared
                );
            }
            Ok(0)
        }
        RepoCommand::Repair(a) => repair(a),
        RepoCommand::Migrate(a) => {
            let repo = a.common.open()?;
            let mut progress = |line: &str| eprintln!("{line}");
            let r = ferry_repo::migrate::migrate(&repo, a.dry_run, &mut progress)
                .with_context(|| format!("migrate of {}", a.common.repo))?;
            let would = if a.dry_run { "would be " } else { "" };
            // A dry run stores nothing, so it cannot tell how many pages are new.
            let pages = if a.dry_run { String::new() } else { format!(" ({} located page(s) stored)", r.pages) };
            println!(
                "{}: version {} to {}{}; {} snapshot(s) {would}migrated{pages}, {} left by an earlier run \
                 {would}finished",
                a.common.repo,
                r.from_version,
                ferry_repo::format::LOCATED_CONFIG_VERSION,
                if r.config { "" } else { " (already)" },
                r.migrated,
                r.finished
            );
            if !r.skipped.is_empty() {
                eprintln!(
                    "{}: {} manifest(s) skipped, damaged (they stay as they were; `ferry repo check` lists the \
                     damage):",
                    a.common.repo,
                    r.skipped.len()
                );
                for s in &r.skipped {
                    eprintln!("  {s}");
                }
                return Ok(crate::exit_status(ferry_repo::Failure::Damaged));
            }
            Ok(0)
        }
        RepoCommand::Unlock(a) => unlock(a),
        RepoCommand::Copy(a) => crate::repo_copy::run(a),
        RepoCommand::Stats(a) => {
            let repo = a.common.open()?;
            let s = maint::stats(&repo).with_context(|| format!("stats of {}", a.common.repo))?;
            if a.json {
                println!("{}", serde_json::to_string_pretty(&s)?);
                return Ok(0);
            }
            let ratio = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
            println!("repository: {}", a.common.repo);
            println!("snapshots: {} of {} disk(s)", s.snapshots, s.disks);
            println!("logical size: {} (the snapshots' sizes added up)", human(s.logical));
            println!(
                "unique data: {} in {} chunks ({:.1}x deduplication)",
                human(s.unique_plain),
                s.chunks,
                ratio(s.logical, s.unique_plain)
            );
            println!("stored: {} ({:.1}x compression)", human(s.unique_stored), ratio(s.unique_plain, s.unique_stored));
            println!("store: {} in {} packs", human(s.store_bytes), s.packs);
            Ok(0)
        }
    }
}

fn init(a: InitArgs) -> Result<i32> {
    let c = &a.common;
    let chunk = parse_size(&a.chunk_size).context("--chunk-size")?;
    if !chunk.is_power_of_two() || !(4096..=ferry_repo::format::MAX_CHUNK_SIZE as u64).contains(&chunk) {
        bail!("--chunk-size must be a power of two from 4K to 1M (64K matches blkhash and dirty bitmaps)");
    }
    let encrypt = if a.encrypt {
        let Some(p) = ferry_open::repo::passphrase(c.password.install())? else {
            bail!(
                "--encrypt needs a passphrase: --password-file FILE (its first line), --password-command CMD, \
                 FERRY_PASSWORD=..., FERRY_PASSWORD_FILE=FILE or FERRY_PASSWORD_COMMAND=CMD"
            );
        };
        Some((p, crate::repo_key::kdf_cost(&a.kdf_memory)?))
    } else {
        if c.password.password_file.is_some() {
            bail!("--password-file without --encrypt: add --encrypt to make an encrypted repository");
        }
        None
    };
    let encrypted = encrypt.is_some();
    let kdf_limit = ferry_open::repo::kdf_limit()?;
    let opts = InitOptions {
        chunk_size: chunk as u32,
        encrypt,
        kdf_limit,
        version: a.format_version.unwrap_or(ferry_repo::format::CONFIG_VERSION),
        ..InitOptions::default()
    };
    let (store, location) = ferry_open::repo::repo_store_at(&c.repo, &c.remote.remote(), true)?;
    let repo = Repository::init(store, &opts).with_context(|| format!("cannot make a repository at {}", c.repo))?;
    ferry_open::repo::remember_new(&c.repo, &location, &repo);
    println!(
        "made the repository {} ({}, chunks of {})",
        c.repo,
        if encrypted { "encrypted" } else { "not encrypted: compressed and checksummed" },
        human(chunk)
    );
    if encrypted {
        eprintln!(
            "keep the passphrase safe: without it nothing in {} can be read, and neither ferry nor anyone else can \
             recover it",
            c.repo
        );
    }
    Ok(0)
}

pub(crate) use ferry_backup::{human, short_id};

/// A manifest's time as lists show it: `2026-11-26 22:00:00`.
fn shown_time(t: &str) -> String {
    let t = t.trim_end_matches('Z').replacen('T', " ", 1);
    t.split('.').next().unwrap_or_default().to_string()
}

pub(crate) fn shown_changes(c: &Changes) -> String {
    match c {
        Changes::Full => "full".into(),
        Changes::DirtyBitmap { bitmap } => format!("dirty-bitmap {bitmap}"),
        Changes::ExtentsFrom { file } => format!("extents-from {file}"),
    }
}

fn snapshot_json(s: &SnapshotInfo) -> serde_json::Value {
    let m: &ManifestSummary = &s.manifest;
    serde_json::json!({
        "id": s.id,
        "name": m.name,
        "time": m.time,
        "size": m.size,
        "parent": m.parent,
        "source": m.source,
        "changes": m.changes,
        "blkhash": m.blkhash,
        "stats": m.stats,
        "host": m.host,
        "copied_from": m.copied_from,
        "tags": m.tags,
        "note": m.note,
    })
}

fn list(a: ListArgs) -> Result<i32> {
    if let Some(n) = &a.name {
        let plain = n.replace(['*', '?'], "a");
        if !ferry_repo::format::valid_name(&plain) {
            bail!(
                "{n:?} is not a disk name (1 to 200 of A-Z a-z 0-9 . _ -, not starting with . or -) nor a pattern of \
                 one (* and ? besides)"
            );
        }
    }
    let repo = a.common.open()?;
    // A manifest that cannot be read is named, and the others listed.
    let (all, bad) = repo.snapshots_lenient().with_context(|| format!("listing {}", a.common.repo))?;
    for (object, e) in &bad {
        eprintln!("unreadable snapshot {object} (of an unknown disk): {}; `ferry repo check` reports it", e.reason());
    }
    let mut snaps: Vec<SnapshotInfo> = all.iter().filter(|s| a.selects(s)).cloned().collect();
    if let Some(n) = a.latest.map(|n| n as usize) {
        // The N last of each disk in the list's order (oldest first).
        let mut left: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
        let mut keep = vec![false; snaps.len()];
        for (i, s) in snaps.iter().enumerate().rev() {
            let c = left.entry(s.manifest.name.clone()).or_insert(n);
            if *c > 0 {
                *c -= 1;
                keep[i] = true;
            }
        }
        let mut k = keep.into_iter();
        snaps.retain(|_| k.next().unwrap_or(false));
    }
    let protected = ferry_repo::retain::protected(&repo).unwrap_or_else(|e| {
        eprintln!("cannot tell which snapshots are protected: {e}");
        Default::default()
    });
    // Snapshots that read a copy `ferry repo verify` recorded damaged, with no good copy.
    let damaged = maint::damaged_snapshots(&repo, &snaps).unwrap_or_else(|e| {
        eprintln!("cannot tell which snapshots are damaged: {e}");
        Default::default()
    });
    if a.json {
        let v: Vec<serde_json::Value> = snaps
            .iter()
            .map(|s| {
                let mut v = snapshot_json(s);
                v["damaged"] = serde_json::Value::Bool(damaged.contains_key(&s.id));
                v["protected"] = serde_json::Value::Bool(ferry_repo::retain::is_protected(&protected, s));
                v
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(0);
    }
    // What is running now (or was, when a process died holding its lock).
    for (object, l, stale) in ferry_repo::lock::list(repo.store()).unwrap_or_default() {
        let what = format!("{} by process {} on {} since {}", l.what(), l.pid, l.host, shown_time(&l.time));
        match stale {
            false => eprintln!("running: {what}"),
            true => eprintln!("stale lock {object}: {what} (the process is gone; the next writer removes it)"),
        }
    }
    // Interrupted backups that `ferry backup --resume` can continue.
    if let Ok((cks, bad)) = repo.checkpoints_lenient() {
        for c in cks.iter().filter(|c| a.name.as_ref().is_none_or(|n| glob(n.as_bytes(), c.checkpoint.name.as_bytes())))
        {
            let ck = &c.checkpoint;
            match c.superseded_by(&all) {
                Some(by) => eprintln!(
                    "leftover checkpoint of {} since {}: its backup stored snapshot {} (nothing to resume; the next \
                     backup of {} removes it)",
                    ck.name,
                    shown_time(&ck.time),
                    short_id(&by.id),
                    ck.name
                ),
                None => eprintln!(
                    "interrupted {} of {} since {}: {} of {} stored ({} continues it)",
                    if ferry_repo::copy::is_copy(ck) { "copy" } else { "backup" },
                    ck.name,
                    shown_time(&ck.time),
                    human(ck.done_bytes()),
                    human(ck.size),
                    if ferry_repo::copy::is_copy(ck) {
                        "`ferry repo copy` run again"
                    } else {
                        "`ferry backup --resume`"
                    }
                ),
            }
        }
        for (object, e) in bad {
            eprintln!("unreadable checkpoint {object}: {e}");
        }
    }
    if snaps.is_empty() {
        let filtered = a.name.is_some() || a.host.is_some() || !a.tags.is_empty();
        match filtered && !all.is_empty() {
            true => eprintln!(
                "no snapshot in {} matches (`ferry repo list {}` lists them all)",
                a.common.repo, a.common.repo
            ),
            false => eprintln!("no snapshots in {}", a.common.repo),
        }
        return Ok(0);
    }
    let w = snaps.iter().map(|s| s.manifest.name.len()).max().unwrap_or(4).max(4);
    println!("{:<8}  {:<19}  {:<w$}  {:>10}  {:>10}  CHANGES", "ID", "TIME", "NAME", "SIZE", "ADDED");
    for s in &snaps {
        let m = &s.manifest;
        let mut more = String::new();
        if damaged.contains_key(&s.id) {
            more.push_str("  DAMAGED");
        }
        if ferry_repo::retain::is_protected(&protected, s) {
            more.push_str("  protected");
        }
        if !m.tags.is_empty() {
            more.push_str(&format!("  tags {}", m.tags.join(",")));
        }
        if !m.note.is_empty() {
            more.push_str(&format!("  note: {}", m.note));
        }
        println!(
            "{:<8}  {:<19}  {:<w$}  {:>10}  {:>10}  {}{more}",
            short_id(&s.id),
            shown_time(&m.time),
            m.name,
            human(m.size),
            human(m.stats.new_stored),
            m.copied_from
                .as_ref()
                .map_or_else(|| shown_changes(&m.changes), |c| format!("copy of {}", short_id(&c.snapshot))),
        );
    }
    let mut hit: Vec<(&String, &String)> = damaged.iter().collect();
    hit.sort();
    for (id, pack) in hit {
        eprintln!(
            "damaged: snapshot {} reads {pack}, which `ferry repo verify` found damaged, and has no good copy of it \
             (`ferry repo check` names the ranges; a backup that reads them again heals it, else forget it)",
            short_id(id)
        );
    }
    crate::libvirt_restore::print_points(&repo, a.name.as_deref(), &all);
    Ok(0)
}

/// Prints what check or verify found; the exit status (13: damage found).
fn print_report(repo: &str, r: &Report, read: bool) -> i32 {
    for n in &r.notes {
        eprintln!("note: {n}");
    }
    for p in &r.problems {
        print_problem(p);
    }
    let what = if read {
        let share = if r.bytes_present == 0 { 100.0 } else { r.bytes_read as f64 * 100.0 / r.bytes_present as f64 };
        format!(
            "{} chunks in {} of {} packs read ({} of {}, {share:.1}%)",
            r.blobs_checked,
            r.packs_read,
            r.packs,
            human(r.bytes_read),
            human(r.bytes_present)
        )
    } else {
        format!("{} packs indexed", r.packs)
    };
    if r.problems.is_empty() {
        println!("{repo}: no damage found: {} snapshots, {what}", r.snapshots);
        0
    } else {
        let mut hit: Vec<&str> = r
            .problems
            .iter()
            .flat_map(|p| p.hits.iter().map(|h| h.0.as_str()).chain(p.more_hits.iter().map(|h| h.0.as_str())))
            .collect();
        hit.sort();
        hit.dedup();
        // Checkpoints of interrupted backups are checked as snapshots, and counted apart.
        let checkpoints = hit.iter().filter(|id| is_checkpoint(id)).count();
        println!(
            "{repo}: {} damaged object(s), {} of {} snapshots affected{}; {what}",
            r.problems.len(),
            hit.len() - checkpoints,
            r.snapshots,
            match checkpoints {
                0 => String::new(),
                1 => ", and 1 interrupted backup".into(),
                n => format!(", and {n} interrupted backups"),
            }
        );
        crate::exit_status(ferry_repo::Failure::Damaged)
    }
}

/// Whether a problem's hit is a checkpoint's (its id the object, `checkpoints/TAG`)
/// rather than a snapshot's.
fn is_checkpoint(id: &str) -> bool {
    id.starts_with("checkpoints/")
}

/// 1, said, when this host's record of the repository found that its store went back
/// (check and verify then fail, as for damage); else 0.
fn went_back(shown: &str, repo: &Repository) -> i32 {
    if !repo.known().is_some_and(|k| k.went_back()) {
        return 0;
    }
    println!(
        "{shown}: the store went back since this host last used it (see the warnings above): find out why; \
         `ferry backup`, `repo forget` or `repo gc` with --accept-rollback accepts it"
    );
    1
}

/// Ranges listed per snapshot before the rest is only counted.
const RANGES_SHOWN: usize = 8;

fn print_problem(p: &Problem) {
    println!("damaged: {}: {}", p.object, p.why);
    if p.hits.is_empty() {
        if p.object.starts_with("snapshots/") {
            println!("  the snapshot it holds cannot be restored; other commands skip it with a warning");
        } else {
            println!("  no snapshot is affected: none uses what it holds, or each reads another, good copy of it");
        }
        return;
    }
    let mut snaps: Vec<(&str, &str)> = p.hits.iter().map(|h| (h.0.as_str(), h.1.as_str())).collect();
    snaps.sort();
    snaps.dedup();
    for (id, name) in snaps {
        let ranges: Vec<(u64, u64)> = p.hits.iter().filter(|h| h.0 == id).map(|h| (h.2, h.3)).collect();
        // Ranges past those listed (a widely scattered damage) are only counted.
        let (more, more_bytes) =
            p.more_hits.iter().filter(|h| h.0 == id).fold((0, 0), |(n, b), h| (n + h.2 as usize, b + h.3));
        let bytes: u64 = ranges.iter().map(|r| r.1).sum::<u64>() + more_bytes;
        let what = match is_checkpoint(id) {
            true => format!("the interrupted backup of {name} ({id})"),
            false => format!("snapshot {} of {name}", short_id(id)),
        };
        let mut line = format!("  {what}: {} in {} range(s):", human(bytes), ranges.len() + more);
        for (o, l) in ranges.iter().take(RANGES_SHOWN) {
            line.push_str(&format!(" {o}+{l}"));
        }
        if ranges.len() + more > RANGES_SHOWN {
            line.push_str(&format!(" and {} more", ranges.len() + more - RANGES_SHOWN));
        }
        println!("{line}");
    }
}

fn forget(a: ForgetArgs) -> Result<i32> {
    if !a.ids.is_empty() {
        return forget_ids(a);
    }
    let (repo_spec, name) = match ferry_open::Location::parse(&a.target) {
        Ok(ferry_open::Location::Repo { repo, name, id: None }) => (repo, Some(name)),
        Ok(ferry_open::Location::Repo { .. }) => {
            bail!(
                "forget applies a policy to REPO or REPO::NAME (without @ID); to forget one snapshot, give its id: \
                 `ferry repo forget REPO ID`"
            )
        }
        _ => (a.target.clone(), None),
    };
    let policy = a.policy();
    if policy.is_empty() {
        bail!(
            "give a policy: --keep-last, --keep-hourly, --keep-daily, --keep-weekly, --keep-monthly and/or \
             --keep-yearly N, --keep-within DURATION, --keep-tag T, or the ids of the snapshots to forget (nothing \
             is forgotten)"
        );
    }
    // A dry run removes nothing: it only warns.
    let on = match a.dry_run {
        true => OnRollback::Warn,
        false => removing(a.accept_rollback, name.clone(), &repo_spec, "a forget"),
    };
    let repo = a.password.open(&repo_spec, &a.remote.remote(), on)?;
    let (before, _) = repo.snapshots_lenient().with_context(|| format!("listing {repo_spec}"))?;
    let r = maint::forget_with(&repo, name.as_deref(), &policy, a.dry_run, a.wait)
        .with_context(|| format!("forget in {repo_spec}"))?;
    print_forget(&a, &repo_spec, &before, &r)
}

impl ForgetArgs {
    fn policy(&self) -> Policy {
        Policy {
            keep_last: self.keep_last,
            keep_hourly: self.keep_hourly,
            keep_daily: self.keep_daily,
            keep_weekly: self.keep_weekly,
            keep_monthly: self.keep_monthly,
            keep_yearly: self.keep_yearly,
            keep_within: self.keep_within,
            keep_tags: self.keep_tags.clone(),
        }
    }
}

fn parse_within(s: &str) -> Result<Within, String> {
    Within::parse(s).map_err(|e| e.to_string())
}

/// `T` or `T1,T2`: tags a snapshot must all have.
fn parse_tag_list(s: &str) -> Result<Vec<String>, String> {
    let tags: Vec<String> = s.split(',').map(str::to_string).collect();
    match tags.iter().all(|t| ferry_repo::format::valid_tag(t)) {
        true => Ok(tags),
        false => Err("each tag is 1 to 64 of A-Z a-z 0-9 . _ - + @ : = (T, or T1,T2 for snapshots with both)".into()),
    }
}

/// `ferry repo forget REPO[::NAME] ID...`.
fn forget_ids(a: ForgetArgs) -> Result<i32> {
    let (repo_spec, name) = match ferry_open::Location::parse(&a.target) {
        Ok(ferry_open::Location::Repo { repo, name, id: None }) => (repo, Some(name)),
        Ok(ferry_open::Location::Repo { .. }) => {
            bail!("write the snapshots to forget as REPO ID... (or REPO::NAME ID...), without @ID")
        }
        _ => (a.target.clone(), None),
    };
    if !a.policy().is_empty() {
        bail!("give either snapshot ids or a policy (--keep-*), not both");
    }
    // A dry run removes nothing: it only warns.
    let on = match a.dry_run {
        true => OnRollback::Warn,
        false => removing(a.accept_rollback, name.clone(), &repo_spec, "a forget"),
    };
    let repo = a.password.open(&repo_spec, &a.remote.remote(), on)?;
    // A manifest that cannot be read can still be forgotten by its id.
    let (before, _) = repo.snapshots_lenient().with_context(|| format!("listing {repo_spec}"))?;
    let r = maint::forget_ids(&repo, name.as_deref(), &a.ids, a.dry_run, a.wait)
        .with_context(|| format!("forget in {repo_spec}"))?;
    for id in r.removed.iter().filter(|id| !a.json && !before.iter().any(|s| s.id == **id)) {
        let verb = if a.dry_run { "would remove" } else { "removed" };
        println!("{verb:<12}  {}  (its manifest cannot be read)", short_id(id));
    }
    print_forget(&a, &repo_spec, &before, &r)
}

/// What forget kept and removed: one line each, then the counts (or one JSON object).
fn print_forget(a: &ForgetArgs, repo_spec: &str, before: &[SnapshotInfo], r: &maint::ForgetReport) -> Result<i32> {
    for n in &r.notes {
        eprintln!("note: {n}");
    }
    if a.json {
        let v = serde_json::json!({ "kept": r.kept, "removed": r.removed, "reasons": r.reasons, "dry_run": a.dry_run });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(0);
    }
    let verb = if a.dry_run { "would remove" } else { "removed" };
    for s in before {
        let m = &s.manifest;
        let state = if r.removed.contains(&s.id) {
            verb
        } else if r.kept.contains(&s.id) {
            "kept"
        } else {
            continue;
        };
        let why = r.reasons.get(&s.id).map_or(String::new(), |w| format!("  ({})", w.join(", ")));
        println!("{state:<12}  {}  {}  {}{why}", short_id(&s.id), shown_time(&m.time), m.name);
    }
    println!(
        "{} kept, {} {verb}{}",
        r.kept.len(),
        r.removed.len(),
        if a.dry_run || r.removed.is_empty() {
            String::new()
        } else {
            format!("; run `ferry repo gc {repo_spec}` to free their data")
        }
    );
    Ok(0)
}

/// A snapshot named with its id, REPO::NAME@ID (a usage error, exit 2, otherwise).
fn parse_snapshot_with_id(s: &str) -> Result<String, String> {
    match ferry_open::Location::parse(s) {
        Ok(ferry_open::Location::Repo { id: Some(_), .. }) => Ok(s.to_string()),
        _ => Err("give the snapshot as REPO::NAME@ID (`ferry repo list REPO` shows the ids)".into()),
    }
}

/// `ferry repo protect|unprotect REPO::NAME@ID`.
fn protect(a: ProtectArgs, on: bool) -> Result<i32> {
    let (repo_spec, name, id) = match ferry_open::Location::parse(&a.snapshot) {
        Ok(ferry_open::Location::Repo { repo, name, id: Some(id) }) => (repo, name, id),
        _ => bail!("give the snapshot as REPO::NAME@ID (`ferry repo list REPO` shows the ids)"),
    };
    let repo = a.password.open(&repo_spec, &a.remote.remote(), OnRollback::Warn)?;
    let snap = repo.resolve(&name, Some(&id))?;
    let changed = ferry_repo::retain::set_protected(&repo, &snap, on, a.wait)
        .with_context(|| format!("{} {repo_spec}::{name}@{id}", if on { "protecting" } else { "unprotecting" }))?;
    let what = format!("snapshot {} of {name}", short_id(&snap.id));
    match (on, changed) {
        (true, true) => println!("protected {what}: `ferry repo forget` keeps it until `ferry repo unprotect`"),
        (true, false) => println!("{what} was protected already"),
        (false, true) => println!("unprotected {what}: the retention policy decides on it again"),
        (false, false) => println!("{what} was not protected"),
    }
    Ok(0)
}

fn repair(a: RepairArgs) -> Result<i32> {
    let repo = a.common.open()?;
    let opts = RepairOptions { drop_damaged: a.drop_damaged, dry_run: a.dry_run, wait: a.wait };
    let r = recover::repair(&repo, &opts).with_context(|| format!("repair of {}", a.common.repo))?;
    // Damage that stays: packs that cannot be indexed, objects kept without --drop-damaged.
    let kept = r.manifests.len() + r.checkpoints.len();
    let left = !r.packs_unreadable.is_empty() || (!a.drop_damaged && kept > 0);
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
        return Ok(damage_left(left));
    }
    let (would, done) = if a.dry_run { ("would ", "would be ") } else { ("", "") };
    for p in &r.packs_indexed {
        println!("{would}index {p} again (from its trailer)");
    }
    for n in &r.index_written {
        println!("wrote {n}");
    }
    for n in &r.index_removed {
        if r.index_written.contains(&n.object) {
            println!("replaced the damaged index object {} (rebuilt with the same bytes): {}", n.object, n.why);
        } else {
            println!("{would}remove the damaged index object {}: {}", n.object, n.why);
        }
    }
    for n in &r.damage_removed {
        println!(
            "{would}remove the damaged damage record {}: {} (`ferry repo verify` finds the damage again)",
            n.object, n.why
        );
    }
    for n in &r.packs_unreadable {
        println!("cannot index {}: {} (left as it is; `ferry repo verify` tells what it affects)", n.object, n.why);
    }
    for (what, list) in [("manifest", &r.manifests), ("checkpoint", &r.checkpoints)] {
        for n in list {
            if a.drop_damaged {
                println!("{would}remove the damaged {what} {}: {}", n.object, n.why);
            } else {
                println!("damaged {what} {}: {} (kept: --drop-damaged removes it)", n.object, n.why);
            }
        }
    }
    println!(
        "{}: {} of {} packs {done}indexed again ({} chunks){}; {} damaged index object(s) {done}removed{}",
        a.common.repo,
        r.packs_indexed.len(),
        r.packs,
        r.blobs_indexed,
        if r.index_written.is_empty() {
            String::new()
        } else {
            format!(" in {} new index object(s)", r.index_written.len())
        },
        r.index_removed.len(),
        if left { "; some damage remains (see above)" } else { "" }
    );
    Ok(damage_left(left))
}

/// The exit status of a repair: "damage found" when some stays.
fn damage_left(left: bool) -> i32 {
    if left {
        crate::exit_status(ferry_repo::Failure::Damaged)
    } else {
        0
    }
}

/// `2h05m` for people.
fn shown_age(secs: Option<u64>) -> String {
    match secs {
        None => "unknown".into(),
        Some(s) if s < 120 => format!("{s}s"),
        Some(s) if s < 7200 => format!("{}m", s / 60),
        Some(s) => format!("{}h{:02}m", s / 3600, s / 60 % 60),
    }
}

fn unlock(a: UnlockArgs) -> Result<i32> {
    let repo = a.common.open()?;
    let r = recover::unlock(repo.store(), a.force).with_context(|| format!("unlock of {}", a.common.repo))?;
    let show = |l: &recover::LockShown| {
        if l.kind.is_empty() {
            format!("{}: {}", l.object, l.state)
        } else {
            format!(
                "{}: {} by process {} on {}, taken {} ago ({}): {}",
                l.object,
                l.kind,
                l.pid,
                l.host,
                shown_age(l.age_secs),
                shown_time(&l.time),
                l.state
            )
        }
    };
    for l in &r.removed {
        println!("removed {}", show(l));
    }
    for l in &r.kept {
        println!("kept {} (`--force` removes it, if you know that no ferry process uses the repository)", show(l));
    }
    println!("{}: {} lock(s) removed, {} kept", a.common.repo, r.removed.len(), r.kept.len());
    Ok(0)
}

#[cfg(test)]
mod tests {
    #[test]
    fn shown_ages() {
        assert_eq!(super::shown_age(Some(5)), "5s");
        assert_eq!(super::shown_age(Some(600)), "10m");
        assert_eq!(super::shown_age(Some(7500)), "2h05m");
        assert_eq!(super::shown_age(None), "unknown");
    }

    #[test]
    fn globs() {
        for (p, n, want) in [
            ("vm1", "vm1", true),
            ("vm1", "vm1-off", false),
            ("vm*", "vm1-off", true),
            ("*-off", "vm1-off", true),
            ("*-off", "vm1-of", false),
            ("vm?", "vm1", true),
            ("vm?", "vm12", false),
            ("*a*b*", "xaxxbx", true),
            ("*a*b", "xaxxbx", false),
            ("*", "anything", true),
        ] {
            assert_eq!(super::glob(p.as_bytes(), n.as_bytes()), want, "{p} {n}");
        }
    }
}
