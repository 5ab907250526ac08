//! `ferry`: move block data over NBD at the speed of the machine.
//!
//! # What this crate owns
//!
//! CLI flags and their validation, logging, signals, captive mode, progress, `bench nbd`,
//! `bench conns` and `bench socket`, `copy_guard` (a copy that would overwrite its own
//! source is refused), `backup` (a copy engine run from the source into a
//! `ferry_repo::SnapshotWriter` on the disk's latest snapshot, the base read again once the
//! disk's lock is held; a stopped VM's local qcow2 keeps a `ferry-REPO8-NAME-ID16` bitmap
//! restarted only after the commit; `--resume` continues from the disk's checkpoint,
//! copying the selection minus `SnapshotWriter::done_ranges`), `repo` (init, list,
//! check, verify, forget, gc, stats), `compare` (two disks read side by side by threads,
//! qemu-img compare's verdicts) and the exit status of each failure a script tells apart
//! (`exit_status`, from the `ferry_repo::Failure` in an error's causes)
//!
//! `unsafe`: forbidden.
// The `///` comments on the command-line structs are clap's --help text (and the man
// pages'), plain text for a terminal: `nbd://HOST[:PORT]` there is a URI's syntax, not a
// rustdoc link. The libraries' docs are checked for broken links (scripts/test).
#![allow(rustdoc::broken_intra_doc_links)]

mod background;
mod backup;
mod bench;
mod bench_conns;
mod bench_socket;
mod bitmap;
mod compare;
mod completions;
mod copy;
mod copy_guard;
mod hash;
mod info;
mod interrupt;
mod libvirt;
mod libvirt_restore;
mod libvirt_virsh;
mod libvirt_xml;
mod man;
mod mount;
mod password_args;
mod remote_args;
mod repo;
mod repo_copy;
mod repo_key;
mod serve;
mod sockopts;
mod version;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "ferry",
    version,
    about = "Move block data over NBD (Network Block Device) at the speed of the machine"
)]
struct Cli {
    /// More log output (-v: debug, -vv: trace). RUST_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    /// Only log warnings and errors.
    #[arg(short, long, global = true)]
    quiet: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve one or more exports over NBD.
    Serve(serve::ServeArgs),
    /// Copy between NBD exports, files, block devices, stdin/stdout and null:.
    Copy(copy::CopyArgs),
    /// Show what an NBD export is and what it can do.
    Info(info::InfoArgs),
    /// blkhash checksums of disks: files, block devices, NBD exports, stdin.
    Hash(hash::HashArgs),
    /// Whether two disks hold the same content (qemu-img compare's semantics): exit status
    /// 0 identical, 1 different (the first differing offset printed), 2 error.
    Compare(compare::CompareArgs),
    /// Measure: NBD load against a server (`bench nbd URI`), a busy client beside many idle
    /// connections (`bench conns URI`), raw socket throughput (`bench socket`).
    Bench(bench::BenchArgs),
    /// Manage the persistent dirty bitmaps of a qcow2 image (qemu-img bitmap's spelling).
    Bitmap(bitmap::BitmapArgs),
    /// Back up a disk into a repository: a new snapshot REPO::NAME, deduplicated, only the
    /// changed ranges read with --dirty-bitmap.
    Backup(backup::BackupArgs),
    /// Restore a point of a libvirt domain (`ferry backup libvirt:DOMAIN REPO`): every disk
    /// and the domain's XML into a directory, optionally defined under a new name.
    Restore(libvirt_restore::RestoreArgs),
    /// A snapshot as a read-only FUSE file system, to get files back: DIR/disk.raw (the whole
    /// disk) and DIR/part1, part2, ... (its partitions), in the foreground until Ctrl-C.
    Mount(mount::MountArgs),
    /// Backup repositories: init, list, check, verify, forget, gc, stats.
    Repo(repo::RepoArgs),
    /// Print a completion script for bash, zsh or fish.
    Completions(completions::CompletionsArgs),
    /// Write the man pages into DIR (for man/ in the source tree).
    #[command(hide = true)]
    GenerateMan(man::GenerateManArgs),
}

/// The command line as clap defines it (for the man pages and completion scripts).
fn command() -> clap::Command {
    Cli::command()
}

/// The logger with the HTTP library's trace taken out, whatever `RUST_LOG` says: ureq's
/// (and ureq_proto's) trace prints whole requests, a presigned URL's signature and
/// security token and an `Authorization` header among them. Its debug lines carry no
/// secret and stay.
struct NoHttpTrace(env_logger::Logger);

impl NoHttpTrace {
    fn hidden(meta: &log::Metadata) -> bool {
        meta.level() == log::Level::Trace && meta.target().starts_with("ureq")
    }
}

impl log::Log for NoHttpTrace {
    fn enabled(&self, meta: &log::Metadata) -> bool {
        !Self::hidden(meta) && self.0.enabled(meta)
    }
    fn log(&self, record: &log::Record) {
        if !Self::hidden(record.metadata()) {
            self.0.log(record);
        }
    }
    fn flush(&self) {
        self.0.flush();
    }
}

