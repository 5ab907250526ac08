//! `ferry`: move block data over NBD at the speed of the machine.

mod bench;
mod bench_conns;
mod bench_socket;
mod copy;
mod hash;
mod image;
mod info;
mod rbd_spec;
mod serve;
mod sockopts;

use clap::{Parser, Subcommand};

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
    /// Measure: parallel NBD load (`bench nbd URI`).
    Bench(bench::BenchArgs),
}

fn main() {
    let cli = Cli::parse();
    let level = match (cli.quiet, cli.verbose) {
        (true, _) => "warn",
        (false, 0) => "info",
        (false, 1) => "debug",
        _ => "trace",
    };
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or(level))
        .format_target(false)
        .format_timestamp(None)
        .init();
    let result = match cli.command {
        Command::Serve(args) => serve::run(args),
        Command::Copy(args) => copy::run(args, cli.quiet),
        Command::Info(args) => info::run(args),
        Command::Hash(args) => hash::run(args, cli.quiet),
        Command::Bench(args) => bench::run(args),
    };
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("ferry: error: {e:#}");
            std::process::exit(1);
        }
    }
}
