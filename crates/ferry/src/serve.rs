//! `ferry serve`: the NBD server's command line.

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use ferry_backend::{Backend, MetaContext};
use ferry_proto::consts::{META_ALLOCATION_DEPTH, META_DIRTY_BITMAP_PREFIX};
use ferry_proto::TlsPolicy;
use ferry_repo::{SnapshotDiff, SnapshotImage};
use ferry_server::{Config, Export, Exports, Server, ZeroCopy};
use ferry_sock::{BufferConfig, Listener};
use ferry_tls::{ServerTls, ServerTlsConfig};
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// The default export: a local PATH (a qcow2 image is served through its format, any
    /// other file raw), qcow2:PATH, raw:PATH, memory:SIZE (sparse RAM disk), file:PATH (file or block
    /// device, always raw), null:SIZE (discards writes, reads zeroes), pattern:SIZE (read-only;
    /// each 8-byte word holds its offset) or rbd:POOL/IMAGE[@SNAP][?conf=PATH&id=USER&keyring=PATH]
    /// (a Ceph RBD image; snapshots are read-only). Sizes take K, M, G, T suffixes.
    #[arg(value_name = "SPEC")]
    spec: String,
    /// Listen on this Unix socket instead of TCP (nbdkit's -U; qemu-nbd's -k/--socket).
    #[arg(short = 'U', long = "unix", value_name = "PATH", visible_short_alias = 'k', visible_alias = "socket")]
    unix: Option<PathBuf>,
    /// TCP address to listen on (qemu-nbd's -b, nbdkit's -i/--ipaddr). Unlike theirs, the
    /// default is loopback only: 0.0.0.0 or :: serves every interface.
    #[arg(
        short = 'b',
        long,
        default_value = "127.0.0.1",
        value_name = "ADDR",
        visible_short_alias = 'i',
        visible_alias = "ipaddr"
    )]
    bind: String,
    /// TCP port to listen on (0 picks a free one).
    #[arg(short, long, default_value_t = 10809)]
    port: u16,
    /// Serve every export read-only.
    #[arg(short, long, visible_alias = "readonly")]
    read_only: bool,
    /// Format of SPEC, a local path or image URL, as qemu-nbd's -f: raw serves its bytes as
    /// they are (a qcow2 image's too), qcow2 refuses anything else. The same as writing
    /// raw:SPEC or qcow2:SPEC. Without it, an image starting with the qcow2 magic is qcow2.
    #[arg(short = 'f', long, value_name = "FORMAT", value_parser = crate::completions::format_values(), ignore_case = true)]
    format: Option<ferry_open::Format>,
    /// Accepted for qemu-nbd's command lines, and changes nothing: ferry serve always keeps
    /// serving after its last client disconnects (it stops on SIGTERM/SIGINT, or with --run).
    #[arg(short = 't', long)]
    persistent: bool,
    /// At most N connections at once (0: no limit), as qemu-nbd's -e, whose default is 1;
    /// ferry's default is no limit but the file descriptors'. The same as --max-connections
    /// N: connections past it are closed, where qemu-nbd leaves them waiting.
    #[arg(short = 'e', long, value_name = "N", conflicts_with = "max_connections")]
    shared: Option<usize>,
    /// Write the server's process ID to FILE once it accepts connections (qemu-nbd's
    /// --pid-file, nbdkit's -P). The file is replaced if it exists, and left at exit.
    #[arg(short = 'P', long, value_name = "FILE", visible_alias = "pidfile")]
    pid_file: Option<PathBuf>,
    /// Serve a qcow2 image read-write even though clusters it uses lie past the end of
    /// its file (a truncated image: what is missing reads as zeroes). Without it such an
    /// image is refused read-write, and served read-only with a warning. For rescue
    /// only: the image's refcounts are incomplete, so prefer `qemu-img check -r all`.
    #[arg(long)]
    allow_truncated: bool,
    /// With --read-only: serve images even while another program (qemu, another ferry)
    /// writes them, as qemu-nbd's --force-share does (clients may read inconsistent data).
    #[arg(long, requires = "read_only")]
    force_share: bool,
    #[command(flatten)]
    remote: crate::remote_args::RemoteArgs,
    /// Another export, by name, beside the default one (repeatable).
    #[arg(long = "export", value_name = "NAME=SPEC")]
    exports: Vec<String>,
    /// Offer SPEC under this name instead of as the default export "" (qemu-nbd's -x):
    /// clients then ask for NAME (nbd://HOST/NAME), and none is served for "". The
    /// image is opened once, whatever its name.
    #[arg(short = 'x', long = "export-name", value_name = "NAME")]
    export_name: Option<String>,
    /// Exit (as on SIGTERM) when the process that started ferry exits, as nbdkit's
    /// --exit-with-parent: for a server started in the background by a script or a
    /// program that may die without stopping it. Linux only.
    #[arg(long)]
    exit_with_parent: bool,
    /// Serve in the background, as qemu-nbd --fork: the server runs as a new process in
    /// its own process group (standard input and output /dev/null, its errors still on
    /// this standard error), and this command prints its URI (with the port `-p 0`
    /// picked: `uri=$(ferry serve --fork -p 0 ...)`) and returns 0 once it listens (its
    /// --pid-file written), or fails with the server's error and exit status if it could not start.
    /// `ferry serve --fork ... && CLIENT ...` needs no wait.
    #[arg(long, conflicts_with_all = ["run", "exit_with_parent"])]
    fork: bool,
    /// Offer only this persistent dirty bitmap of the default export, as the metadata
    /// context `qemu:dirty-bitmap:NAME` (repeatable; qemu-nbd's spelling). Without it,
    /// every bitmap the image has that is consistent is offered. A bitmap that is not
    /// offered (missing, or inconsistent: in use by a program that did not close it) is
    /// an error at start.
    #[arg(short = 'B', long = "bitmap", value_name = "NAME")]
    bitmaps: Vec<String>,
    /// Offer the metadata context `qemu:allocation-depth` on every export that has it
    /// (qcow2: 0 unallocated, 1 in the image itself, 2 in its backing file, ...).
    #[arg(short = 'A', long)]
    allocation_depth: bool,
    /// Description of the default export, shown by `nbdinfo` and `NBD_OPT_LIST`.
    #[arg(short = 'D', long, value_name = "TEXT")]
    description: Option<String>,
    /// Captive mode: run CMD with $uri, $unixsocket and $port set, stop when it exits,
    /// and exit with its status.
    #[arg(long, value_name = "CMD")]
    run: Option<String>,
    /// Connections beyond this many are closed at once (and logged); with a limit, exports
    /// are not offered as multi-conn, so clients open one connection each. Default: as many
    /// as the file-descriptor limit allows (ferry raises RLIMIT_NOFILE to its hard
    /// limit at start and logs the figure). Idle connections hold no thread and no
    /// buffer, so thousands cost little.
    #[arg(long, value_name = "N")]
    max_connections: Option<usize>,
    /// Connections from one client IP address beyond this many are closed at once
    /// (TCP; default: no per-client limit).
    #[arg(long, value_name = "N")]
    max_connections_per_client: Option<usize>,
    /// Close connections that sent nothing for this many seconds, once everything they
    /// asked for is answered (default: never; a paused VM keeps its connections).
    #[arg(long, value_name = "SECS")]
    idle_timeout: Option<f64>,
    /// Drop a client that has not finished the handshake after this many seconds
    /// (qemu-nbd's --handshake-limit, without its 0 for no limit).
    #[arg(long, default_value_t = 10.0, value_name = "SECS", visible_alias = "handshake-limit")]
    handshake_timeout: f64,
    /// On SIGTERM/SIGINT, drop a client that reads nothing of its replies for this many
    /// seconds, so the server stops within about this long whatever its clients do.
    #[arg(long, default_value_t = 5.0, value_name = "SECS")]
    shutdown_grace: f64,
    #[command(flatten)]
    sockets: crate::sockopts::SocketArgs,
    /// Read file exports into a buffer and send it, instead of sendfile(2) from the page cache.
    #[arg(long)]
    no_sendfile: bool,
    /// What TRIM and WRITE_ZEROES do with storage (as qemu-nbd's --discard). unmap: give
    /// it back (a file gets holes punched; a qcow2 image frees the clusters, punches them
    /// out of its file and reuses them). ignore: TRIM does nothing and WRITE_ZEROES keeps
    /// the storage allocated (as with NO_HOLE).
    #[arg(long, value_enum, default_value_t = DiscardArg::Unmap, value_name = "MODE")]
    discard: DiscardArg,
    /// Log socket statistics: per connection when it closes, in total at exit and on SIGUSR1.
    #[arg(long)]
    stats: bool,
    /// Group replies into one send until this much payload is queued (0: send every
    /// reply on its own, to measure what grouping is worth).
    #[arg(long, default_value = "64K", value_name = "BYTES")]
    send_batch: String,
    /// TLS: off, on (offer STARTTLS, plaintext clients still served) or require
    /// (nothing but STARTTLS is answered before TLS). Default: require when
    /// credentials are given, else off.
    #[arg(long, value_enum, value_name = "MODE")]
    tls: Option<TlsMode>,
    /// Directory with server-cert.pem, server-key.pem and ca-cert.pem (the layout of
    /// nbdkit and qemu's tls-creds-x509).
    #[arg(long, value_name = "DIR")]
    tls_certificates: Option<PathBuf>,
    /// Pre-shared keys, one IDENTITY:HEXKEY per line (psktool's format).
    #[arg(long, value_name = "FILE")]
    tls_psk: Option<PathBuf>,
    /// Require client certificates signed by the CA in --tls-certificates.
    #[arg(long)]
    tls_verify_peer: bool,
    /// MSG_ZEROCOPY over TCP for batches of READ replies with 64 KiB of data or more. auto: until the
    /// kernel reports it copied the data anyway (always on loopback); on: always, and
    /// refused at start where it cannot work (Unix socket, kernel without SO_ZEROCOPY);
    /// off: plain copying sends.
    #[arg(long, value_enum, default_value_t = ZeroCopyArg::Auto, value_name = "MODE")]
    zerocopy: ZeroCopyArg,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum TlsMode {
    Off,
    On,
    Require,
}

