//! `ferry backup SRC REPO::NAME`: a new snapshot of the disk NAME in a backup repository.
//!
//! The source is opened as `ferry copy` opens it; the destination is a
//! [`ferry_repo::SnapshotWriter`] on top of NAME's latest snapshot (the base), and the copy
//! engine moves the data: every range without a change map, only the changed ranges with
//! `--dirty-bitmap` or `--extents-from` (everything else is the base's). Holes and zero
//! ranges are never stored: without a base the writer reads as zeroes and they are skipped;
//! on a base they are written as zeroes (an entry, no data).

use crate::remote_args::shown;
use crate::repo::{human, short_id};
use anyhow::{bail, Context, Result};
use clap::Args;
use ferry_client::copy::{copy, BackendEndpoint, CopyOptions, Endpoint, Progress};
use ferry_client::ConnectOptions;
use ferry_open::Location;
use ferry_proto::consts::META_DIRTY_BITMAP_PREFIX;
use ferry_repo::format::Changes;
use ferry_repo::{BackupOptions, SnapshotWriter};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// Packs are closed at this size: few objects (and requests, on S3) per backup.
const PACK_SIZE: usize = 32 << 20;
/// zstd level of new chunks.
const LEVEL: i32 = 3;

#[derive(Args, Debug)]
pub struct BackupArgs {
    /// What to back up: anything `ferry copy` reads (an NBD URI such as qemu-nbd -B's or a
    /// libvirt pull-mode backup's export, a raw or qcow2 image, rbd:, http(s)://, s3://).
    src: String,
    /// The disk's snapshots: REPO::NAME, REPO a directory made by `ferry repo init` or
    /// s3://BUCKET/PREFIX; NAME 1 to 200 of A-Z a-z 0-9 . _ - (not starting with . or -).
    dst: String,
    /// Read only the ranges the source's dirty bitmap BITMAP marks (its
    /// qemu:dirty-bitmap:BITMAP context: qemu-nbd -B, libvirt pull mode,
    /// qemu-storage-daemon, ferry serve -B); everything else is taken from NAME's latest
    /// snapshot. The bitmap must hold every change since that snapshot was taken.
    #[arg(long, value_name = "BITMAP", conflicts_with = "extents_from")]
    dirty_bitmap: Option<String>,
    /// Read only the ranges listed in FILE (as `ferry copy --extents-from` takes them);
    /// everything else is taken from NAME's latest snapshot.
    #[arg(long, value_name = "FILE")]
    extents_from: Option<String>,
    /// Print the new snapshot as one JSON object.
    #[arg(long)]
    json: bool,
    /// Show progress: a bar with rate and ETA on a terminal, percentages otherwise.
    #[arg(short, long)]
    progress: bool,
    /// Most bytes read per second (K, M, G suffixes; 1K to 1T). Holes and zero ranges are free.
    #[arg(long, value_name = "BYTES_PER_SEC", value_parser = crate::copy::parse_rate)]
    rate: Option<u64>,
    /// Retries of a failed NBD request or connection, as `ferry copy --retries` (0 to 100).
    #[arg(long, value_name = "N", default_value_t = ferry_client::copy::DEFAULT_RETRIES,
          value_parser = clap::value_parser!(u32).range(0..=ferry_client::copy::MAX_RETRIES as i64))]
    retries: u32,
    /// Seconds before the first retry, doubled for each further one (0 to 60).
    #[arg(long, value_name = "SECS", default_value = "0.5", value_parser = crate::copy::parse_retry_delay)]
    retry_delay: Duration,
    /// Connections to the NBD server (where it allows several), as `ferry copy -C`.
    #[arg(short = 'C', long, value_name = "N")]
    connections: Option<usize>,
    /// Read a local source even while another program writes it (qemu-img's -U); the
    /// snapshot may then not match any state of the source.
    #[arg(short = 'U', long)]
    force_share: bool,
    /// The repository's passphrase: the first line of FILE (else FERRY_PASSWORD, else
    /// FERRY_PASSWORD_FILE).
    #[arg(long, value_name = "FILE")]
    password_file: Option<std::path::PathBuf>,
    /// Wait up to SECS for a running backup of the same disk (or a gc) to end, instead of
    /// failing at once.
    #[arg(long, value_name = "SECS", value_parser = crate::copy::parse_secs)]
    wait: Option<Duration>,
    #[command(flatten)]
    remote: crate::remote_args::RemoteArgs,
}

