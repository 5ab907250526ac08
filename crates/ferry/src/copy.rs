//! `ferry copy SRC DST`.

use crate::remote_args::shown;
use anyhow::{Context, Result};
use clap::Args;
use ferry_backend::parse_size;
use ferry_client::copy::{copy, CopyOptions, Endpoint, Progress};
use ferry_client::ConnectOptions;
use ferry_open::{DestinationOptions, Format, Location};
use ferry_proto::consts::META_DIRTY_BITMAP_PREFIX;
use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[path = "copy_resume.rs"]
mod resume;

#[derive(Args, Debug)]
pub struct CopyArgs {
    /// Source: an NBD URI (nbd://HOST[:PORT]/EXPORT, nbd+unix:///EXPORT?socket=PATH), a
    /// file or block device (a qcow2 image is read through its format), qcow2:PATH,
    /// raw:PATH, a Ceph RBD image (rbd:POOL/IMAGE[@SNAP][?conf=PATH&id=USER&keyring=PATH]),
    /// a FIFO (read to its end), `-` for stdin, or a snapshot in a backup repository
    /// (REPO::NAME for the latest, REPO::NAME@ID). Character devices have no size and are
    /// refused.
    src: String,
    /// Destination: an NBD URI, a file or block device (PATH.qcow2 or qcow2:PATH makes a new
    /// qcow2 image; see --format), an RBD image (created with the source's size if it does
    /// not exist), a character device or FIFO (written in order, like a pipe: /dev/null,
    /// a tape), `-` for stdout, or `null:` to discard.
    dst: String,
    /// Do not create, empty or resize DST (qemu-img convert's -n): it must exist and be at
    /// least the source's size; the source is written over its start (holes as zeroes),
    /// and what lies past the source's end stays. A qcow2 DST is written through its format.
    #[arg(short = 'n', long = "no-create", conflicts_with_all = ["backing", "resume"])]
    no_create: bool,
    /// Copy the source from this byte offset on (K, M, G suffixes): a byte range of a disk
    /// or snapshot, written at the start of DST. Any byte offset: nothing is aligned (a
    /// snapshot's reads fetch the whole chunks they fall in). Not for NBD or stdin sources.
    #[arg(long, value_name = "BYTES", conflicts_with_all = ["resume", "dirty_bitmap", "extents_from"])]
    offset: Option<String>,
    /// Copy this many bytes of the source (from --offset, else from its start); default:
    /// to its end. The range must lie inside the source.
    #[arg(long, value_name = "BYTES", conflicts_with_all = ["resume", "dirty_bitmap", "extents_from"])]
    length: Option<String>,
    /// Connections to each NBD server (used only where the server allows multi-conn:
    /// one otherwise). Default: one per CPU core this process may run on, at least 4 and
    /// at most 16 (each connection has its own worker thread; on 16 cores 16 copied
    /// ferry serve to null: at 41 GiB/s, 4 at 21); 8 when an end is an RBD, HTTP(S) or
    /// S3 image (its workers wait for the network, not for a core).
    #[arg(short = 'C', long, value_name = "N")]
    connections: Option<usize>,
    /// Requests in flight per connection. Default: 4 MiB worth (4 of 1M), at most 64;
    /// raise it for links with a long round trip (on loopback more measured slower).
    #[arg(short = 'R', long, value_name = "N")]
    requests: Option<usize>,
    /// Bytes per request (K, M suffixes; at most 32M). Default: 1M (fewer, larger
    /// requests and replies; measured faster), 8M onto s3:// (a part's size). Zeroes are detected in blocks of 256K
    /// within a request, or of 1/128 of the request when that is larger.
    #[arg(long, value_name = "BYTES")]
    request_size: Option<String>,
    /// Detect zeroes: zero blocks and source holes are not written as data (the
    /// destination gets WRITE_ZEROES or holes). `--sparse=false` writes every byte.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    sparse: bool,
    /// Write every byte, holes and zeroes too, so the destination ends fully allocated
    /// (nbdcopy's --allocated; the same as --sparse=false).
    #[arg(long, conflicts_with = "sparse")]
    allocated: bool,
    /// One connection with one request in flight (nbdcopy's --synchronous; the same as
    /// -C 1 -R 1): for a server that cannot take several requests at once.
    #[arg(long, conflicts_with_all = ["connections", "requests"])]
    synchronous: bool,
    /// Read a local file's data into buffers and send them, instead of sendfile(2) from
    /// the page cache to an NBD server.
    #[arg(long)]
    no_sendfile: bool,
    /// Flush the destination at the end (NBD FLUSH, or fsync).
    #[arg(long)]
    flush: bool,
    /// Show progress: a bar with rate and ETA on a terminal, percentages otherwise.
    #[arg(short, long)]
    progress: bool,
    /// Print a summary of what was copied, with socket statistics.
    #[arg(long)]
    stats: bool,
    #[command(flatten)]
    sockets: crate::sockopts::SocketArgs,
    #[command(flatten)]
    remote: crate::remote_args::RemoteArgs,
    /// Also compute the blkhash of the data while copying (sha256 unless named:
    /// sha512, sha1, md5, blake3) and print it like `ferry hash` does.
    #[arg(long, value_name = "DIGEST", num_args = 0..=1, require_equals = true, default_missing_value = "sha256")]
    hash: Option<ferry_hash::Algorithm>,
    /// Block size of the blkhash.
    #[arg(long, default_value = "64K", value_name = "BYTES")]
    hash_block_size: String,
    /// After the copy, read the destination back and compare its blkhash with the
    /// source's (computed on the way): both digests are printed like `ferry hash`, and a
    /// mismatch fails (exit 1) naming the first block that differs. The read-back trusts
    /// the destination's allocation map, as `ferry hash` does. Not for streams or null:.
    #[arg(long)]
    verify: bool,
    /// Fail (exit 1) unless the source's blkhash (see --digest, --hash-block-size) is
    /// DIGEST (hex). On a mismatch a destination file or qcow2 image the copy created is
    /// removed; any other destination (an existing file, a device, an NBD or RBD image)
    /// is left as written and named as not to be trusted.
    #[arg(long, value_name = "DIGEST")]
    expect_hash: Option<String>,
    /// Hash function of --verify and --expect-hash: sha256 (default), sha512, sha1, md5
    /// or blake3, as `ferry hash --digest` spells it. Alone, it is --hash=ALG.
    #[arg(long, value_name = "ALG", value_parser = crate::completions::digest_values(), ignore_case = true)]
    digest: Option<ferry_hash::Algorithm>,
    /// Format of SRC, a local path or image URL, as qemu-img convert's -f: the same as
    /// writing raw:SRC or qcow2:SRC. Without it, an image starting with the qcow2 magic is
    /// read as qcow2.
    #[arg(short = 'f', long, value_name = "FORMAT", value_parser = crate::completions::format_values(), ignore_case = true)]
    source_format: Option<Format>,
    /// Format of a local destination: raw, or qcow2 (a new image the source's size, 64 KiB
    /// clusters). Default: qcow2 for `qcow2:PATH` and names ending in .qcow2, raw otherwise.
    /// -O is qemu-img convert's spelling.
    #[arg(long, value_name = "FORMAT", visible_short_alias = 'O', value_parser = crate::completions::format_values(), ignore_case = true)]
    format: Option<Format>,
    /// Make the destination a new qcow2 overlay of FILE (a qcow2 or raw image of the
    /// source's size, named in the overlay relative to its directory): the overlay holds
    /// only what the copy writes (source holes become zero clusters), anything never
    /// written reads FILE. FILE is locked as a backing file: no one may write it meanwhile.
    /// -B is qemu-img convert's spelling.
    #[arg(long, value_name = "FILE", visible_short_alias = 'B')]
    backing: Option<std::path::PathBuf>,
    /// Read a local source even while another program (qemu, ferry serve) writes it, as
    /// qemu-img convert's -U does; the copy may then not match any state of the source.
    #[arg(short = 'U', long)]
    force_share: bool,
    /// Incremental copy: only the ranges the source's dirty bitmap NAME marks dirty
    /// (its qemu:dirty-bitmap:NAME context: qemu-nbd -B NAME, qemu-storage-daemon,
    /// ferry serve, or a local qcow2 image). Dirty data is read and written, dirty ranges
    /// that read as zeroes are written as zeroes without being read, clean ranges are
    /// neither read nor written. DST is the earlier full copy, updated in place (same
    /// size), or a new overlay.
    #[arg(long, value_name = "NAME", conflicts_with_all = ["hash", "extents_from"])]
    dirty_bitmap: Option<String>,
    /// Incremental copy of the ranges listed in FILE (as --dirty-bitmap copies): the JSON
    /// of `nbdinfo --map=qemu:dirty-bitmap:NAME --json` (rows whose type has bit 0 set),
    /// of `qemu-img map --output=json` (rows present at depth 0: what an overlay holds),
    /// or bitmap:GRANULARITY:FILE, a raw bitmap (bit i, LSB first, set: granule i changed).
    #[arg(long, value_name = "FILE", conflicts_with = "hash")]
    extents_from: Option<String>,
    /// Retries of a failed NBD request or connection (0 to 100; 0: the first error ends
    /// the copy). An EIO or ESHUTDOWN reply sends the request again; a connection that
    /// drops or times out is reopened (same URI, TLS, export; it must be the same size)
    /// and what was in flight on it is sent again. ENOSPC, EPERM, EINVAL, a changed size
    /// and local errors are never retried. Each retry is logged; --stats counts them.
    #[arg(long, value_name = "N", default_value_t = ferry_client::copy::DEFAULT_RETRIES,
          value_parser = clap::value_parser!(u32).range(0..=ferry_client::copy::MAX_RETRIES as i64))]
    retries: u32,
    /// Seconds before the first retry, doubled for each further one (at most 60 s
    /// between two). 0 to 60.
    #[arg(long, value_name = "SECS", default_value = "0.5", value_parser = parse_retry_delay)]
    retry_delay: Duration,
    /// Seconds an NBD request may go without a reply before its connection counts as
    /// failed (and is reopened under --retries). More than 0, at most 3600. Default: no limit.
    #[arg(long, value_name = "SECS", value_parser = parse_request_timeout)]
    request_timeout: Option<Duration>,
    /// Most bytes of data per second, over all connections together (K, M, G suffixes;
    /// 1K to 1T). Holes and ranges the source reports as zeroes are free; --verify's
    /// read-back keeps to the same rate.
    #[arg(long, value_name = "BYTES_PER_SEC", value_parser = parse_rate)]
    rate: Option<u64>,
    /// Journal the copy so that, interrupted (killed, power lost, a permanent error), the
    /// same command continues where it stopped; the first run must have --resume too.
    /// The journal (what is written and flushed at the destination) is DST.ferry-resume
    /// beside a destination file, else in --resume-dir; it is removed when the copy
    /// completes. A journal of another source or destination, of a source changed since,
    /// of other options or another ferry version is refused (see --restart). An upload
    /// to s3:// that does not finish is kept, and continued from the parts already stored.
    #[arg(long)]
    resume: bool,
    /// With --resume: delete the journal of an earlier, unfinished copy onto DST (and
    /// abort the S3 upload it kept) and copy from the beginning (implies --resume).
    #[arg(long)]
    restart: bool,
    /// Where the journals of --resume for destinations other than local files are
    /// kept. Default: $XDG_STATE_HOME/ferry/resume (~/.local/state/ferry/resume).
    #[arg(long, value_name = "DIR")]
    resume_dir: Option<std::path::PathBuf>,
    /// With --resume: store the journal after this much of the source is done (K, M, G;
    /// default 256M) or --resume-seconds, whichever comes first. Each store flushes the
    /// destination; a resumed copy reads again at most this plus what was in flight.
    #[arg(long, value_name = "BYTES", value_parser = parse_size_arg)]
    resume_interval: Option<u64>,
    /// With --resume: store the journal at least this often while the copy advances
    /// (default 5).
    #[arg(long, value_name = "SECS", value_parser = parse_secs)]
    resume_seconds: Option<Duration>,
}