/// The TLS policy and context the options ask for.
fn tls_config(args: &ServeArgs) -> Result<(TlsPolicy, Option<ServerTls>)> {
    let creds = args.tls_certificates.is_some() || args.tls_psk.is_some();
    let policy = match args.tls {
        Some(TlsMode::Off) => TlsPolicy::Off,
        Some(TlsMode::On) => TlsPolicy::On,
        Some(TlsMode::Require) => TlsPolicy::Require,
        None if creds => TlsPolicy::Require,
        None => TlsPolicy::Off,
    };
    if policy == TlsPolicy::Off {
        if creds || args.tls_verify_peer {
            bail!("--tls=off contradicts --tls-certificates/--tls-psk/--tls-verify-peer");
        }
        return Ok((policy, None));
    }
    let cfg = ServerTlsConfig {
        certificates: args.tls_certificates.clone(),
        psk: args.tls_psk.clone(),
        verify_peer: args.tls_verify_peer,
    };
    Ok((policy, Some(ServerTls::new(&cfg)?)))
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum DiscardArg {
    Ignore,
    Unmap,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum ZeroCopyArg {
    Auto,
    On,
    Off,
}

impl From<ZeroCopyArg> for ZeroCopy {
    fn from(a: ZeroCopyArg) -> ZeroCopy {
        match a {
            ZeroCopyArg::Auto => ZeroCopy::Auto,
            ZeroCopyArg::On => ZeroCopy::On,
            ZeroCopyArg::Off => ZeroCopy::Off,
        }
    }
}

/// Refuses, before anything is served, transport options the listeners cannot honour.
/// Every check of a transport option against the sockets belongs here (TLS will add
/// "--zerocopy=on with TLS": the kernel cannot zero-copy data that is encrypted in user
/// space).
fn check_transport(args: &ServeArgs, listeners: &[Listener]) -> Result<()> {
    if args.zerocopy == ZeroCopyArg::On
        && (args.tls.is_some_and(|t| t != TlsMode::Off) || args.tls_certificates.is_some() || args.tls_psk.is_some())
    {
        bail!(
            "--zerocopy=on cannot work with TLS: the data is encrypted in user space, so the kernel \
             has nothing to send without copying. Use --zerocopy=auto or --zerocopy=off"
        );
    }
    if args.zerocopy == ZeroCopyArg::On {
        if let Some(l) = listeners.iter().find(|l| l.local_tcp_addr().is_none()) {
            let what = l.unix_path().map_or_else(
                || "a Unix socket passed by socket activation".to_string(),
                |p| format!("the Unix socket {}", p.display()),
            );
            bail!(
                "--zerocopy=on needs TCP, but ferry listens on {what}: MSG_ZEROCOPY does not exist for \
                 Unix sockets. Use --zerocopy=auto or --zerocopy=off"
            );
        }
        ferry_sock::zerocopy_supported().map_err(|e| {
            anyhow::anyhow!(
                "--zerocopy=on: this kernel does not support SO_ZEROCOPY on TCP sockets ({e}); \
                 MSG_ZEROCOPY needs Linux 4.14 or later. Use --zerocopy=auto or --zerocopy=off"
            )
        })?;
    }
    Ok(())
}

/// Refuses an export whose files another export already has open when either writes
/// them: each opening would keep its own metadata (qcow2) or its own view of the image
/// (a backing file written under its overlay), and writes would be lost.
fn check_shared_files(
    opened: &[(String, Vec<ferry_backend::OpenFile>)],
    name: &str,
    files: &[ferry_backend::OpenFile],
) -> Result<()> {
    let label = |n: &str| if n.is_empty() { "the default export".to_string() } else { format!("export {n:?}") };
    for (other, theirs) in opened {
        for f in files {
            if let Some(t) = theirs.iter().find(|t| t.id == f.id && (t.writable || f.writable)) {
                bail!(
                    "{} and {} both open {}{}, and one of them writes it: two openings of one image lose each \
                     other's writes. Serve the image once (clients can share one export), or serve both read-only",
                    label(other),
                    label(name),
                    t.path.display(),
                    if t.path == f.path { String::new() } else { format!(" (as {})", f.path.display()) },
                );
            }
        }
    }
    Ok(())
}

/// The metadata contexts an export offers, in the backend's order after
/// `base:allocation`: its dirty bitmaps (only those named in `bitmaps`, when some
/// are), `qemu:allocation-depth` only with `depth`, and any other context it has.
/// A named bitmap the backend does not offer is an error.
fn offered_contexts(
    backend: &Arc<dyn Backend>,
    extra: &[Arc<dyn MetaContext>],
    bitmaps: &[String],
    depth: bool,
    spec: &str,
) -> Result<Vec<Arc<dyn MetaContext>>> {
    let mut all = ferry_backend::all_meta_contexts(backend);
    all.extend(extra.iter().cloned());
    let bitmap_of = |c: &Arc<dyn MetaContext>| c.name().strip_prefix(META_DIRTY_BITMAP_PREFIX).map(str::to_string);
    for name in bitmaps {
        if !all.iter().any(|c| bitmap_of(c).as_deref() == Some(name.as_str())) {
            let offered: Vec<String> = all.iter().filter_map(bitmap_of).collect();
            bail!(
                "--bitmap {name}: {spec:?} offers no bitmap {name:?}: missing, or inconsistent: in use by a \
                 program that did not close it (`qemu-img info` shows an image's bitmaps; bitmaps offered: {})",
                if offered.is_empty() { "none".to_string() } else { offered.join(", ") }
            );
        }
    }
    Ok(all
        .into_iter()
        .filter(|c| match bitmap_of(c) {
            Some(b) => bitmaps.is_empty() || bitmaps.contains(&b),
            None => depth || c.name() != META_ALLOCATION_DEPTH,
        })
        .collect())
}

/// The exports (by name) that are snapshots in a backup repository, opened, when serving
/// read-only (writable serving refuses them when they are opened as any other spec).
fn open_snapshots(args: &ServeArgs, remote: &ferry_open::Remote) -> Result<Vec<(String, Arc<SnapshotImage>)>> {
    if !args.read_only {
        return Ok(Vec::new());
    }
    let default = args.export_name.clone().unwrap_or_default();
    let named = args.exports.iter().filter_map(|e| e.split_once('=')).map(|(n, s)| (n.to_string(), s));
    let mut out = Vec::new();
    for (name, spec) in std::iter::once((default, args.spec.as_str())).chain(named) {
        if let Ok(ferry_open::Location::Repo { repo, name: disk, id }) = ferry_open::Location::parse(spec) {
            let cache = ferry_open::repo::serve_cache_bytes()?;
            let img = ferry_open::repo::open_snapshot_cached(&repo, &disk, id.as_deref(), remote, cache)
                .with_context(|| format!("cannot serve {spec:?}"))?;
            // A served disk is read again: what a client reads through in large reads
            // (a boot, a first copy) fills the idle cache for its later small reads.
            img.keep_whole_reads();
            out.push((name, img));
        }
    }
    Ok(out)
}

/// The contexts `qemu:dirty-bitmap:ID8` of the snapshot served as `export`: the chunks
/// that differ from each other snapshot of its disk served beside it (ID8: the other's
/// id, as `ferry repo list` prints it).
fn diffs(snapshots: &[(String, Arc<SnapshotImage>)], export: &str) -> Vec<Arc<dyn MetaContext>> {
    let Some((_, me)) = snapshots.iter().find(|s| s.0 == export) else { return Vec::new() };
    snapshots
        .iter()
        .filter(|(n, other)| n != export && other.info().id != me.info().id)
        .filter_map(|(_, other)| {
            let id = &other.info().id;
            SnapshotDiff::new(me, other, &id[..8.min(id.len())]).map(|d| Arc::new(d) as Arc<dyn MetaContext>)
        })
        .collect()
}

/// `--exit-with-parent`: the kernel sends SIGTERM when the parent exits (its handler
/// then stops the server as usual). A parent gone before that was asked for is noticed
/// by the parent process ID having changed since `parent`.
fn exit_with_parent(parent: Option<rustix::process::Pid>) -> Result<()> {
    rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::TERM))
        .context("--exit-with-parent: prctl(PR_SET_PDEATHSIG)")?;
    if rustix::process::getppid() != parent {
        bail!("--exit-with-parent: the process that started ferry has exited already");
    }
    Ok(())
}

