//! `ferry bench socket`: how fast can bytes go through a socket on this machine?
//!
//! A sweep over the knobs of two source documents, measured on raw sockets with no NBD
//! in the way:
//!
//! * document 003 (read/write buffer sizes): the size of each `write()` and `read()`
//!   call, the share of "short reads" (a `read()` that returns less than asked), Unix
//!   against loopback TCP, one stream against several in parallel;
//! * document 000 (SO_SNDBUF): the send buffer of the writing socket, from the kernel
//!   default up to a few MiB.
//!
//! One measurement: `--streams` socket pairs, a writer thread per pair that writes its
//! share of `--bytes` with `write()` calls of the write size from a prefilled buffer,
//! and a reader thread per pair that `read()`s with the read size until it has every
//! byte. The clock runs from the moment the writers start to the last byte read. The
//! kernel's own SO_SNDBUF value is reported next to the requested one: Linux doubles the
//! request (for its bookkeeping) and caps it at `net.core.wmem_max`.

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use ferry_backend::parse_size;
use plotters::coord::Shift;
use plotters::prelude::*;
use serde_json::json;
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Barrier;
use std::time::Instant;

#[derive(Args, Debug)]
pub struct SocketArgs {
    /// Which sockets: `unix` (a socketpair), `tcp` (connections over 127.0.0.1) or `both`.
    #[arg(long, value_enum, default_value_t = TransportArg::Both)]
    transport: TransportArg,
    /// Bytes per write() call, a comma-separated list (K, M suffixes, binary).
    #[arg(long, default_value = "4K,16K,64K,256K,1M", value_name = "LIST")]
    write_sizes: String,
    /// Bytes asked for by each read() call, a comma-separated list.
    #[arg(long, default_value = "4K,32K,128K,1M", value_name = "LIST")]
    read_sizes: String,
    /// SO_SNDBUF of the writing socket, a comma-separated list; `default` leaves the
    /// kernel's default. Linux doubles the value and caps it at net.core.wmem_max. On TCP,
    /// setting SO_SNDBUF turns off the kernel's send-buffer autotuning.
    #[arg(long, default_value = "default,256K,1M,4M", value_name = "LIST")]
    sndbuf: String,
    /// Parallel socket pairs (one writer and one reader thread each), a comma-separated list.
    #[arg(long, default_value = "1,2", value_name = "LIST")]
    streams: String,
    /// Bytes moved by one measurement, split evenly across its streams.
    #[arg(long, default_value = "1G", value_name = "SIZE")]
    bytes: String,
    /// Run each measurement N times and report the run with the median throughput.
    #[arg(long, default_value_t = 1, value_name = "N")]
    repeat: u32,
    /// Draw throughput and short reads against buffer size into PATH.svg and PATH.png
    /// (only one of them if PATH ends in .svg or .png).
    #[arg(long, value_name = "PATH")]
    chart: Option<PathBuf>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum TransportArg {
    Unix,
    Tcp,
    Both,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Transport {
    Unix,
    Tcp,
}

impl Transport {
    fn name(self) -> &'static str {
        match self {
            Transport::Unix => "unix",
            Transport::Tcp => "tcp",
        }
    }
}

/// One measurement's settings.
#[derive(Clone, Copy, Debug)]
struct Point {
    transport: Transport,
    /// Requested SO_SNDBUF; `None` is the kernel default.
    sndbuf: Option<usize>,
    streams: usize,
    write: usize,
    read: usize,
}

/// What one run of a measurement saw.
#[derive(Clone, Debug)]
struct Sample {
    bytes: u64,
    secs: f64,
    reads: u64,
    short_reads: u64,
    writes: u64,
    short_writes: u64,
    /// SO_SNDBUF of the first writer right after setup (after setting it, if asked).
    sndbuf_start: usize,
    /// SO_SNDBUF of the first writer after the transfer (TCP autotuning grows it).
    sndbuf_end: usize,
}

impl Sample {
    fn gibs(&self) -> f64 {
        self.bytes as f64 / self.secs / GIB
    }
    fn short_pct(&self) -> f64 {
        if self.reads == 0 {
            0.0
        } else {
            100.0 * self.short_reads as f64 / self.reads as f64
        }
    }
}

/// A measurement: its settings, the median run, and every run's throughput.
struct Row {
    point: Point,
    median: Sample,
    runs: Vec<f64>,
}

const GIB: f64 = (1u64 << 30) as f64;

pub fn run(a: SocketArgs) -> Result<i32> {
    let writes = parse_list(&a.write_sizes, "--write-sizes")?;
    let reads = parse_list(&a.read_sizes, "--read-sizes")?;
    let sndbufs = parse_sndbufs(&a.sndbuf)?;
    let streams: Vec<usize> = a
        .streams
        .split(',')
        .map(|s| s.trim().parse::<usize>().ok().filter(|n| (1..=64).contains(n)))
        .collect::<Option<_>>()
        .context("--streams: a comma-separated list of numbers from 1 to 64")?;
    let bytes = parse_size(&a.bytes).context("--bytes")?;
    for &s in writes.iter().chain(&reads) {
        if s == 0 || s > 1 << 30 {
            bail!("--write-sizes and --read-sizes take sizes from 1 byte to 1G");
        }
    }
    if bytes < *streams.iter().max().unwrap_or(&1) as u64 {
        bail!("--bytes must be at least one byte per stream");
    }
    if a.repeat == 0 {
        bail!("--repeat must be at least 1");
    }
    let transports = match a.transport {
        TransportArg::Unix => vec![Transport::Unix],
        TransportArg::Tcp => vec![Transport::Tcp],
        TransportArg::Both => vec![Transport::Unix, Transport::Tcp],
    };
    let wmem_max = read_proc_usize("/proc/sys/net/core/wmem_max");
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());