fn parse_size_arg(s: &str) -> std::result::Result<u64, String> {
    match parse_size(s) {
        Ok(0) => Err("must be at least 1 byte".into()),
        Ok(v) => Ok(v),
        Err(e) => Err(e.to_string()),
    }
}

pub(crate) fn parse_rate(s: &str) -> std::result::Result<u64, String> {
    let v = parse_size(s).map_err(|e| e.to_string())?;
    if !(ferry_client::copy::MIN_RATE..=ferry_client::copy::MAX_RATE).contains(&v) {
        return Err("between 1K and 1T bytes per second".into());
    }
    Ok(v)
}

pub(crate) fn parse_secs(s: &str) -> std::result::Result<Duration, String> {
    let v: f64 = s.trim().parse().map_err(|_| format!("{s:?} is not a number of seconds"))?;
    if !v.is_finite() || v < 0.0 {
        return Err(format!("{s:?} is not a number of seconds"));
    }
    Duration::try_from_secs_f64(v).map_err(|e| e.to_string())
}

pub(crate) fn parse_retry_delay(s: &str) -> std::result::Result<Duration, String> {
    let d = parse_secs(s)?;
    if d > ferry_client::copy::MAX_DELAY {
        return Err("at most 60 seconds".into());
    }
    Ok(d)
}

