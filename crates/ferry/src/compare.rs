//! `ferry compare A B`: whether two disks hold the same content, with qemu-img compare's
//! semantics and exit status (0 identical, 1 different, 2 error).

use anyhow::{bail, Context, Result};
use clap::Args;
use ferry_backend::Backend;
use ferry_client::{ConnectOptions, Connection, Uri};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

#[derive(Args, Debug)]
pub struct CompareArgs {
    /// The first disk: a file, block device, qcow2 image, NBD URI, RBD or remote image, or
    /// a snapshot in a backup repository (REPO::NAME[@ID]).
    #[arg(value_name = "A")]
    a: String,
    /// The second disk, as A.
    #[arg(value_name = "B")]
    b: String,
    /// Strict (qemu-img compare's -s): disks of different sizes differ, and so do disks
    /// where one has data (allocated) and the other a hole, as their block status
    /// (base:allocation) says, even over zeroes. Without it the tail of the longer disk
    /// must read as zeroes, and a hole and written zeroes are the same content.
    #[arg(short = 's', long)]
    strict: bool,
    /// Accepted for qemu-img compare's command lines: the format of A (raw or qcow2).
    #[arg(short = 'f', long = "format", value_name = "FORMAT")]
    format_a: Option<ferry_open::Format>,
    /// Accepted for qemu-img compare's command lines: the format of B (raw or qcow2).
    #[arg(short = 'F', long = "format-b", value_name = "FORMAT")]
    format_b: Option<ferry_open::Format>,
    /// Read local images even while another program writes them (qemu-img's -U).
    #[arg(short = 'U', long)]
    force_share: bool,
    /// Threads (each with its own NBD connection). Default: all cores.
    #[arg(short = 't', long, value_name = "N")]
    threads: Option<usize>,
    #[command(flatten)]
    remote: crate::remote_args::RemoteArgs,
}

/// The unit each thread reads of both disks and compares.
const BLOCK: u64 = 1 << 20;

/// qemu-img compare reports a mismatch at the start of the 512-byte sector it is in.
const SECTOR: u64 = 512;

/// One disk, readable from several threads.
enum Disk {
    /// An image, and the snapshot it is when it is one (its chunk digests compared first).
    Image(Arc<dyn Backend>, Option<Arc<ferry_repo::SnapshotImage>>),
    Nbd(Uri, u64),
}

impl Disk {
    fn size(&self) -> u64 {
        match self {
            Disk::Image(b, _) => b.size(),
            Disk::Nbd(_, size) => *size,
        }
    }
}

/// Where two snapshots of the same chunk size may first differ, from their chunk digests
/// alone (no data read): the start of the first chunk whose digests differ, or of the
/// first chunk not whole in both; `None` when they are identical (equal sizes, every
/// digest equal).
fn differ_from(a: &ferry_repo::SnapshotImage, b: &ferry_repo::SnapshotImage) -> Option<u64> {
    let cs = a.chunk_size();
    let (sa, sb) = (a.size(), b.size());
    // Chunks whole in both (and the last one too when the sizes are equal).
    let comparable = if sa == sb { a.entries().len() } else { (sa.min(sb) / cs) as usize };
    let (ea, eb) = (a.entries(), b.entries());
    match (0..comparable.min(ea.len()).min(eb.len())).find(|&i| ea[i] != eb[i]) {
        Some(i) => Some(i as u64 * cs),
        None if sa == sb && ea.len() == eb.len() => None,
        None => Some(comparable as u64 * cs),
    }
}

/// A thread's reader of one disk: an NBD connection of its own.
enum Reader<'a> {
    Image(&'a Arc<dyn Backend>),
    Nbd(Box<Connection>),
}

impl Reader<'_> {
    fn of(d: &Disk) -> Result<Reader<'_>> {
        Ok(match d {
            Disk::Image(b, _) => Reader::Image(b),
            Disk::Nbd(u, _) => Reader::Nbd(Box::new(Connection::connect(u, &ConnectOptions::default())?)),
        })
    }
    /// Fills `buf` from `offset`; bytes past the disk's end read as zeroes.
    fn read(&mut self, buf: &mut Vec<u8>, offset: u64, size: u64) -> Result<()> {
        let n = size.saturating_sub(offset).min(buf.len() as u64) as usize;
        buf[n..].fill(0);
        if n == 0 {
            return Ok(());
        }
        match self {
            Reader::Image(b) => b.read(&mut buf[..n], offset)?,
            Reader::Nbd(c) => {
                let mut part = std::mem::take(buf);
                part.truncate(n);
                let r = c.pread(&mut part, offset);
                part.resize(BLOCK as usize, 0);
                *buf = part;
                r?
            }
        }
        Ok(())
    }
}