    let mut points = Vec::new();
    for &transport in &transports {
        for &sndbuf in &sndbufs {
            for &n in &streams {
                for &write in &writes {
                    for &read in &reads {
                        points.push(Point { transport, sndbuf, streams: n, write, read });
                    }
                }
            }
        }
    }

    if !a.json {
        println!(
            "ferry bench socket: {} per measurement, {} measurement(s){}, {cpus} CPU(s), net.core.wmem_max {}",
            fmt_size(bytes as usize),
            points.len(),
            if a.repeat > 1 { format!(" x {} runs (median shown)", a.repeat) } else { String::new() },
            wmem_max.map_or_else(|| "unknown".to_string(), |v| v.to_string()),
        );
        println!("{}", header());
    }
    let mut rows = Vec::with_capacity(points.len());
    for p in points {
        let mut samples = Vec::with_capacity(a.repeat as usize);
        for _ in 0..a.repeat {
            samples.push(measure(p, bytes).with_context(|| describe(&p))?);
        }
        // Every run's throughput in the order they ran, then the median run.
        let runs: Vec<f64> = samples.iter().map(Sample::gibs).collect();
        samples.sort_by(|x, y| x.gibs().total_cmp(&y.gibs()));
        let median = samples.swap_remove(samples.len() / 2);
        let row = Row { point: p, median, runs };
        if !a.json {
            println!("{}", format_row(&row));
        }
        rows.push(row);
    }

    let mut charts = Vec::new();
    if let Some(path) = &a.chart {
        charts = draw_charts(path, &rows, bytes)?;
        if !a.json {
            for c in &charts {
                println!("chart: {}", c.display());
            }
        }
    }
    if a.json {
        let results: Vec<_> = rows
            .iter()
            .map(|r| {
                let (p, s) = (&r.point, &r.median);
                json!({
                    "transport": p.transport.name(), "sndbuf_requested": p.sndbuf,
                    "sndbuf_kernel": s.sndbuf_start, "sndbuf_after": s.sndbuf_end,
                    "streams": p.streams, "write_size": p.write, "read_size": p.read,
                    "bytes": s.bytes, "seconds": s.secs, "gib_per_s": s.gibs(),
                    "mib_per_s": s.gibs() * 1024.0, "reads": s.reads, "short_reads": s.short_reads,
                    "short_read_pct": s.short_pct(), "writes": s.writes, "short_writes": s.short_writes,
                    "runs_gib_per_s": r.runs,
                })
            })
            .collect();
        let v = json!({
            "bytes": bytes, "repeat": a.repeat, "cpus": cpus, "wmem_max": wmem_max,
            "charts": charts.iter().map(|c| c.display().to_string()).collect::<Vec<_>>(),
            "results": results,
        });
        println!("{v}");
    }
    Ok(0)
}

fn parse_list(s: &str, what: &str) -> Result<Vec<usize>> {
    let v: Vec<usize> = s
        .split(',')
        .map(|x| parse_size(x.trim()).map(|n| n as usize).with_context(|| format!("{what}: {x:?}")))
        .collect::<Result<_>>()?;
    if v.is_empty() {
        bail!("{what}: empty list");
    }
    Ok(v)
}