pub(crate) fn parse_request_timeout(s: &str) -> std::result::Result<Duration, String> {
    let d = parse_secs(s)?;
    if d.is_zero() || d > ferry_client::copy::MAX_TIMEOUT {
        return Err("more than 0 and at most 3600 seconds".into());
    }
    Ok(d)
}

/// The source `--offset`/`--length` name: that range of the image `loc`, opened read-only
/// (locked as a served image is) and read as a [`ferry_backend::Window`].
fn window(
    loc: &Location,
    offset: Option<&str>,
    length: Option<&str>,
    force_share: bool,
    remote: &ferry_open::Remote,
) -> Result<ferry_open::Source> {
    let offset = offset.map(parse_size).transpose().context("--offset")?.unwrap_or(0);
    let length = length.map(parse_size).transpose().context("--length")?;
    let how = ferry_open::ServeOpen { read_only: true, force_share, allow_truncated: false };
    let (image, files) = ferry_open::open_backend(loc, how, remote)
        .context("--offset and --length read an image (a file, qcow2, snapshot, RBD, HTTP or S3 image)")?;
    use ferry_backend::Backend;
    let w = ferry_backend::Window::new(image, offset, length).map_err(anyhow::Error::msg)?;
    let name = w.describe();
    let mut source =
        ferry_open::Source::plain(Endpoint::Backend(ferry_client::copy::BackendEndpoint::new(name, Arc::new(w))));
    source.files = files;
    Ok(source)
}