/// `println!` onto a closed pipe (`ferry repo list | head -1`) panics in std: end quietly
/// instead, with the status of a program that SIGPIPE stopped (141), not with a backtrace
/// (and not 0: whatever was not printed may have been a failure). The process ends there,
/// without unwinding: print results after locks and temporary files are let go.
fn quiet_on_closed_stdout() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let msg = info.payload_as_str().unwrap_or("");
        if msg.starts_with("failed printing to stdout") && msg.contains("(os error 32)") {
            std::process::exit(141);
        }
        default(info)
    }));
}

fn main() {
    quiet_on_closed_stdout();
    // `--version` also names the features and library versions (computed here, once).
    let matches = match command().long_version(version::long()).try_get_matches() {
        Ok(m) => m,
        Err(e) => {
            // `info --can/--is` answer "no" with 2, as nbdinfo's do: a wrong command line
            // there exits 1, as nbdinfo's does, not clap's 2.
            // (Global options take no value: the first word that is no option is the command.)
            let is_info =
                std::env::args_os().skip(1).find(|a| !a.to_string_lossy().starts_with('-')) == Some("info".into());
            let asks = is_info
                && std::env::args_os().any(|a| {
                    let a = a.to_string_lossy();
                    ["--can", "--is"].iter().any(|f| a == *f || a.starts_with(&format!("{f}=")))
                });
            if asks && e.use_stderr() {
                let _ = e.print();
                std::process::exit(1);
            }
            e.exit()
        }
    };
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    usage_checks(&cli);
    let level = match (cli.quiet, cli.verbose) {
        (true, _) => "warn",
        (false, 0) => "info",
        (false, 1) => "debug",
        _ => "trace",
    };
    let mut builder = env_logger::Builder::from_env(env_logger::Env::default().default_filter_or(level));
    builder.format_target(false).format_timestamp(None);
    // `ferry mount --daemon`'s background process logs where it says once it is up.
    if matches!(&cli.command, Command::Mount(_)) && background::is_background(mount::DAEMON) {
        builder.target(env_logger::Target::Pipe(Box::new(background::LogSink)));
    }
    let logger = builder.build();
    let max = logger.filter();
    // A failed init means a logger is already set (never, in this binary): keep that one.
    if log::set_boxed_logger(Box::new(NoHttpTrace(logger))).is_ok() {
        log::set_max_level(max);
    }
    let result = match cli.command {
        Command::Serve(args) => serve::run(args),
        Command::Copy(args) => copy::run(args, cli.quiet),
        Command::Info(args) => info::run(args),
        Command::Hash(args) => hash::run(args, cli.quiet),
        Command::Compare(args) => compare::run(args, cli.quiet),
        Command::Bench(args) => bench::run(args),
        Command::Bitmap(args) => bitmap::run(args),
        Command::Backup(args) => backup::run(args, cli.quiet),
        Command::Restore(args) => libvirt_restore::run(args, cli.quiet),
        Command::Mount(args) => mount::run(args),
        Command::Repo(args) => repo::run(args),
        Command::Completions(args) => completions::run(args),
        Command::GenerateMan(args) => man::run(args),
    };
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) => match interrupt::received() {
            // 128 + N, as a shell reports a command a signal ended.
            Some(sig) => {
                say_error(&format!("interrupted by {}: {}", interrupt::name(sig), chain(&e)));
                std::process::exit(128 + sig);
            }
            None => {
                say_error(&chain(&e));
                std::process::exit(ferry_repo::Error::failure_in(e.as_ref()).map_or(1, exit_status));
            }
        },
    }
}

/// The final error: on standard error, or, in a background process that has let go of its
/// terminal, in its log (--log or syslog).
fn say_error(what: &str) {
    if background::detached() {
        log::error!("{what}");
        log::logger().flush();
    } else {
        eprintln!("ferry: error: {what}");
    }
}

/// What the command line says wrong that clap's definition cannot: a usage error, exit
/// status 2, before anything is opened.
fn usage_checks(cli: &Cli) {
    if let Command::Backup(b) = &cli.command {
        let max = ferry_repo::format::MAX_TAGS;
        if b.tags.len() > max {
            let msg = format!("{} --tag options: a snapshot holds at most {max} tags", b.tags.len());
            command().error(clap::error::ErrorKind::TooManyValues, msg).exit();
        }
    }
}

/// The exit status of each failure a script can tell apart (docs/repo.md, "Exit status";
/// 10, 11 and 12 are restic 0.17's numbers for the same failures). Any other error is 1,
/// a usage error 2.
pub(crate) fn exit_status(f: ferry_repo::Failure) -> i32 {
    use ferry_repo::Failure;
    match f {
        Failure::NoRepository => 10,
        Failure::Locked => 11,
        Failure::Passphrase => 12,
        Failure::Damaged => 13,
    }
}

/// The error and its causes, `: `-separated, each cause printed once: a cause whose text
/// its wrapper already ends with (a `#[error("cannot open {path}: {source}")]` that also
/// returns `source` from `source()`) is not repeated.
fn chain(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if out.ends_with(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::chain;

    #[test]
    fn each_cause_is_printed_once() {
        let io = std::io::Error::from_raw_os_error(2);
        let e = anyhow::Error::new(ferry_backend::SpecError::Open { path: "/x".into(), source: io })
            .context("source \"/x\"");
        assert_eq!(chain(&e), "source \"/x\": cannot open /x: No such file or directory (os error 2)");
        let e = anyhow::anyhow!("inner").context("middle").context("outer");
        assert_eq!(chain(&e), "outer: middle: inner");
    }
}
