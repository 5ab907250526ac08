//! `ferry repo copy SRC[::NAME[@ID]] DST`: snapshots copied into another repository
//! (crates/repo/src/copy.rs does the work).

use crate::repo::{human, short_id};
use anyhow::{bail, Context, Result};
use clap::Args;
use ferry_open::repo::Keying;
use ferry_repo::copy::{self, CopyOptions, Event, Select};
use ferry_repo::known::OnRollback;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

#[derive(Args, Debug)]
pub struct CopyArgs {
    /// What to copy: a repository (every snapshot), REPO::NAME (every snapshot of a disk)
    /// or REPO::NAME@ID (one snapshot). REPO: a directory or s3://BUCKET/PREFIX.
    from: String,
    /// The repository to copy into (made beforehand with `ferry repo init`; its own
    /// chunk size, encryption and key).
    to: String,
    /// The passphrase of an encrypted source.
    #[command(flatten)]
    password: crate::password_args::PasswordArgs,
    /// The passphrase of an encrypted destination: the first line of FILE (else
    /// FERRY_TO_PASSWORD, else FERRY_TO_PASSWORD_FILE, else the source's passphrase).
    #[arg(long, value_name = "FILE")]
    to_password_file: Option<PathBuf>,
    /// Copy an encrypted source into an unencrypted destination (its disks stored there in
    /// plain text). Without it such a copy is refused: whoever can write the destination's
    /// store could have replaced an encrypted repository's config with an unencrypted one.
    #[arg(long)]
    to_unencrypted: bool,
    /// Show progress on stderr: each snapshot as it starts, and a bar (percentages when
    /// stderr is not a terminal).
    #[arg(short, long)]
    progress: bool,
    /// One JSON object: the snapshots copied, skipped and failed, chunks and bytes sent.
    #[arg(long)]
    json: bool,
    /// Chunks read and stored at once. Default: one per core, 4 to 16.
    #[arg(short = 'j', long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=256))]
    jobs: Option<u16>,
    /// Read at most this many bytes per second from the source (e.g. 20M; chunks the
    /// destination has already cost nothing).
    #[arg(long, value_name = "BYTES", value_parser = crate::copy::parse_rate)]
    rate: Option<u64>,
    /// Wait up to SECS for the locks (a forget or gc of the source, a backup of the same
    /// disk into the destination), instead of failing.
    #[arg(long, value_name = "SECS", value_parser = crate::copy::parse_secs)]
    wait: Option<Duration>,
    /// Copy even though the destination's snapshots went back since this host last used
    /// it (a disk's newest gone), accepting its state. Without it such a copy is refused.
    #[arg(long)]
    accept_rollback: bool,
    #[command(flatten)]
    remote: crate::remote_args::RemoteArgs,
}

/// Where the destination's passphrase given comes from, for messages.
fn to_passphrase_source(file: Option<&Path>) -> String {
    match (file, std::env::var_os("FERRY_TO_PASSWORD")) {
        (Some(f), _) => format!("--to-password-file {}", f.display()),
        (None, Some(_)) => "FERRY_TO_PASSWORD".into(),
        (None, None) => "FERRY_TO_PASSWORD_FILE".into(),
    }
}

/// Refuses copying an encrypted source (`src_encrypted`) into an unencrypted destination
/// unless `allowed` (`--to-unencrypted`): the destination's config may have been replaced
/// by one without a key (the source's passphrase, tried on the destination when none is
/// given for it, would not notice), and the disks would then be stored in plain text.
fn refuse_plain_copy(src_encrypted: bool, dst_encrypted: bool, allowed: bool, from: &str, to: &str) -> Result<()> {
    if src_encrypted && !dst_encrypted && !allowed {
        bail!(
            "{from} is encrypted but {to} is not: refused, because the copies would be stored there in plain text \
             (and someone who can write {to}'s store can replace an encrypted repository's config with an \
             unencrypted one). Nothing was copied. If {to} is meant to be unencrypted, add --to-unencrypted"
        );
    }
    Ok(())
}

