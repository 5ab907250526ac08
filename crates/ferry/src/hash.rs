//! `ferry hash SRC...`: blkhash digests of files, block devices, NBD exports and stdin.

use anyhow::{Context, Result};
use clap::Args;
use ferry_backend::parse_size;
use ferry_client::copy::{copy, CopyOptions, Endpoint, Progress};
use ferry_client::ConnectOptions;
use ferry_hash::{hex, Algorithm, BlockHasher};
use std::sync::Arc;

#[derive(Args, Debug)]
pub struct HashArgs {
    /// Files, block devices, qcow2 images (the guest's content is hashed), NBD URIs, RBD
    /// images (rbd:POOL/IMAGE[@SNAP]), `-` for stdin, or snapshots in a backup repository
    /// (REPO::NAME[@ID]: with sha256 and 64K blocks, from the index without reading data).
    #[arg(required_unless_present = "list_digests", value_name = "SRC")]
    sources: Vec<String>,
    /// Hash function: sha256, sha512, sha1, md5 or blake3 (blksum's -d).
    #[arg(short = 'd', long, default_value = "sha256", value_parser = crate::completions::digest_values(), ignore_case = true)]
    digest: Algorithm,
    /// Print the names --digest takes, one a line, and exit (blksum's -l).
    #[arg(short = 'l', long)]
    list_digests: bool,
    /// blkhash block size.
    #[arg(long, default_value = "64K", value_name = "BYTES")]
    block_size: String,
    /// Threads (and NBD connections, where the server allows several). Default: all cores.
    #[arg(short = 't', long, value_name = "N")]
    threads: Option<usize>,
    /// Show progress.
    #[arg(short, long)]
    progress: bool,
    /// Read local images even while another program (qemu, ferry serve) writes them, as
    /// qemu-img's -U does; the digest may then not match any state of the image.
    #[arg(short = 'U', long)]
    force_share: bool,
    #[command(flatten)]
    remote: crate::remote_args::RemoteArgs,
}

pub fn run(args: HashArgs, quiet: bool) -> Result<i32> {
    if args.list_digests {
        for name in ["sha256", "sha512", "sha1", "md5", "blake3"] {
            println!("{name}");
        }
        return Ok(0);
    }
    let bs = parse_size(&args.block_size).context("--block-size")?;
    if bs == 0 || bs > 64 << 20 {
        anyhow::bail!("--block-size must be between 1 byte and 64M");
    }
    let threads = args.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get())).max(1);
    let remote = args.remote.remote();
    let cancel = crate::interrupt::install()?;
    use crate::remote_args::shown;
    for src in &args.sources {
        let loc = ferry_open::Location::parse(src).with_context(|| format!("{:?}", shown(src)))?;
        // A snapshot's chunk digests are its blkhash's block digests: its blkhash comes
        // from the index, without reading the data.
        let from_index = args.digest == Algorithm::Sha256 && bs == 64 << 10;
        let source = match &loc {
            ferry_open::Location::Repo { repo, name, id } => {
                let img =
                    match ferry_open::repo::snapshot_hash_or_image(repo, name, id.as_deref(), &remote, from_index)? {
                        Ok(d) => {
                            println!("{}  {}", hex(&d), shown(src));
                            continue;
                        }
                        Err(img) => img,
                    };
                let e = ferry_client::copy::BackendEndpoint::new(src.clone(), img);
                ferry_open::Source::plain(Endpoint::Backend(e))
            }
            _ => ferry_open::source(&loc, args.force_share, &remote).with_context(|| format!("{:?}", shown(src)))?,
        };
        let endpoint = &source.endpoint;
        let hasher = Arc::new(BlockHasher::new(args.digest, bs as usize));
        let local = matches!(endpoint, Endpoint::File(_) | Endpoint::Backend(_));
        let opts = CopyOptions {
            connections: threads,
            // Local reads are synchronous: one buffer per thread, read then hashed. 2 MiB
            // is 32 blocks of 64 KiB, the widest multi-buffer SHA-256 kernel's lane count,
            // and still fits in a core's L2 between the read and the hash.
            requests: if local { 1 } else { 64 },
            request_size: (bs as usize).max(if local { 2 << 20 } else { 256 << 10 }),
            sparse: true,
            flush: false,
            connect: ConnectOptions::default(),
            hash: Some(hasher),
            cancel: Some(cancel.clone()),
            ..CopyOptions::default()
        };
        let progress = Progress::default();
        let stop = std::sync::atomic::AtomicBool::new(false);
        let report = std::thread::scope(|s| {
            let shown = (args.progress && !quiet).then(|| s.spawn(|| crate::copy::show_progress(&progress, &stop)));
            let r = copy(endpoint, &Endpoint::Null, &opts, &progress);
            stop.store(true, std::sync::atomic::Ordering::SeqCst);
            if let Some(h) = shown {
                let _ = h.join();
            }
            r
        })
        .with_context(|| format!("hashing {}", shown(src)))?;
        let digest = report.digest.context("no digest computed")?;
        println!("{}  {}", hex(&digest), shown(src));
    }
    Ok(0)
}