/// `quiet` (-q, as qemu-img compare's): print no verdict, only errors.
pub fn run(args: CompareArgs, quiet: bool) -> Result<i32> {
    // Any error is 2, as qemu-img compare's: 1 means "different".
    match compare(&args, quiet) {
        Ok(code) => Ok(code),
        Err(e) => {
            eprintln!("ferry: error: {}", crate::chain(&e));
            Ok(2)
        }
    }
}

fn open(spec: &str, format: Option<ferry_open::Format>, args: &CompareArgs) -> Result<Disk> {
    let spec = match format {
        Some(f) => crate::serve::with_format(spec, f).context("--format")?,
        None => spec.to_string(),
    };
    let shown = crate::remote_args::shown(&spec);
    let loc = ferry_open::Location::parse(&spec).with_context(|| format!("{shown:?}"))?;
    let remote = args.remote.remote();
    Ok(match &loc {
        ferry_open::Location::Nbd(u) => {
            let c = Connection::connect(u, &ConnectOptions::default()).with_context(|| format!("connecting to {u}"))?;
            Disk::Nbd(u.clone(), c.size())
        }
        ferry_open::Location::Stdio => bail!("- is a stream: compare needs two disks it can read at any offset"),
        ferry_open::Location::Repo { repo, name, id } => {
            let img = ferry_open::repo::open_snapshot(repo, name, id.as_deref(), &remote)?;
            Disk::Image(img.clone(), Some(img))
        }
        _ => {
            let how = ferry_open::ServeOpen { read_only: true, force_share: args.force_share, allow_truncated: false };
            let (b, _files) = ferry_open::open_backend(&loc, how, &remote).with_context(|| format!("{shown:?}"))?;
            Disk::Image(b, None)
        }
    })
}

fn compare(args: &CompareArgs, quiet: bool) -> Result<i32> {
    let a = open(&args.a, args.format_a, args)?;
    let b = open(&args.b, args.format_b, args)?;
    let say = |s: &str| {
        if !quiet {
            println!("{s}");
        }
    };
    let (sa, sb) = (a.size(), b.size());
    if sa != sb && args.strict {
        say("Strict mode: Image size mismatch!");
        return Ok(1);
    }
    let threads = args.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get())).max(1);
    // Two snapshots of one chunk size: what their digests show equal is not read.
    let start = match (&a, &b) {
        (Disk::Image(_, Some(x)), Disk::Image(_, Some(y))) if x.chunk_size() == y.chunk_size() => differ_from(x, y),
        _ => Some(0),
    };
    // Strict: where the allocation first differs bounds the content compared (qemu-img
    // reports whichever comes first).
    let status_at = if args.strict { first_allocation_difference(&a, &b)? } else { None };
    let end = status_at.unwrap_or(sa.max(sb));
    let found = match start {
        Some(start) if start < end => first_difference(&a, &b, start, end, threads)?,
        _ => None,
    };
    if let (None, Some(at)) = (found, status_at) {
        say(&format!("Strict mode: Offset {} block status mismatch!", at / SECTOR * SECTOR));
        return Ok(1);
    }
    // As qemu-img: the warning once the common part compared equal, before the tail's verdict.
    if sa != sb && found.is_none_or(|at| at >= sa.min(sb)) {
        say("Warning: Image size mismatch!");
    }
    match found {
        None => {
            say("Images are identical.");
            Ok(0)
        }
        Some(at) => {
            say(&format!("Content mismatch at offset {}!", at / SECTOR * SECTOR));
            Ok(1)
        }
    }
}

/// One disk's allocation, run by run: data, or a hole (`NBD_STATE_HOLE`).
struct Allocation<'a> {
    disk: &'a Disk,
    conn: Option<Connection>,
}

impl Allocation<'_> {
    /// Whether `offset` is in a hole, and where that run ends. A server that offers no
    /// block status has data everywhere.
    fn at(&mut self, offset: u64) -> Result<(bool, u64)> {
        let size = self.disk.size();
        let mut out = Vec::new();
        match (self.disk, &mut self.conn) {
            (Disk::Image(b, _), _) => b.extents(offset, size - offset, 1, &mut out)?,
            (Disk::Nbd(..), Some(c)) if c.can_block_status() => {
                let len = (size - offset).min(c.max_status_length()).min(1 << 30);
                out = c.block_status(offset, len)?
            }
            (Disk::Nbd(..), _) => return Ok((false, size)),
        }
        let e = out.first().context("a block status without extents")?;
        let hole = e.flags & ferry_proto::consts::STATE_HOLE != 0;
        Ok((hole, offset.saturating_add(e.length.max(1)).min(size)))
    }
}