pub fn run(a: CopyArgs) -> Result<i32> {
    let (src_repo, select) = match ferry_open::Location::parse(&a.from) {
        Ok(ferry_open::Location::Repo { repo, name, id: None }) => (repo, Select::Disk(name)),
        Ok(ferry_open::Location::Repo { repo, name, id: Some(id) }) => (repo, Select::One { name, id }),
        _ => (a.from.clone(), Select::All),
    };
    if matches!(ferry_open::Location::parse(&a.to), Ok(ferry_open::Location::Repo { .. })) {
        bail!("the destination is a repository, not a snapshot: write DST without ::NAME (copies keep their names)");
    }
    let remote = a.remote.remote();
    // The source's passphrase, kept for the destination: a password command runs once.
    let (src, src_passphrase) = a.password.open_giving(&src_repo, &remote, OnRollback::Warn)?;
    let given = ferry_open::repo::to_passphrase(a.to_password_file.as_deref())?
        .map(|p| (p, to_passphrase_source(a.to_password_file.as_deref())));
    let fallback = match given {
        Some(_) => None,
        None => src_passphrase,
    };
    let keying = Keying {
        given,
        fallback,
        how: "give its passphrase with --to-password-file FILE, FERRY_TO_PASSWORD=... or FERRY_TO_PASSWORD_FILE=FILE \
              (the source's passphrase is tried when none is given)",
        sources: "--to-password-file, FERRY_TO_PASSWORD or FERRY_TO_PASSWORD_FILE",
    };
    let on = match a.accept_rollback {
        true => OnRollback::Accept,
        false => OnRollback::Refuse {
            disk: None,
            back: false,
            way_out: format!(
                "a copy would continue the disks from older snapshots. Find out why first (`ferry repo list {}`); if \
                 they were removed on purpose, run it again with --accept-rollback",
                a.to
            ),
            damaged: None,
        },
    };
    let dst = ferry_open::repo::open_repository_keyed(&a.to, &remote, keying, on)?;
    refuse_plain_copy(src.crypto().is_encrypted(), dst.crypto().is_encrypted(), a.to_unencrypted, &a.from, &a.to)?;
    let cancel = crate::interrupt::install()?;
    let throttle = a.rate.map(|r| {
        let limit = ferry_client::copy::RateLimit::new(r);
        let stop = cancel.clone();
        Arc::new(move |bytes| limit.take(bytes, || stop.load(Ordering::SeqCst))) as copy::Throttle
    });
    let mut opts = CopyOptions {
        checkpoint_every: Some(crate::backup::checkpoint_every()?),
        wait_lock: a.wait,
        cancel: Some(cancel),
        throttle,
        ..CopyOptions::default()
    };
    if let Some(j) = a.jobs {
        opts.threads = j as usize;
    }
    let progress = copy::Progress::default();
    let shown = ferry_client::copy::Progress::default();
    let stop = AtomicBool::new(false);
    let on_event = |e: Event| match e {
        Event::Start { snap, at, of, resumed } if a.progress => {
            let m = &snap.manifest;
            let more = resumed.map_or(String::new(), |n| format!(", resuming: {} stored already", human(n)));
            eprintln!(
                "copying snapshot {} of {} ({} of {of}, {}){more}",
                short_id(&snap.id),
                m.name,
                at + 1,
                human(m.size)
            );
        }
        Event::Start { .. } => {}
        Event::Copied(c) if !a.json => println!(
            "copied snapshot {} of {} as {}: {}, {} read, {} sent ({} new chunks){}",
            short_id(&c.source_id),
            c.name,
            short_id(&c.id),
            human(c.size),
            human(c.bytes_read),
            human(c.bytes_sent),
            c.chunks_sent,
            if c.rechunked { ", cut into the destination's chunk size" } else { "" }
        ),
        Event::Skipped(s) if !a.json => {
            println!("skipped snapshot {} of {}: {} has it ({})", short_id(&s.source_id), s.name, a.to, short_id(&s.id))
        }
        Event::Failed(f) => eprintln!("cannot copy: {}", f.error),
        _ => {}
    };
    let report = std::thread::scope(|s| {
        let shows = a.progress.then(|| {
            s.spawn(|| crate::copy::show_progress(&shown, &stop));
            s.spawn(|| {
                // The library's counters, as the bar reads them.
                while !stop.load(Ordering::SeqCst) {
                    shown.total.store(progress.total.load(Ordering::Relaxed), Ordering::Relaxed);
                    shown.done.store(progress.done.load(Ordering::Relaxed), Ordering::Relaxed);
                    std::thread::sleep(Duration::from_millis(50));
                }
            })
        });
        let r = copy::copy(&src, &dst, &select, &opts, &progress, &on_event);
        stop.store(true, Ordering::SeqCst);
        drop(shows);
        r
    });
    let report = report.map_err(|e| match e {
        ferry_repo::Error::Interrupted => {
            anyhow::anyhow!("the copy into {} stopped (what it stored is kept: running it again continues)", a.to)
        }
        e => anyhow::Error::new(e),
    });
    let report = report.with_context(|| format!("copying {} into {}", a.from, a.to))?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!(
            "{} -> {}: {} snapshot(s) copied, {} skipped (there already), {} failed; {} chunks sent ({}), {} read",
            a.from,
            a.to,
            report.copied.len(),
            report.skipped.len(),
            report.failed.len(),
            report.chunks_sent,
            human(report.bytes_sent),
            human(report.bytes_read)
        );
    }
    Ok(i32::from(!report.failed.is_empty()))
}

#[cfg(test)]
mod tests {
    use super::refuse_plain_copy;

    #[test]
    fn an_encrypted_source_is_copied_into_plain_text_only_when_asked() {
        assert!(refuse_plain_copy(true, false, false, "a", "b").is_err());
        assert!(refuse_plain_copy(true, false, true, "a", "b").is_ok());
        for (src, dst) in [(true, true), (false, false), (false, true)] {
            assert!(refuse_plain_copy(src, dst, false, "a", "b").is_ok());
        }
    }
}