pub fn run(args: CopyArgs, quiet: bool) -> Result<i32> {
    run_from(args, quiet, None)
}

/// [`run`], the source `opened` already when given (`ferry restore`'s disks, read through
/// one opening of their repository) instead of opened from `args.src`, which then only
/// names it.
pub(crate) fn run_from(mut args: CopyArgs, quiet: bool, opened: Option<ferry_open::Source>) -> Result<i32> {
    // The peers' spellings, as the options they stand for.
    if let Some(f) = args.source_format {
        args.src = crate::serve::with_format(&args.src, f).context("--source-format")?;
    }
    if args.allocated {
        args.sparse = false;
    }
    if args.synchronous {
        (args.connections, args.requests) = (Some(1), Some(1));
    }
    // From here a signal ends the copy through the failure path below (an upload is
    // aborted or kept, a journal kept), not by killing the process.
    let cancel = crate::interrupt::install()?;
    let src_loc = Location::parse(&args.src).with_context(|| format!("source {:?}", shown(&args.src)))?;
    let dst_loc = Location::parse(&args.dst).with_context(|| format!("destination {:?}", shown(&args.dst)))?;
    // HTTP and S3 requests retry as NBD requests do (--retries, --retry-delay,
    // --request-timeout).
    let mut remote = args.remote.remote();
    remote.http.retries = args.retries;
    remote.http.retry_delay = args.retry_delay;
    if let Some(t) = args.request_timeout {
        remote.http.timeout = Some(t);
    }
    let source = match (opened, args.offset.as_deref(), args.length.as_deref()) {
        (Some(s), None, None) => Ok(s),
        (Some(_), _, _) => anyhow::bail!("--offset and --length are not for a source opened already"),
        (None, None, None) => ferry_open::source(&src_loc, args.force_share, &remote),
        (None, offset, length) => window(&src_loc, offset, length, args.force_share, &remote),
    }
    .with_context(|| format!("source {:?}", shown(&args.src)))?;
    let _dst_lock = crate::copy_guard::check_destination(&source, &shown(&args.src), &dst_loc, &shown(&args.dst))?;
    let src = &source.endpoint;
    let ranges = match &args.extents_from {
        Some(f) => Some(Arc::new(
            ferry_client::copy::ranges::parse_extents_from(f).map_err(|e| anyhow::anyhow!("--extents-from: {e}"))?,
        )),
        None => None,
    };
    let selective = ranges.is_some() || args.dirty_bitmap.is_some();
    let request_size = match &args.request_size {
        Some(v) => parse_size(v).context("--request-size")?,
        // An upload's smallest part: a write that fills a part whole is sent as it is,
        // without a copy into a part buffer (BENCHMARKING 20: client CPU 0.49 of boto3's
        // against 0.55 with 1M requests).
        None if matches!(dst_loc, Location::Image { store: ferry_open::Store::S3(_), .. }) => 8 << 20,
        None => 1 << 20,
    };
    if request_size == 0 || request_size > 32 << 20 {
        anyhow::bail!("--request-size must be between 1 byte and 32M");
    }
    let resume = resume::Prepared::new(&args, &source, &dst_loc, request_size, &remote.http)?;
    let how = DestinationOptions {
        format: args.format,
        backing: args.backing.clone(),
        flush: args.flush,
        selective,
        resume: resume.as_ref().is_some_and(|r| r.resuming()),
        upload: resume.as_ref().and_then(|r| r.upload(&dst_loc)),
        existing: args.no_create,
    };
    let mut destination = ferry_open::destination(&dst_loc, src, &how, &remote)
        .with_context(|| format!("destination {:?}", shown(&args.dst)))?;
    let dst = &destination.endpoint;
    // An upload to S3 is resumed from the parts the store holds, not from a watermark:
    // its journal stays out of the engine, which copies just the parts not yet stored.
    let upload_id = destination.upload().and_then(|w| w.upload_id()).unwrap_or_default().to_string();
    let unstored = destination.upload().map(|w| (w.unstored_ranges(), ferry_backend::Backend::size(w)));
    let kept_note = || {
        eprintln!(
            "the upload {upload_id} to {} is kept: run the same command again to continue it, or with --restart to \
             abort it and start over",
            shown(&args.dst)
        )
    };
    let (journal, upload_journal, ranges) = match (resume, unstored) {
        (Some(r), Some((left, size))) => {
            let resuming = r.resuming();
            let j = match r.open_upload(&args, &upload_id) {
                Ok(j) => j,
                Err(e) => {
                    // A new upload no journal names would never be completed nor
                    // aborted: it goes now (a continued one stays for another try).
                    if !resuming {
                        if let Err(a) = destination.abort() {
                            log::error!(
                                "{a:#}: abort the upload {upload_id} yourself (`aws s3api abort-multipart-upload`)"
                            );
                        }
                    }
                    return Err(e);
                }
            };
            if resuming {
                let to_copy = left.iter().map(|r| r.1).sum::<u64>();
                eprintln!(
                    "resuming the upload to {}: {} of {size} bytes already stored, {to_copy} to copy",
                    shown(&args.dst),
                    size - to_copy
                );
            }
            (None, Some(j), resuming.then(|| Arc::new(left)))
        }
        (Some(r), None) => (Some(Arc::new(r.open(&args, dst)?)), None, ranges),
        (None, _) => (None, None, ranges),
    };
    let created = destination.created.clone();
    let proof = Proof::from_args(&args, dst, created)?;
    let opts = CopyOptions {
        connections: args
            .connections
            .or_else(|| ferry_open::copy_workers(&src_loc, &dst_loc))
            .unwrap_or_else(default_connections),
        requests: args.requests.unwrap_or_else(|| ((4usize << 20) / request_size as usize).clamp(1, 64)),
        request_size: request_size as usize,
        zero_block: ferry_client::copy::DEFAULT_ZERO_BLOCK,
        sparse: args.sparse,
        send_file: !args.no_sendfile,
        flush: args.flush,
        connect: ConnectOptions { buffers: args.sockets.buffers()?, ..ConnectOptions::default() },
        hash: match proof.algorithm {
            Some(alg) => {
                let bs = parse_size(&args.hash_block_size).context("--hash-block-size")?;
                if bs == 0 || bs > 64 << 20 {
                    anyhow::bail!("--hash-block-size must be between 1 byte and 64M");
                }
                Some(std::sync::Arc::new(ferry_hash::BlockHasher::new(alg, bs as usize)))
            }
            None => None,
        },
        select_context: args.dirty_bitmap.as_ref().map(|n| format!("{META_DIRTY_BITMAP_PREFIX}{n}")),
        ranges,
        retry: ferry_client::copy::RetryPolicy {
            retries: args.retries,
            delay: args.retry_delay,
            request_timeout: args.request_timeout,
        },
        rate: args.rate,
        journal,
        cancel: Some(cancel),
        existing: args.no_create,
    };
    let progress = Progress::default();
    let start = Instant::now();
    let stop = std::sync::atomic::AtomicBool::new(false);
    let report = std::thread::scope(|s| {
        let shown = (args.progress && !quiet).then(|| s.spawn(|| show_progress(&progress, &stop)));
        let r = match (&opts.ranges, &upload_journal) {
            // A resumed upload copies only the parts not stored; a digest needs every
            // byte of the source.
            (Some(_), Some(_)) => ferry_client::copy::copy_then_hash(src, dst, &opts, &progress),
            _ => copy(src, dst, &opts, &progress),
        };
        stop.store(true, Ordering::SeqCst);
        if let Some(h) = shown {
            let _ = h.join();
        }
        r
    });
    // A signal after the last batch still stops the copy before an upload is completed.
    let report =
        report.and_then(|r| if opts.cancelled() { Err(ferry_client::copy::CopyError::Interrupted) } else { Ok(r) });
    let report = match report {
        Ok(r) => r,
        Err(e) => {
            if destination.is_upload() && upload_journal.is_some() {
                kept_note();
            } else if destination.is_upload() {
                // Said here, not left to the upload's drop: no billed parts stay behind.
                match destination.abort() {
                    Ok(()) => eprintln!("the upload to {} was aborted: no object was made", shown(&args.dst)),
                    Err(a) => log::error!(
                        "{a:#}: the parts uploaded so far stay (and are billed) until the upload {upload_id} is \
                         aborted (`aws s3api abort-multipart-upload`)"
                    ),
                }
            }
            return Err(e.into());
        }
    };
    // --expect-hash before the destination is finished: a mismatch never completes an
    // upload (no object appears).
    if let Some(d) = &report.digest {
        println!("{}  {}", ferry_hash::hex(d), shown(&args.src));
        let checked = proof.check_expected(&args, &mut destination, d);
        if let (Err(_), Some(j)) = (&checked, &upload_journal) {
            // The upload was aborted: nothing is left to resume. The journal goes only
            // once the upload is known to be gone.
            if !destination.is_upload() {
                j.finish()?;
            }
        }
        checked?;
    }
    let finished = destination.finish(&remote);
    if let Some(j) = &upload_journal {
        if destination.is_upload() {
            // Not completed: the upload stays for the journal's next run.
            kept_note();
        } else {
            // Completed, even if reading it back cannot start: nothing is left to resume.
            j.finish()?;
        }
    }
    finished?;
    let dst = &destination.endpoint;
    if let (Some(sel), false, true) = (report.selected_bytes, quiet, selective) {
        let zeroed = report.hole_bytes + report.zero_bytes;
        eprintln!(
            "{sel} bytes of {} {}: {} copied as data, {zeroed} written as zeroes",
            report.bytes,
            if args.dirty_bitmap.is_some() { "dirty" } else { "changed" },
            report.data_bytes
        );
    }
    if let Some(d) = &report.digest {
        proof.verify(&args, src, dst, &opts, &report, d)?;
    }
    // Writes the destination acknowledged before its connection was lost may be gone
    // with the server that held them: never report such a copy as done unproven (a
    // --resume copy sent again everything acknowledged since the last flush).
    if report.dst_reconnects_unproven > 0 && !args.verify {
        anyhow::bail!(
            "the destination's connection was lost and reopened {} time(s): writes it had acknowledged \
             before may be lost if the server did not keep them, so this copy is not known to be complete; \
             check it with `ferry hash`, or run the copy again with --verify (which proves the result)",
            report.dst_reconnects_unproven
        );
    }
    if args.stats && !quiet {
        let secs = start.elapsed().as_secs_f64();
        eprintln!(
            "copied {} bytes in {:.3} s ({:.2} GiB/s) over {} connection(s): {} data, {} holes skipped, {} zeroes detected",
            report.bytes,
            secs,
            report.bytes as f64 / secs / (1u64 << 30) as f64,
            report.connections,
            report.data_bytes,
            report.hole_bytes,
            report.zero_bytes
        );
        eprintln!("sockets: {}", report.socket);
        eprintln!("retries: {}", report.retries);
    }
    Ok(0)
}