pub fn run(args: BackupArgs, quiet: bool) -> Result<i32> {
    let cancel = crate::interrupt::install()?;
    let src_loc = Location::parse(&args.src).with_context(|| format!("source {:?}", shown(&args.src)))?;
    let (repo_spec, name) = match Location::parse(&args.dst).with_context(|| format!("{:?}", shown(&args.dst)))? {
        Location::Repo { repo, name, id: None } => (repo, name),
        Location::Repo { repo, name, id: Some(_) } => {
            bail!("a backup makes a new snapshot of a disk: write {repo}::{name}, without @ID")
        }
        _ => bail!("{:?} is not a disk in a backup repository: write REPO::NAME", shown(&args.dst)),
    };
    let target = format!("{repo_spec}::{name}");
    if matches!(src_loc, Location::Repo { .. }) {
        bail!(
            "the source {:?} is a snapshot already: restore it with ferry copy, or back up the disk itself",
            args.src
        );
    }
    let mut remote = args.remote.remote();
    remote.http.retries = args.retries;
    remote.http.retry_delay = args.retry_delay;
    let repo = ferry_open::repo::open_repository(&repo_spec, &remote, args.password_file.as_deref())?;

    let source = ferry_open::source(&src_loc, args.force_share, &remote)
        .with_context(|| format!("source {:?}", shown(&args.src)))?;
    let src = &source.endpoint;
    let size = ferry_open::source_size(src).with_context(|| format!("source {:?}", shown(&args.src)))?;
    let ranges = match &args.extents_from {
        Some(f) => Some(Arc::new(
            ferry_client::copy::ranges::parse_extents_from(f).map_err(|e| anyhow::anyhow!("--extents-from: {e}"))?,
        )),
        None => None,
    };
    let changes = match (&args.dirty_bitmap, &args.extents_from) {
        (Some(b), _) => Changes::DirtyBitmap { bitmap: b.clone() },
        (None, Some(f)) => Changes::ExtentsFrom { file: f.clone() },
        (None, None) => Changes::Full,
    };
    let selective = changes != Changes::Full;
    let flag = if args.dirty_bitmap.is_some() { "--dirty-bitmap" } else { "--extents-from" };
    // The base is read again once the disk's lock is held: a backup of the disk that
    // ended while this one waited for the lock made a newer snapshot, and a change map
    // continues the latest one.
    let mut tries = 0;
    let (writer, zeroed) = loop {
        let base = choose_base(&repo, &name, &target, size, selective, flag)?;
        let zeroed = base.is_none();
        let base_id = base.as_ref().map(|b| b.id.clone());
        let opts = BackupOptions {
            name: name.clone(),
            size,
            base,
            source: shown(&args.src),
            changes: changes.clone(),
            pack_size: PACK_SIZE,
            level: LEVEL,
            wait_lock: args.wait,
        };
        let writer =
            SnapshotWriter::start(repo.clone(), opts).with_context(|| format!("cannot back up into {target}"))?;
        let now = choose_base(&repo, &name, &target, size, selective, flag)?.map(|s| s.id);
        if now == base_id {
            break (writer, zeroed);
        }
        // Released by the drop; taken again with the newer base.
        drop(writer);
        tries += 1;
        if tries > 3 {
            bail!("the snapshots of {target} keep changing while this backup starts: try again");
        }
    };
    let dst = BackendEndpoint::new(target.clone(), writer.clone());
    let dst = Endpoint::Backend(if zeroed { dst.zeroed() } else { dst });

    let request_size = 1usize << 20;
    let copy_opts = CopyOptions {
        connections: args
            .connections
            .or_else(|| ferry_open::copy_workers(&src_loc, &Location::Null))
            .unwrap_or_else(crate::copy::default_connections),
        requests: 4,
        request_size,
        zero_block: ferry_client::copy::DEFAULT_ZERO_BLOCK,
        sparse: true,
        send_file: false,
        flush: false,
        connect: ConnectOptions::default(),
        hash: None,
        select_context: args.dirty_bitmap.as_ref().map(|n| format!("{META_DIRTY_BITMAP_PREFIX}{n}")),
        ranges,
        retry: ferry_client::copy::RetryPolicy {
            retries: args.retries,
            delay: args.retry_delay,
            request_timeout: None,
        },
        rate: args.rate,
        journal: None,
        cancel: Some(cancel),
    };
    let progress = Progress::default();
    let stop = std::sync::atomic::AtomicBool::new(false);
    let report = std::thread::scope(|s| {
        let bar = (args.progress && !quiet).then(|| s.spawn(|| crate::copy::show_progress(&progress, &stop)));
        let r = copy(src, &dst, &copy_opts, &progress);
        stop.store(true, Ordering::SeqCst);
        if let Some(h) = bar {
            let _ = h.join();
        }
        r
    });
    let report =
        report
            .and_then(|r| if copy_opts.cancelled() { Err(ferry_client::copy::CopyError::Interrupted) } else { Ok(r) });
    let report =
        report.with_context(|| format!("backing up {} into {target} (no snapshot was made)", shown(&args.src)))?;
    let read = report.data_bytes + report.zero_bytes;
    let snap = writer.commit(read).with_context(|| format!("cannot store the snapshot of {target}"))?;
    let m = &snap.manifest;
    if args.json {
        let doc = serde_json::json!({
            "id": snap.id,
            "name": m.name,
            "time": m.time,
            "size": m.size,
            "read": read,
            "new_chunks": m.stats.new_chunks,
            "new_stored": m.stats.new_stored,
            "parent": m.parent,
            "changes": m.changes,
        });
        println!("{doc}");
    } else {
        println!(
            "snapshot {} of {}: {}, {} read, {} added ({} new chunks)",
            short_id(&snap.id),
            m.name,
            human(m.size),
            human(read),
            human(m.stats.new_stored),
            m.stats.new_chunks
        );
    }
    Ok(0)
}