/// The first offset where one disk has data and the other a hole (the disks are of one
/// size), or `None`.
fn first_allocation_difference(a: &Disk, b: &Disk) -> Result<Option<u64>> {
    let conn = |d: &Disk| -> Result<Option<Connection>> {
        Ok(match d {
            Disk::Nbd(u, _) => Some(Connection::connect(u, &ConnectOptions::default())?),
            Disk::Image(..) => None,
        })
    };
    let (mut x, mut y) = (Allocation { disk: a, conn: conn(a)? }, Allocation { disk: b, conn: conn(b)? });
    let size = a.size().min(b.size());
    let mut at = 0;
    while at < size {
        let ((ha, ea), (hb, eb)) = (x.at(at)?, y.at(at)?);
        if ha != hb {
            return Ok(Some(at));
        }
        at = ea.min(eb);
    }
    Ok(None)
}

/// A thread's view of where one disk reads as zeroes (`base:allocation`'s `NBD_STATE_ZERO`),
/// one extent at a time: blocks that read as zeroes on a side are not read there. It asks
/// on the connection the thread reads with: a server may take one client at a time
/// (`qemu-nbd` without `-e`).
struct Zeroes<'a> {
    disk: &'a Disk,
    /// The last extent asked for: its start, end and whether it reads as zeroes.
    known: (u64, u64, bool),
}

impl<'a> Zeroes<'a> {
    fn of(disk: &'a Disk) -> Zeroes<'a> {
        Zeroes { disk, known: (0, 0, false) }
    }

    /// Whether `offset..end` reads as zeroes: past the disk's end it does; a disk that
    /// tells no block status is taken to have data everywhere.
    fn all_zero(&mut self, reader: &mut Reader, mut offset: u64, end: u64) -> Result<bool> {
        let size = self.disk.size();
        loop {
            if offset >= size || offset >= end {
                return Ok(true);
            }
            let (from, to, _) = self.known;
            if !(from <= offset && offset < to) {
                let mut out = Vec::new();
                match reader {
                    Reader::Image(b) => b.extents(offset, size - offset, 1, &mut out)?,
                    Reader::Nbd(c) if c.can_block_status() => {
                        let len = (size - offset).min(c.max_status_length()).min(1 << 30);
                        out = c.block_status(offset, len)?
                    }
                    Reader::Nbd(_) => return Ok(false),
                }
                let e = out.first().context("a block status without extents")?;
                let zero = e.flags & ferry_proto::consts::STATE_ZERO != 0;
                self.known = (offset, offset.saturating_add(e.length.max(1)).min(size), zero);
            }
            let (_, to, zero) = self.known;
            if !zero {
                return Ok(false);
            }
            // The block may go on past this extent: the next one decides.
            offset = to;
        }
    }
}

/// The first byte offset from `start` and below `end` at which `a` and `b` differ (bytes past a disk's end
/// reading as zeroes), read by `threads` threads. Blocks are taken in increasing order and
/// a thread stops at a block past a difference found, so every block below the first
/// difference is compared. A block that reads as zeroes on one side (its block status
/// says so) is read only on the other, and on neither where both say so.
fn first_difference(a: &Disk, b: &Disk, start: u64, end: u64, threads: usize) -> Result<Option<u64>> {
    let next = AtomicU64::new(start);
    let first = AtomicU64::new(u64::MAX);
    let (sa, sb) = (a.size(), b.size());
    let work = || -> Result<()> {
        let (mut ra, mut rb) = (Reader::of(a)?, Reader::of(b)?);
        let (mut za, mut zb) = (Zeroes::of(a), Zeroes::of(b));
        let (mut ba, mut bb) = (vec![0u8; BLOCK as usize], vec![0u8; BLOCK as usize]);
        loop {
            let off = next.fetch_add(BLOCK, Ordering::Relaxed);
            if off >= end || off >= first.load(Ordering::Relaxed) {
                return Ok(());
            }
            let len = (end - off).min(BLOCK) as usize;
            let (za_zero, zb_zero) =
                (za.all_zero(&mut ra, off, off + len as u64)?, zb.all_zero(&mut rb, off, off + len as u64)?);
            let at = match (za_zero, zb_zero) {
                (true, true) => None,
                (true, false) => {
                    rb.read(&mut bb, off, sb)?;
                    bb[..len].iter().position(|&x| x != 0)
                }
                (false, true) => {
                    ra.read(&mut ba, off, sa)?;
                    ba[..len].iter().position(|&x| x != 0)
                }
                (false, false) => {
                    ra.read(&mut ba, off, sa)?;
                    rb.read(&mut bb, off, sb)?;
                    match ba[..len] == bb[..len] {
                        true => None,
                        false => ba[..len].iter().zip(&bb[..len]).position(|(x, y)| x != y),
                    }
                }
            };
            if let Some(i) = at {
                first.fetch_min(off + i as u64, Ordering::Relaxed);
                return Ok(());
            }
        }
    };
    let results: Vec<Result<()>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads).map(|_| s.spawn(work)).collect();
        hs.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("a compare thread panicked")))).collect()
    });
    for r in results {
        r?;
    }
    let found = first.load(Ordering::Relaxed);
    Ok((found != u64::MAX).then_some(found))
}