/// What `--verify` and `--expect-hash` need, settled before anything is copied.
struct Proof {
    /// The hash of the copy, if any is computed (`--hash`, `--verify`, `--expect-hash`).
    algorithm: Option<ferry_hash::Algorithm>,
    /// `--expect-hash`, lower-case.
    expect: Option<String>,
    /// The destination is a local file that does not exist yet: the copy creates it.
    created: Option<std::path::PathBuf>,
}

impl Proof {
    fn from_args(args: &CopyArgs, dst: &Endpoint, created: Option<std::path::PathBuf>) -> Result<Proof> {
        let algorithm = match (args.hash, args.digest) {
            (Some(a), Some(b)) if a != b => {
                anyhow::bail!("--hash={a:?} and --digest {b:?} name different hash functions: give one")
            }
            (a, b) => a.or(b),
        };
        let wanted = args.verify || args.expect_hash.is_some();
        let algorithm = match (algorithm, wanted) {
            (Some(a), _) => Some(a),
            (None, true) => Some(ferry_hash::Algorithm::Sha256),
            (None, false) => None,
        };
        let expect = match &args.expect_hash {
            Some(h) => {
                let h = h.trim().to_ascii_lowercase();
                let want = algorithm.map_or(0, |a| a.digest_len() * 2);
                if h.len() != want || !h.bytes().all(|b| b.is_ascii_hexdigit()) {
                    anyhow::bail!(
                        "--expect-hash must be {want} hex digits (a {:?} digest, as `ferry hash --digest` prints it), \
                         not {h:?}",
                        algorithm.unwrap_or(ferry_hash::Algorithm::Sha256)
                    );
                }
                Some(h)
            }
            None => None,
        };
        if args.verify {
            let stream = match dst {
                Endpoint::Stdio | Endpoint::Null => true,
                Endpoint::File(p) => std::fs::metadata(p).is_ok_and(|m| {
                    use std::os::unix::fs::FileTypeExt;
                    m.file_type().is_char_device() || m.file_type().is_fifo()
                }),
                _ => false,
            };
            if stream {
                anyhow::bail!(
                    "--verify reads the destination back: {:?} is a stream or null: and cannot be read",
                    shown(&args.dst)
                );
            }
        }
        Ok(Proof { algorithm, expect, created })
    }