fn parse_sndbufs(s: &str) -> Result<Vec<Option<usize>>> {
    s.split(',')
        .map(|x| {
            let x = x.trim();
            if x.eq_ignore_ascii_case("default") {
                return Ok(None);
            }
            let n = parse_size(x).with_context(|| format!("--sndbuf: {x:?}"))?;
            if n == 0 || n > i32::MAX as u64 / 2 {
                bail!("--sndbuf: {x:?} must be between 1 byte and 1G, or `default`");
            }
            Ok(Some(n as usize))
        })
        .collect()
}

fn read_proc_usize(path: &str) -> Option<usize> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// `1M`, `64K` or plain bytes.
fn fmt_size(n: usize) -> String {
    if n >= 1 << 30 && n.is_multiple_of(1 << 30) {
        format!("{}G", n >> 30)
    } else if n >= 1 << 20 && n.is_multiple_of(1 << 20) {
        format!("{}M", n >> 20)
    } else if n >= 1 << 10 && n.is_multiple_of(1 << 10) {
        format!("{}K", n >> 10)
    } else {
        n.to_string()
    }
}

fn fmt_sndbuf(s: Option<usize>) -> String {
    s.map_or_else(|| "default".to_string(), fmt_size)
}

fn describe(p: &Point) -> String {
    format!(
        "{} socket, sndbuf {}, {} stream(s), {}-byte writes, {}-byte reads",
        p.transport.name(),
        fmt_sndbuf(p.sndbuf),
        p.streams,
        p.write,
        p.read
    )
}

fn header() -> String {
    format!(
        "{:<9} {:>7} {:>16} {:>7} {:>6} {:>6} {:>7} {:>8} {:>9} {:>7} {:>9} {:>8}",
        "transport",
        "sndbuf",
        "kernel sndbuf",
        "streams",
        "write",
        "read",
        "GiB/s",
        "MiB/s",
        "reads",
        "short%",
        "avg read",
        "short wr"
    )
}

fn format_row(r: &Row) -> String {
    let (p, s) = (&r.point, &r.median);
    // The kernel's value; for TCP left to autotuning, also what it had grown to at the end.
    let kernel = if s.sndbuf_end != s.sndbuf_start {
        format!("{}->{}", s.sndbuf_start, s.sndbuf_end)
    } else {
        s.sndbuf_start.to_string()
    };
    let avg = s.bytes.checked_div(s.reads).unwrap_or(0) as usize;
    format!(
        "{:<9} {:>7} {:>16} {:>7} {:>6} {:>6} {:>7.3} {:>8.0} {:>9} {:>7.1} {:>9} {:>8}",
        p.transport.name(),
        fmt_sndbuf(p.sndbuf),
        kernel,
        p.streams,
        fmt_size(p.write),
        fmt_size(p.read),
        s.gibs(),
        s.gibs() * 1024.0,
        s.reads,
        s.short_pct(),
        fmt_size(avg),
        s.short_writes
    )
}

// ---------------------------------------------------------------------------------
// Measuring
// ---------------------------------------------------------------------------------

/// Either end of a stream socket: both kinds read and write with plain read(2)/write(2).
enum End {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl End {
    fn sock(&self) -> socket2::SockRef<'_> {
        match self {
            End::Unix(s) => socket2::SockRef::from(s),
            End::Tcp(s) => socket2::SockRef::from(s),
        }
    }
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            End::Unix(s) => s.read(buf),
            End::Tcp(s) => s.read(buf),
        }
    }
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            End::Unix(s) => s.write(buf),
            End::Tcp(s) => s.write(buf),
        }
    }
}

/// `n` connected (writer, reader) pairs.
fn pairs(t: Transport, n: usize) -> io::Result<Vec<(End, End)>> {
    let mut v = Vec::with_capacity(n);
    match t {
        Transport::Unix => {
            for _ in 0..n {
                let (w, r) = UnixStream::pair()?;
                v.push((End::Unix(w), End::Unix(r)));
            }
        }
        Transport::Tcp => {
            let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
            let addr = l.local_addr()?;
            for _ in 0..n {
                let w = TcpStream::connect(addr)?;
                let (r, _) = l.accept()?;
                v.push((End::Tcp(w), End::Tcp(r)));
            }
        }
    }
    Ok(v)
}

struct WriterStats {
    start: Instant,
    writes: u64,
    short_writes: u64,
    sndbuf_end: usize,
}