/// SPEC with the format `-f` names: `raw:SPEC` or `qcow2:SPEC` for an image that names no
/// format; one that names the other format contradicts it; anything else has none.
pub(crate) fn with_format(spec: &str, format: ferry_open::Format) -> Result<String> {
    match ferry_open::Location::parse(spec) {
        Ok(ferry_open::Location::Image { format: None, .. }) => Ok(format!("{format}:{spec}")),
        Ok(ferry_open::Location::Image { format: Some(f), .. }) if f == format => Ok(spec.to_string()),
        Ok(ferry_open::Location::Image { format: Some(f), .. }) => {
            bail!("{format} contradicts {:?}, which says {f}", crate::remote_args::shown(spec))
        }
        _ => bail!(
            "{:?} is no image file or URL: a format ({format}) goes on a path, rbd:, http(s):// or s3://",
            crate::remote_args::shown(spec)
        ),
    }
}

/// Writes this process's ID into `path`: through a temporary file beside it renamed over
/// it, so that a reader waiting for the file never sees it empty; in place where that
/// cannot be (a directory this process may not write, with the file made writable for
/// it, as for a pid file prepared in /run), and where `path` is not a regular file (a
/// symbolic link is written through, as qemu-nbd and nbdkit do).
fn write_pid_file(path: &Path) -> std::io::Result<()> {
    let text = format!("{}\n", std::process::id());
    if std::fs::symlink_metadata(path).is_ok_and(|m| !m.file_type().is_file()) {
        return std::fs::write(path, &text);
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".{}.tmp", std::process::id()));
    let tmp = PathBuf::from(tmp);
    match std::fs::write(&tmp, &text) {
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => return std::fs::write(path, &text),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        Ok(()) => {}
    }
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// Set in the environment of the server that `--fork` starts: that process is the server.
const FORKED: &str = "FERRY_SERVE_FORKED";