/// The latest snapshot of `name`, if it has one.
fn latest(repo: &ferry_repo::Repository, name: &str, target: &str) -> Result<Option<ferry_repo::SnapshotInfo>> {
    match repo.resolve(name, None) {
        Ok(s) => Ok(Some(s)),
        Err(ferry_repo::Error::NotFound(_)) => Ok(None),
        Err(e) => Err(anyhow::Error::new(e).context(format!("cannot find the latest snapshot of {target}"))),
    }
}

/// What the new snapshot starts from: the latest of the disk, unless there is none or it
/// has another size. A change map needs one of the source's size.
fn choose_base(
    repo: &ferry_repo::Repository,
    name: &str,
    target: &str,
    size: u64,
    selective: bool,
    flag: &str,
) -> Result<Option<ferry_repo::SnapshotInfo>> {
    Ok(match latest(repo, name, target)? {
        None if selective => bail!(
            "{target} has no snapshot yet, and the first backup of {name} reads everything: run it without {flag}"
        ),
        Some(b) if b.manifest.size != size && selective => bail!(
            "the source is {size} bytes but the latest snapshot of {name} ({}) is {} bytes: a change map cannot \
             continue a disk of another size; take a full backup (without {flag})",
            short_id(&b.id),
            b.manifest.size
        ),
        Some(b) if b.manifest.size != size => {
            log::info!(
                "the source is {size} bytes, the latest snapshot of {name} {}: reading everything (what is stored \
                 already is not stored again)",
                b.manifest.size
            );
            None
        }
        b => b,
    })
}