struct ReaderStats {
    end: Instant,
    reads: u64,
    short_reads: u64,
}

fn measure(p: Point, bytes: u64) -> Result<Sample> {
    let n = p.streams;
    let share = bytes / n as u64;
    let mut ends = pairs(p.transport, n).context("creating sockets")?;
    let mut sndbuf_start = 0;
    for (i, (w, _)) in ends.iter().enumerate() {
        let sock = w.sock();
        if let Some(s) = p.sndbuf {
            sock.set_send_buffer_size(s).context("setting SO_SNDBUF")?;
        }
        if i == 0 {
            sndbuf_start = sock.send_buffer_size()?;
        }
    }
    let wbuf: Vec<u8> = (0..p.write).map(|i| (i % 251) as u8 ^ 0x5a).collect();
    let barrier = Barrier::new(2 * n);
    let (writers, readers) = std::thread::scope(|s| {
        let mut wh = Vec::with_capacity(n);
        let mut rh = Vec::with_capacity(n);
        for (w, r) in ends.drain(..) {
            let (wbuf, barrier) = (&wbuf, &barrier);
            wh.push(s.spawn(move || writer(w, wbuf, share, barrier)));
            rh.push(s.spawn(move || reader(r, p.read, share, barrier)));
        }
        let writers: Vec<io::Result<WriterStats>> = wh.into_iter().map(join).collect();
        let readers: Vec<io::Result<ReaderStats>> = rh.into_iter().map(join).collect();
        (writers, readers)
    });
    let writers = writers.into_iter().collect::<io::Result<Vec<_>>>().context("writer")?;
    let readers = readers.into_iter().collect::<io::Result<Vec<_>>>().context("reader")?;
    let start = writers.iter().map(|w| w.start).min().expect("at least one stream");
    let end = readers.iter().map(|r| r.end).max().expect("at least one stream");
    Ok(Sample {
        bytes: share * n as u64,
        secs: end.duration_since(start).as_secs_f64().max(1e-9),
        reads: readers.iter().map(|r| r.reads).sum(),
        short_reads: readers.iter().map(|r| r.short_reads).sum(),
        writes: writers.iter().map(|w| w.writes).sum(),
        short_writes: writers.iter().map(|w| w.short_writes).sum(),
        sndbuf_start,
        sndbuf_end: writers[0].sndbuf_end,
    })
}

fn join<T>(h: std::thread::ScopedJoinHandle<'_, io::Result<T>>) -> io::Result<T> {
    h.join().unwrap_or_else(|_| Err(io::Error::other("benchmark thread panicked")))
}