/// `--fork`: runs this command line again as the server, in a new process group, and
/// returns once it says it listens (0, its URI printed on standard output: the port
/// `-p 0` picked is there), or with its status once it ends without (its error went to
/// this standard error).
fn fork() -> Result<i32> {
    Ok(match crate::background::start(FORKED, true, crate::background::Channel::Stdout, "--fork")? {
        Ok(uri) => {
            println!("{uri}");
            0
        }
        Err(code) => code,
    })
}

pub fn run(mut args: ServeArgs) -> Result<i32> {
    let forked = args.fork && crate::background::is_background(FORKED);
    if args.fork && !forked {
        return fork();
    }
    if let Some(f) = args.format {
        args.spec = with_format(&args.spec, f).context("--format")?;
    }
    if args.persistent {
        log::debug!("-t/--persistent: ferry serve keeps serving after the last client anyway");
    }
    if let Some(n) = args.shared {
        // qemu-nbd's 0: no limit of its own.
        args.max_connections = (n > 0).then_some(n);
    }
    if args.exit_with_parent {
        // Before anything slow: the parent may go at any moment.
        exit_with_parent(rustix::process::getppid())?;
    }
    let default_name = args.export_name.clone().unwrap_or_default();
    // Before any export is opened: an overstated LISTEN_FDS must not reach its descriptors.
    let activated = ferry_sock::listen_fds().context("systemd socket activation")?;
    let mut exports = Exports::new();
    // Each export's local files, to refuse one file opened twice with a writer.
    let mut files = Vec::new();
    let how = ferry_open::ServeOpen {
        read_only: args.read_only,
        force_share: args.force_share,
        allow_truncated: args.allow_truncated,
    };
    let remote = args.remote.remote();
    // Snapshots of a backup repository served read-only, opened first: each offers the
    // changes since every other snapshot of its disk served beside it.
    let snapshots = open_snapshots(&args, &remote)?;
    let mut open = |name: &str, spec: &str| {
        let loc = ferry_open::Location::parse(spec)
            .with_context(|| format!("cannot serve {:?}", crate::remote_args::shown(spec)))?;
        let (backend, f) = match snapshots.iter().find(|s| s.0 == name) {
            Some((_, img)) => (img.clone() as Arc<dyn Backend>, Vec::new()),
            None => ferry_open::open_backend(&loc, how, &remote)
                .with_context(|| format!("cannot serve {:?}", crate::remote_args::shown(spec)))?,
        };
        check_shared_files(&files, name, &f)?;
        files.push((name.to_string(), f));
        anyhow::Ok(match args.discard {
            DiscardArg::Ignore => std::sync::Arc::new(ferry_backend::IgnoreDiscard(backend)),
            DiscardArg::Unmap => backend,
        })
    };
    let backend = open(&default_name, &args.spec)?;
    let contexts = offered_contexts(
        &backend,
        &diffs(&snapshots, &default_name),
        &args.bitmaps,
        args.allocation_depth,
        &args.spec,
    )?;
    let default =
        Export { name: default_name.clone(), description: args.description.clone().unwrap_or_default(), backend };
    exports.add_with_contexts(default, contexts).map_err(anyhow::Error::msg)?;
    for e in &args.exports {
        let Some((name, spec)) = e.split_once('=') else {
            bail!("--export {e:?}: write NAME=SPEC, e.g. --export disk2=memory:1G");
        };
        if name.is_empty() {
            bail!("--export {e:?}: the name must not be empty (the positional SPEC is the default export)");
        }
        let backend = open(name, spec)?;
        // -B names the default export's bitmaps; the others offer all of theirs.
        let contexts = offered_contexts(&backend, &diffs(&snapshots, name), &[], args.allocation_depth, spec)?;
        let export = Export { name: name.to_string(), description: String::new(), backend };
        exports.add_with_contexts(export, contexts).map_err(anyhow::Error::msg)?;
    }
    if args.max_connections.is_some() || args.max_connections_per_client.is_some() {
        // A client that takes the multi-conn offer opens several connections, and those
        // past the limit would be closed: with a limit, clients keep to one each.
        exports.without_multi_conn();
        log::info!("a connection limit is set: exports are not offered as multi-conn (clients use one connection)");
    }
    if !(args.handshake_timeout > 0.0 && args.handshake_timeout.is_finite()) {
        bail!("--handshake-timeout must be a positive number of seconds");
    }
    if !(args.shutdown_grace >= 0.0 && args.shutdown_grace.is_finite()) {
        bail!("--shutdown-grace must be a number of seconds (0 or more)");
    }
    if args.max_connections == Some(0) || args.max_connections_per_client == Some(0) {
        bail!("--max-connections and --max-connections-per-client must be at least 1");
    }
    let idle_timeout = match args.idle_timeout {
        None => None,
        Some(t) if t > 0.0 && t.is_finite() => Some(Duration::from_secs_f64(t)),
        Some(_) => bail!("--idle-timeout must be a positive number of seconds"),
    };
    let nofile = ferry_server::raise_fd_limit();
    let ceiling = ferry_server::connection_ceiling(nofile);
    let max_connections = match args.max_connections {
        Some(n) if n > ceiling => {
            log::warn!(
                "--max-connections {n} is more than RLIMIT_NOFILE={nofile} allows (one descriptor each, \
                 {} kept for the server); raise the hard limit (ulimit -Hn, LimitNOFILE=) to accept that many",
                ferry_server::RESERVED_FDS
            );
            n
        }
        Some(n) => n,
        None => ceiling,
    };
    let (tls_policy, tls) = tls_config(&args)?;
    let explicit = args.sockets.buffers()?;
    let config = Config {
        max_connections,
        max_connections_per_client: args.max_connections_per_client,
        idle_timeout,
        idle_grace: ferry_server::DEFAULT_IDLE_GRACE,
        handshake_timeout: Duration::from_secs_f64(args.handshake_timeout),
        shutdown_grace: Duration::from_secs_f64(args.shutdown_grace),
        unix_buffers: BufferConfig::for_unix(explicit),
        tcp_buffers: explicit,
        sendfile: !args.no_sendfile,
        stats: args.stats,
        send_batch: ferry_backend::parse_size(&args.send_batch).context("--send-batch")? as usize,
        tls_policy,
        tls,
        zerocopy: args.zerocopy.into(),
    };

    let listeners = match activated {
        Some(l) if !l.is_empty() => l,
        _ => vec![match &args.unix {
            Some(path) => Listener::bind_unix(path).with_context(|| format!("cannot listen on {}", path.display()))?,
            None => {
                let addr: SocketAddr = (args.bind.as_str(), args.port)
                    .to_socket_addrs()
                    .with_context(|| format!("--bind {}", args.bind))?
                    .next()
                    .with_context(|| format!("--bind {}: no address", args.bind))?;
                Listener::bind_tcp(&addr).with_context(|| format!("cannot listen on {addr}"))?
            }
        }],
    };
    check_transport(&args, &listeners)?;
    let (uri, unixsocket, port) = describe(&listeners[0], tls_policy == TlsPolicy::Require, &default_name);
    for e in exports.iter() {
        let name = if e.name.is_empty() { "default export".to_string() } else { format!("export {:?}", e.name) };
        let contexts: Vec<&str> = exports.meta_contexts(&e.name).iter().map(|c| c.name()).collect();
        log::info!("{name}: {} ({} bytes; contexts: {})", e.backend.describe(), e.backend.size(), contexts.join(", "));
    }
    log::info!("listening on {uri}{}", if tls_policy == TlsPolicy::On { " (TLS offered)" } else { "" });
    let per_client = args.max_connections_per_client.map(|n| format!(", {n} per client address")).unwrap_or_default();
    log::info!("accepting up to {max_connections} connections{per_client} (RLIMIT_NOFILE={nofile})");

    let mut server = Server::new(exports, config)?;
    let handle = server.shutdown_handle();
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, handle.shutdown_flag()).context("installing signal handlers")?;
        signal_hook::low_level::pipe::register(sig, handle.wake_fd()?).context("installing signal handlers")?;
    }
    // SIGUSR1 logs statistics (without --stats it is still handled: never a default kill).
    signal_hook::flag::register(signal_hook::consts::SIGUSR1, handle.stats_flag()).context("installing SIGUSR1")?;
    signal_hook::low_level::pipe::register(signal_hook::consts::SIGUSR1, handle.wake_fd()?)
        .context("installing SIGUSR1")?;
    if let Some(p) = &args.pid_file {
        // Once SIGTERM stops the server cleanly; whole or absent for a reader (renamed into place).
        write_pid_file(p).with_context(|| format!("--pid-file {}", p.display()))?;
    }
    if forked {
        crate::background::say_ready(crate::background::Channel::Stdout, &uri);
    }

    let child = match &args.run {
        Some(cmd) => {
            // A repository's passphrase is ferry's, not the command's (docs/backups.md).
            let mut child = Command::new("/bin/sh")
                .arg("-c")
                .arg(cmd)
                .env_remove("FERRY_PASSWORD")
                .env("uri", &uri)
                .env("unixsocket", unixsocket.as_deref().unwrap_or(""))
                .env("port", port.map(|p| p.to_string()).unwrap_or_default())
                .spawn()
                .with_context(|| format!("--run {cmd:?}"))?;
            let h = handle.clone();
            Some(std::thread::spawn(move || {
                let status = child.wait();
                h.shutdown();
                status
            }))
        }
        None => None,
    };
    server.run(&listeners)?;
    drop(listeners);
    if args.stats {
        log::info!("total: {}", server.totals());
    }
    match child {
        None => Ok(0),
        Some(t) => {
            let status = t.join().map_err(|_| anyhow::anyhow!("--run waiter panicked"))??;
            use std::os::unix::process::ExitStatusExt;
            Ok(status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(0)))
        }
    }
}

/// The NBD URI, socket path and port of a listener, for logs and `--run`, naming the
/// export `name` (the positional one). With `tls`, the scheme is `nbds`: the server
/// requires TLS.
fn describe(l: &Listener, tls: bool, name: &str) -> (String, Option<String>, Option<u16>) {
    let s = if tls { "s" } else { "" };
    let path = uri_path(name);
    // TCP URIs of the default export end at the port, as they always did.
    let name = if name.is_empty() { String::new() } else { format!("/{path}") };
    if let Some(p) = l.unix_path() {
        let socket = p.display().to_string();
        return (format!("nbd{s}+unix:///{path}?socket={socket}"), Some(socket), None);
    }
    match l.local_tcp_addr() {
        Some(SocketAddr::V6(a)) => (format!("nbd{s}://[{}]:{}{name}", a.ip(), a.port()), None, Some(a.port())),
        Some(a) => (format!("nbd{s}://{}:{}{name}", a.ip(), a.port()), None, Some(a.port())),
        None => (format!("nbd{s}://(socket activation){name}"), None, None),
    }
}

/// An export name as the path of an NBD URI: bytes other than RFC 3986's unreserved
/// ones (and `/`) percent-encoded.
fn uri_path(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for b in name.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~/".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}