    /// After the copy, before the destination is finished: `--expect-hash`.
    fn check_expected(&self, args: &CopyArgs, dst: &mut ferry_open::Destination, digest: &[u8]) -> Result<()> {
        let hex = ferry_hash::hex(digest);
        if let Some(want) = &self.expect {
            if *want != hex {
                let fate = if dst.is_upload() {
                    match dst.abort() {
                        Ok(()) => format!("upload to {} was aborted: no object was made", shown(&args.dst)),
                        Err(e) => {
                            format!(
                                "upload to {} could not be aborted ({e:#}) and must not be trusted",
                                shown(&args.dst)
                            )
                        }
                    }
                } else {
                    match &self.created {
                        Some(p) => match std::fs::remove_file(p) {
                            Ok(()) => format!("{} (created by this copy) was removed", p.display()),
                            Err(e) => format!("{} could not be removed ({e}) and must not be trusted", p.display()),
                        },
                        None => format!("{} was written but must not be trusted", shown(&args.dst)),
                    }
                };
                anyhow::bail!(
                    "the source's digest {hex} is not the expected {want} (--expect-hash): the source is not what \
                     was expected; the destination {fate}"
                );
            }
        }
        Ok(())
    }

    /// After the copy, once the destination is finished: `--verify`.
    fn verify(
        &self,
        args: &CopyArgs,
        src: &Endpoint,
        dst: &Endpoint,
        opts: &CopyOptions,
        report: &ferry_client::copy::CopyReport,
        digest: &[u8],
    ) -> Result<()> {
        let hex = ferry_hash::hex(digest);
        if !args.verify {
            return Ok(());
        }
        let Some(h) = &opts.hash else { anyhow::bail!("--verify: no digest computed") };
        let back = ferry_hash::BlockHasher::new(h.algorithm(), h.block_size());
        let got = ferry_client::copy::hash_range(dst, report.bytes, &back, opts)
            .with_context(|| format!("--verify: reading {} back", shown(&args.dst)))?;
        println!("{}  {}", ferry_hash::hex(&got), shown(&args.dst));
        if got == digest {
            return Ok(());
        }
        let bs = h.block_size() as u64;
        let place = if matches!(src, Endpoint::Stdio) {
            "the source was a stream and cannot be read again to find the first differing block".to_string()
        } else {
            match ferry_client::copy::first_difference(src, dst, report.bytes, bs as usize, opts) {
                Ok(Some(b)) => format!("first differing block: {b} (offset {}, {bs}-byte blocks)", b * bs),
                Ok(None) => "yet a byte-by-byte comparison now finds no difference (did either end change?)".into(),
                Err(e) => format!("the comparison to find the first differing block failed: {e}"),
            }
        };
        anyhow::bail!(
            "--verify failed: the destination {} reads back with digest {} but the source's is {hex}; {place}",
            shown(&args.dst),
            ferry_hash::hex(&got)
        );
    }
}