/// Moves `total` bytes with calls of `op(want)` for at most `size` bytes each (less for
/// the last ones), retrying on EINTR. `op` returning 0 is the error `on_zero`. Returns
/// the calls made and how many moved less than asked.
fn pump(
    total: u64,
    size: usize,
    on_zero: fn() -> io::Error,
    mut op: impl FnMut(usize) -> io::Result<usize>,
) -> io::Result<(u64, u64)> {
    let (mut left, mut calls, mut short) = (total, 0u64, 0u64);
    while left > 0 {
        let want = size.min(usize::try_from(left).unwrap_or(usize::MAX));
        match op(want) {
            Ok(0) => return Err(on_zero()),
            Ok(k) => {
                calls += 1;
                if k < want {
                    short += 1;
                }
                left -= k as u64;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    Ok((calls, short))
}

/// Writes `total` bytes with write() calls of `buf.len()` bytes (less for the last one).
fn writer(mut s: End, buf: &[u8], total: u64, barrier: &Barrier) -> io::Result<WriterStats> {
    barrier.wait();
    let start = Instant::now();
    let (writes, short_writes) =
        pump(total, buf.len(), || io::ErrorKind::WriteZero.into(), |want| s.write(&buf[..want]))?;
    let sndbuf_end = s.sock().send_buffer_size()?;
    Ok(WriterStats { start, writes, short_writes, sndbuf_end })
}

/// Reads until `total` bytes came, asking for `size` bytes a call (less for the last
/// bytes); a read that returns less than asked is a short read.
fn reader(mut s: End, size: usize, total: u64, barrier: &Barrier) -> io::Result<ReaderStats> {
    // Touch the buffer first, so page faults are not measured.
    let mut buf = vec![1u8; size];
    barrier.wait();
    let eof = || io::Error::new(io::ErrorKind::UnexpectedEof, "the writer closed early");
    let (reads, short_reads) = pump(total, size, eof, |want| s.read(&mut buf[..want]))?;
    Ok(ReaderStats { end: Instant::now(), reads, short_reads })
}

// ---------------------------------------------------------------------------------
// Charts
// ---------------------------------------------------------------------------------

/// The font the charts are drawn with: a Latin-1 subset of DejaVu Sans, embedded so
/// that PNG charts need no fonts on the machine (see assets/DejaVuSans-LICENSE.txt).
static FONT: &[u8] = include_bytes!("../assets/DejaVuSans-subset.ttf");

fn register_font() -> Result<()> {
    static ONCE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let ok = *ONCE.get_or_init(|| plotters::style::register_font("sans-serif", FontStyle::Normal, FONT).is_ok());
    if !ok {
        bail!("the embedded chart font is not a valid font");
    }
    Ok(())
}

/// Writes the chart(s) for `path` and returns the files written.
fn draw_charts(path: &Path, rows: &[Row], bytes: u64) -> Result<Vec<PathBuf>> {
    register_font()?;
    let ext = path.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase);
    let files = match ext.as_deref() {
        Some("svg") | Some("png") => vec![path.to_path_buf()],
        _ => {
            // Append rather than replace, so that `--chart out/run1.2` keeps its dot.
            let with = |e: &str| {
                let mut p = path.as_os_str().to_owned();
                p.push(e);
                PathBuf::from(p)
            };
            vec![with(".svg"), with(".png")]
        }
    };
    let layout = Layout::new(rows, bytes);
    let (w, h) = layout.size;
    for f in &files {
        let is_png = f.extension().is_some_and(|e| e.eq_ignore_ascii_case("png"));
        if is_png {
            let mut rgb = vec![0u8; w as usize * h as usize * 3];
            {
                let root = BitMapBackend::with_buffer(&mut rgb, (w, h)).into_drawing_area();
                draw(&root, &layout).map_err(|e| anyhow::anyhow!("drawing {}: {e}", f.display()))?;
                root.present().map_err(|e| anyhow::anyhow!("drawing {}: {e}", f.display()))?;
            }
            write_png(f, &rgb, w, h).with_context(|| format!("writing {}", f.display()))?;
        } else {
            let root = SVGBackend::new(f, (w, h)).into_drawing_area();
            draw(&root, &layout).map_err(|e| anyhow::anyhow!("drawing {}: {e}", f.display()))?;
            root.present().map_err(|e| anyhow::anyhow!("writing {}: {e}", f.display()))?;
        }
    }
    Ok(files)
}

/// Encodes an RGB image as an 8-bit palette PNG, which keeps a chart to a fraction of
/// the size of plain RGB. A chart has a few colours plus the anti-aliasing blends between
/// them: the 256 commonest colours make the palette and any rarer blend is drawn with the
/// nearest of them, which no eye can tell apart at this scale.
fn write_png(path: &Path, rgb: &[u8], w: u32, h: u32) -> Result<()> {
    let mut counts: std::collections::HashMap<[u8; 3], u64> = std::collections::HashMap::new();
    for px in rgb.chunks_exact(3) {
        *counts.entry([px[0], px[1], px[2]]).or_default() += 1;
    }
    let mut by_count: Vec<([u8; 3], u64)> = counts.into_iter().collect();
    by_count.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let palette: Vec<[u8; 3]> = by_count.iter().take(256).map(|&(c, _)| c).collect();
    let dist =
        |a: [u8; 3], b: [u8; 3]| -> u32 { (0..3).map(|i| (i32::from(a[i]) - i32::from(b[i])).pow(2) as u32).sum() };
    let index: std::collections::HashMap<[u8; 3], u8> = by_count
        .iter()
        .map(|&(c, _)| {
            let best = (0..palette.len()).min_by_key(|&i| dist(c, palette[i])).unwrap_or(0);
            (c, best as u8)
        })
        .collect();
    let indexed: Vec<u8> = rgb.chunks_exact(3).map(|px| index[&[px[0], px[1], px[2]]]).collect();
    let file = std::io::BufWriter::new(std::fs::File::create(path)?);
    let mut enc = png::Encoder::new(file, w, h);
    enc.set_color(png::ColorType::Indexed);
    enc.set_depth(png::BitDepth::Eight);
    enc.set_palette(palette.concat());
    enc.set_compression(png::Compression::Best);
    let mut wr = enc.write_header()?;
    wr.write_image_data(&indexed)?;
    wr.finish()?;
    Ok(())
}

/// One line of a panel: an SO_SNDBUF setting and a stream count (the transport is the
/// panel's row).
#[derive(Clone, Copy, PartialEq, Eq)]
struct SeriesKey {
    sndbuf: Option<usize>,
    streams: usize,
}

/// What goes where. Rows of panels: per transport, throughput above short reads. The
/// buffer size with more values is the x axis (log2); the other makes one column of
/// panels per value. Colour tells the SO_SNDBUF setting, line style and marker the
/// number of streams.
struct Layout<'a> {
    rows: &'a [Row],
    transports: Vec<Transport>,
    x_is_write: bool,
    xs: Vec<usize>,
    panels: Vec<usize>,
    sndbufs: Vec<Option<usize>>,
    streams: Vec<usize>,
    max_gibs: f64,
    title: String,
    size: (u32, u32),
}

const PANEL_W: u32 = 360;
const LEGEND_W: u32 = 250;
const TITLE_H: u32 = 40;
const TOP_H: u32 = 270;
const BOTTOM_H: u32 = 170;

fn distinct<T: PartialEq + Copy>(it: impl Iterator<Item = T>) -> Vec<T> {
    let mut v = Vec::new();
    for x in it {
        if !v.contains(&x) {
            v.push(x);
        }
    }
    v
}

impl<'a> Layout<'a> {
    fn new(rows: &'a [Row], bytes: u64) -> Layout<'a> {
        let sorted = |mut v: Vec<usize>| {
            v.sort_unstable();
            v
        };
        let writes = sorted(distinct(rows.iter().map(|r| r.point.write)));
        let reads = sorted(distinct(rows.iter().map(|r| r.point.read)));
        let x_is_write = writes.len() >= reads.len();
        let (xs, panels) = if x_is_write { (writes, reads) } else { (reads, writes) };
        let transports = distinct(rows.iter().map(|r| r.point.transport));
        let sndbufs = distinct(rows.iter().map(|r| r.point.sndbuf));
        let streams = distinct(rows.iter().map(|r| r.point.streams));
        let max_gibs = rows.iter().map(|r| r.median.gibs()).fold(0.0, f64::max);
        let title = format!(
            "ferry bench socket: throughput and short reads against {} size ({} per point, {} CPUs)",
            if x_is_write { "write()" } else { "read()" },
            fmt_size(bytes as usize),
            std::thread::available_parallelism().map_or(1, |n| n.get()),
        );
        // Wide enough for the panels and the legend, and for the title (about 9 pixels a
        // character at 17 points).
        let width = (PANEL_W * panels.len() as u32 + LEGEND_W).max(24 + 9 * title.len() as u32);
        let size = (width, TITLE_H + (TOP_H + BOTTOM_H) * transports.len().max(1) as u32);
        Layout { rows, transports, x_is_write, xs, panels, sndbufs, streams, max_gibs, title, size }
    }

    fn series(&self) -> Vec<SeriesKey> {
        let mut v = Vec::new();
        for &sndbuf in &self.sndbufs {
            for &streams in &self.streams {
                v.push(SeriesKey { sndbuf, streams });
            }
        }
        v
    }

    /// Colour of a series: by SO_SNDBUF, or by stream count when SO_SNDBUF is not swept.
    fn color(&self, k: SeriesKey) -> RGBColor {
        let i = if self.sndbufs.len() > 1 {
            self.sndbufs.iter().position(|&s| s == k.sndbuf)
        } else {
            self.streams.iter().position(|&s| s == k.streams)
        };
        color(i.unwrap_or(0))
    }

    fn style(&self, k: SeriesKey) -> usize {
        self.streams.iter().position(|&s| s == k.streams).unwrap_or(0)
    }

    /// (x, y) points of one series in one panel.
    fn points(&self, t: Transport, key: SeriesKey, panel: usize, y: fn(&Sample) -> f64) -> Vec<(f64, f64)> {
        let mut v: Vec<(f64, f64)> = self
            .rows
            .iter()
            .filter(|r| r.point.transport == t && r.point.sndbuf == key.sndbuf && r.point.streams == key.streams)
            .filter_map(|r| {
                let (x, other) =
                    if self.x_is_write { (r.point.write, r.point.read) } else { (r.point.read, r.point.write) };
                (other == panel).then(|| ((x as f64).log2(), y(&r.median)))
            })
            .collect();
        v.sort_by(|a, b| a.0.total_cmp(&b.0));
        v
    }
}

/// An x axis of log2(size) values with a tick at each measured size.
struct Log2Axis {
    lo: f64,
    hi: f64,
    keys: Vec<f64>,
}

impl Ranged for Log2Axis {
    type FormatOption = plotters::coord::ranged1d::DefaultFormatting;
    type ValueType = f64;

    fn map(&self, v: &f64, limit: (i32, i32)) -> i32 {
        let f = (v - self.lo) / (self.hi - self.lo);
        limit.0 + (f * f64::from(limit.1 - limit.0)).round() as i32
    }

    fn key_points<H: plotters::coord::ranged1d::KeyPointHint>(&self, hint: H) -> Vec<f64> {
        if hint.weight().allow_light_points() {
            Vec::new()
        } else {
            self.keys.clone()
        }
    }

    fn range(&self) -> std::ops::Range<f64> {
        self.lo..self.hi
    }
}

fn color(i: usize) -> RGBColor {
    const C: [RGBColor; 8] = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
        RGBColor(227, 119, 194),
        RGBColor(23, 190, 207),
    ];
    C[i % C.len()]
}

/// Draws one series: solid line and circles for the first stream count, dashed and
/// triangles for the second, dotted and squares after that.
fn draw_series<DB: DrawingBackend, CT: CoordTranslate<From = (f64, f64)>>(
    c: &mut ChartContext<'_, DB, CT>,
    pts: Vec<(f64, f64)>,
    col: RGBColor,
    style: usize,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let line = col.stroke_width(2);
    match style {
        0 => {
            c.draw_series(LineSeries::new(pts.clone(), line))?;
            c.draw_series(pts.iter().map(|&p| Circle::new(p, 3, col.filled())))?;
        }
        1 => {
            c.draw_series(DashedLineSeries::new(pts.clone(), 7, 4, line))?;
            c.draw_series(pts.iter().map(|&p| TriangleMarker::new(p, 4, col.filled())))?;
        }
        _ => {
            c.draw_series(DashedLineSeries::new(pts.clone(), 2, 3, line))?;
            c.draw_series(pts.iter().map(|&p| Rectangle::new([p, p], col.stroke_width(6))))?;
        }
    }
    Ok(())
}

fn draw<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, l: &Layout<'_>) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    let e = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(e)?;
    let (title, body) = root.split_vertically(TITLE_H);
    title.draw(&Text::new(l.title.clone(), (12, 12), ("sans-serif", 17).into_font().color(&BLACK))).map_err(e)?;
    let (grid, legend) = body.split_horizontally(PANEL_W * l.panels.len() as u32);
    let lo = (*l.xs.first().unwrap_or(&1) as f64).log2();
    let hi = (*l.xs.last().unwrap_or(&1) as f64).log2();
    let (lo, hi) = if hi - lo < 1.0 { (lo - 0.5, hi + 0.5) } else { (lo - 0.25, hi + 0.25) };
    let axis = || Log2Axis { lo, hi, keys: l.xs.iter().map(|&x| (x as f64).log2()).collect() };
    let xname = if l.x_is_write { "write() size" } else { "read() size" };
    let pname = if l.x_is_write { "read()" } else { "write()" };
    let ymax = if l.max_gibs > 0.0 { l.max_gibs * 1.12 } else { 1.0 };
    let fmt_x = |x: &f64| fmt_size(x.exp2().round() as usize);
    let grey = RGBColor(232, 232, 232);
    let series = l.series();

    let bands = grid.split_evenly((l.transports.len().max(1), 1));
    for (band, &t) in bands.iter().zip(&l.transports) {
        let (top, bottom) = band.split_vertically(TOP_H);
        let tops = top.split_evenly((1, l.panels.len()));
        let bottoms = bottom.split_evenly((1, l.panels.len()));
        for (i, &panel) in l.panels.iter().enumerate() {
            let mut c = ChartBuilder::on(&tops[i])
                .caption(format!("{} socket, {pname} {}", t.name(), fmt_size(panel)), ("sans-serif", 15))
                .margin(6)
                .margin_right(12)
                .x_label_area_size(20)
                .y_label_area_size(42)
                .build_cartesian_2d(axis(), 0.0..ymax)
                .map_err(e)?;
            c.configure_mesh()
                .x_label_formatter(&fmt_x)
                .y_desc("GiB/s")
                .y_label_formatter(&|y: &f64| format!("{y:.0}"))
                .label_style(("sans-serif", 12))
                .bold_line_style(grey)
                .light_line_style(TRANSPARENT)
                .draw()
                .map_err(e)?;
            for &k in &series {
                draw_series(&mut c, l.points(t, k, panel, Sample::gibs), l.color(k), l.style(k)).map_err(e)?;
            }

            let mut c = ChartBuilder::on(&bottoms[i])
                .margin(6)
                .margin_right(12)
                .x_label_area_size(34)
                .y_label_area_size(42)
                .build_cartesian_2d(axis(), 0.0..105.0)
                .map_err(e)?;
            c.configure_mesh()
                .x_label_formatter(&fmt_x)
                .x_desc(xname)
                .y_desc("short reads %")
                .y_labels(6)
                .y_label_formatter(&|y: &f64| format!("{y:.0}"))
                .label_style(("sans-serif", 12))
                .bold_line_style(grey)
                .light_line_style(TRANSPARENT)
                .draw()
                .map_err(e)?;
            for &k in &series {
                draw_series(&mut c, l.points(t, k, panel, Sample::short_pct), l.color(k), l.style(k)).map_err(e)?;
            }
        }
    }

    // The legend, beside the panels.
    let style = ("sans-serif", 13).into_font().color(&BLACK);
    let small = ("sans-serif", 12).into_font().color(&RGBColor(90, 90, 90));
    let mut y = 14;
    let mut entry = |text: String, col: RGBColor, st: usize| -> Result<(), String> {
        let line = col.stroke_width(2);
        let path = vec![(10, y), (40, y)];
        match st {
            0 => legend.draw(&PathElement::new(path, line)).map_err(e)?,
            1 => legend.draw(&plotters::element::DashedPathElement::new(path, 7, 4, line)).map_err(e)?,
            _ => legend.draw(&plotters::element::DashedPathElement::new(path, 2, 3, line)).map_err(e)?,
        }
        legend.draw(&Text::new(text, (48, y - 7), style.clone())).map_err(e)?;
        y += 20;
        Ok(())
    };
    if l.sndbufs.len() > 1 {
        for &s in &l.sndbufs {
            entry(format!("sndbuf {}", fmt_sndbuf(s)), l.color(SeriesKey { sndbuf: s, streams: l.streams[0] }), 0)?;
        }
        for (i, &n) in l.streams.iter().enumerate() {
            entry(format!("{n} stream{}", if n > 1 { "s" } else { "" }), RGBColor(60, 60, 60), i)?;
        }
    } else {
        for (i, &n) in l.streams.iter().enumerate() {
            let k = SeriesKey { sndbuf: l.sndbufs[0], streams: n };
            let sb = format!(", sndbuf {}", fmt_sndbuf(l.sndbufs[0]));
            entry(format!("{n} stream{}{sb}", if n > 1 { "s" } else { "" }), l.color(k), i)?;
        }
    }
    let notes = [
        "",
        "GiB/s: median run, wall time",
        "from first write() to last read()",
        "short reads: read() calls that",
        "returned less than asked",
        "sndbuf: SO_SNDBUF asked of the",
        "writer (default: left to kernel;",
        "Linux doubles it, caps at wmem_max)",
    ];
    for (i, n) in notes.iter().enumerate() {
        legend.draw(&Text::new(*n, (10, y - 6 + 16 * i as i32), small.clone())).map_err(e)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_lists() {
        assert_eq!(parse_list("4K, 1M,512", "x").unwrap(), vec![4096, 1 << 20, 512]);
        assert!(parse_list("4Q", "x").is_err());
        assert_eq!(parse_sndbufs("default,256K").unwrap(), vec![None, Some(256 << 10)]);
        assert!(parse_sndbufs("0").is_err());
        assert_eq!(fmt_size(1 << 20), "1M");
        assert_eq!(fmt_size(3 << 10), "3K");
        assert_eq!(fmt_size(1000), "1000");
    }

    #[test]
    fn one_small_measurement_counts_every_byte() {
        for t in [Transport::Unix, Transport::Tcp] {
            let p = Point { transport: t, sndbuf: Some(64 << 10), streams: 2, write: 10_000, read: 4096 };
            let s = measure(p, 1 << 20).unwrap();
            assert_eq!(s.bytes, 1 << 20);
            // Every read asks for at most 4096 bytes.
            assert!(s.reads >= (1 << 20) / 4096);
            assert!(s.writes >= 2 * (512 << 10) / 10_000);
            assert!(s.sndbuf_start >= 64 << 10, "kernel gave {}", s.sndbuf_start);
            assert!(s.gibs() > 0.0);
        }
    }
}