/// `-C` when not given: one per CPU core this process may run on (its affinity and
/// cgroup quota), at least [`MIN_CONNECTIONS`] (a server's replies and the copy's
/// sockets overlap even on few cores), at most [`MAX_CONNECTIONS`]. A server without
/// multi-conn gets one whatever this says (the copy engine's rule).
pub(crate) fn default_connections() -> usize {
    connections_for(std::thread::available_parallelism().map_or(MIN_CONNECTIONS, |n| n.get()))
}

const MIN_CONNECTIONS: usize = 4;
const MAX_CONNECTIONS: usize = 16;

fn connections_for(cores: usize) -> usize {
    cores.clamp(MIN_CONNECTIONS, MAX_CONNECTIONS)
}

pub(crate) fn show_progress(p: &Progress, stop: &std::sync::atomic::AtomicBool) {
    let tty = std::io::stderr().is_terminal();
    let bar = tty.then(|| {
        let b = ProgressBar::new(0);
        b.set_style(
            ProgressStyle::with_template("{bar:40} {bytes}/{total_bytes} {bytes_per_sec} ETA {eta}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        b
    });
    let mut last_pct = u64::MAX;
    loop {
        let done = stop.load(Ordering::SeqCst);
        let (d, t) = (p.done.load(Ordering::Relaxed), p.total.load(Ordering::Relaxed));
        match &bar {
            Some(b) => {
                b.set_length(t);
                b.set_position(d);
            }
            None if t > 0 => {
                let pct = d * 100 / t;
                if pct != last_pct {
                    eprintln!("{pct}%");
                    last_pct = pct;
                }
            }
            None => {}
        }
        if done {
            break;
        }
        std::thread::sleep(Duration::from_millis(if tty { 100 } else { 250 }));
    }
    if let Some(b) = bar {
        b.finish();
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn default_connections_follow_the_cores_within_bounds() {
        assert_eq!(super::connections_for(1), 4);
        assert_eq!(super::connections_for(2), 4);
        assert_eq!(super::connections_for(8), 8);
        assert_eq!(super::connections_for(16), 16);
        assert_eq!(super::connections_for(128), 16);
    }
}
