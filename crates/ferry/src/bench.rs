//! `ferry bench`: load generators that measure this machine.
//!
//! `ferry bench nbd URI` keeps `--requests` requests in flight on each of `--connections`
//! connections for `--duration` seconds (random offsets aligned to `--block-size`,
//! `--read-percent` of them reads, the rest writes) and reports IOPS, throughput and
//! latency percentiles. It works against any NBD server, so peers are measured with the
//! same client.
//!
//! `ferry bench conns URI --idle N` runs that load alone and beside N idle connections
//! (see `bench_conns.rs`).

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use ferry_backend::parse_size;
use ferry_client::{ConnectOptions, Connection, Payload, Submit, Uri};
use ferry_proto::consts::{CMD_READ, CMD_WRITE, FLAG_CAN_MULTI_CONN, FLAG_READ_ONLY};
use serde_json::json;
use std::time::{Duration, Instant};

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(subcommand)]
    what: What,
}

#[derive(Subcommand, Debug)]
enum What {
    /// Parallel random I/O against an NBD export (like libnbd's aio-parallel-load).
    Nbd(NbdArgs),
    /// Raw socket throughput sweep: read/write sizes, SO_SNDBUF, parallel streams.
    Socket(crate::bench_socket::SocketArgs),
    /// A busy client alone, then beside N idle connections (`--idle N`), with the
    /// server's memory and threads (`--server-pid`).
    Conns(crate::bench_conns::ConnsArgs),
}

#[derive(Args, Debug)]
struct NbdArgs {
    /// NBD URI of the export to load.
    uri: String,
    /// Connections (more than one only if the server advertises multi-conn).
    #[arg(short = 'C', long, default_value_t = 1, value_name = "N")]
    connections: usize,
    /// Requests in flight per connection.
    #[arg(short = 'R', long, default_value_t = 64, value_name = "N")]
    requests: usize,
    /// Bytes per request.
    #[arg(long, default_value = "4K", value_name = "BYTES")]
    block_size: String,
    /// Percentage of requests that are reads (the rest are writes).
    #[arg(long, default_value_t = 100, value_name = "P")]
    read_percent: u32,
    /// Seconds to run.
    #[arg(long, default_value_t = 10.0, value_name = "SECS")]
    duration: f64,
    /// Only use the first BYTES of the export (default: all of it).
    #[arg(long, value_name = "BYTES")]
    span: Option<String>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

pub fn run(args: BenchArgs) -> Result<i32> {
    match args.what {
        What::Nbd(a) => nbd(a),
        What::Socket(a) => crate::bench_socket::run(a),
        What::Conns(a) => crate::bench_conns::run(a),
    }
}

struct Stats {
    reads: u64,
    writes: u64,
    /// Latencies in nanoseconds.
    lat: Vec<u32>,
}

/// One run of the load: where, how many connections and requests, what mix, how long.
pub struct LoadSpec {
    pub uri: Uri,
    pub connections: usize,
    pub requests: usize,
    pub bs: usize,
    pub read_percent: u32,
    pub duration: Duration,
    /// Only use the first BYTES of the export.
    pub span: Option<u64>,
}

/// What a run measured.
pub struct Report {
    /// Connections actually used (1 if the server does not allow multi-conn).
    pub connections: usize,
    pub secs: f64,
    pub reads: u64,
    pub writes: u64,
    pub bs: usize,
    /// Latencies in nanoseconds, sorted.
    lat: Vec<u32>,
    /// p50, p99 and p99.9 in microseconds when this report stands for several runs.
    fixed: Option<[f64; 3]>,
}

impl Report {
    pub fn iops(&self) -> f64 {
        (self.reads + self.writes) as f64 / self.secs
    }

    pub fn gib_per_s(&self) -> f64 {
        self.iops() * self.bs as f64 / (1u64 << 30) as f64
    }

    /// The run with the median IOPS, with each latency percentile replaced by the
    /// median of that percentile over the runs (so one noisy run moves neither).
    pub fn median(mut runs: Vec<Report>) -> Report {
        let mid = runs.len() / 2;
        let pcts: Vec<[f64; 3]> = runs.iter().map(|r| [r.pct(50.0), r.pct(99.0), r.pct(99.9)]).collect();
        let med = |i: usize| {
            let mut v: Vec<f64> = pcts.iter().map(|p| p[i]).collect();
            v.sort_by(f64::total_cmp);
            v[mid]
        };
        let fixed = [med(0), med(1), med(2)];
        runs.sort_by(|a, b| a.iops().total_cmp(&b.iops()));
        let mut r = runs.swap_remove(mid);
        r.fixed = Some(fixed);
        r
    }

    /// The `p`th percentile latency in microseconds.
    pub fn pct(&self, p: f64) -> f64 {
        if let Some(f) = self.fixed {
            if let Some(i) = [50.0, 99.0, 99.9].iter().position(|&q| q == p) {
                return f[i];
            }
        }
        if self.lat.is_empty() {
            return 0.0;
        }
        let i = ((self.lat.len() as f64 * p / 100.0).ceil() as usize).clamp(1, self.lat.len()) - 1;
        self.lat[i] as f64 / 1000.0
    }
}

fn nbd(a: NbdArgs) -> Result<i32> {
    let uri = Uri::parse(&a.uri)?;
    let bs = parse_size(&a.block_size).context("--block-size")? as usize;
    if a.duration.is_nan() || a.duration <= 0.0 {
        bail!("--connections, --requests and --duration must be positive");
    }
    let span = a.span.as_deref().map(parse_size).transpose()?;
    let spec = LoadSpec {
        uri: uri.clone(),
        connections: a.connections,
        requests: a.requests,
        bs,
        read_percent: a.read_percent,
        duration: Duration::from_secs_f64(a.duration),
        span,
    };
    let r = run_load(&spec)?;
    let (conns, secs, reads, writes) = (r.connections, r.secs, r.reads, r.writes);
    let (iops, gibs) = (r.iops(), r.gib_per_s());
    if a.json {
        let v = json!({
            "uri": uri.to_string(), "connections": conns, "requests": a.requests, "block_size": bs,
            "read_percent": a.read_percent, "seconds": secs, "reads": reads, "writes": writes,
            "iops": iops, "gib_per_s": gibs,
            "latency_us": {"p50": r.pct(50.0), "p99": r.pct(99.0), "p99.9": r.pct(99.9)},
        });
        println!("{v}");
    } else {
        println!(
            "{conns} connection(s) x {} in flight, {bs}-byte requests, {}% reads, {secs:.2} s",
            a.requests, a.read_percent
        );
        println!("IOPS: {iops:.0}  ({reads} reads, {writes} writes)");
        println!("throughput: {gibs:.3} GiB/s");
        println!("latency us: p50 {:.1}  p99 {:.1}  p99.9 {:.1}", r.pct(50.0), r.pct(99.0), r.pct(99.9));
    }
    Ok(0)
}

/// Connects and runs the load of `spec`.
pub fn run_load(spec: &LoadSpec) -> Result<Report> {
    let (uri, bs) = (&spec.uri, spec.bs);
    if bs == 0 || bs > 32 << 20 {
        bail!("--block-size must be between 1 byte and 32M");
    }
    if spec.read_percent > 100 {
        bail!("--read-percent must be 0 to 100");
    }
    if spec.requests == 0 || spec.connections == 0 || spec.duration.is_zero() {
        bail!("--connections, --requests and --duration must be positive");
    }
    let opts = ConnectOptions::default();
    let first = Connection::connect(uri, &opts).with_context(|| format!("connecting to {uri}"))?;
    if spec.read_percent < 100 && first.has_flag(FLAG_READ_ONLY) {
        bail!("{uri} is read-only: use --read-percent 100");
    }
    let mut conns = spec.connections;
    if conns > 1 && !first.has_flag(FLAG_CAN_MULTI_CONN) {
        eprintln!("ferry bench: the server does not allow multi-conn; using 1 connection");
        conns = 1;
    }
    let span = match spec.span {
        Some(s) => s.min(first.size()),
        None => first.size(),
    };
    let blocks = span / bs as u64;
    if blocks == 0 {
        bail!("the export ({span} bytes) is smaller than one block");
    }
    let mut all = vec![first];
    for _ in 1..conns {
        all.push(Connection::connect(uri, &opts)?);
    }
    let (q, pct, duration) = (spec.requests, spec.read_percent, spec.duration);
    let start = Instant::now();
    let results: Vec<Result<Stats>> = std::thread::scope(|s| {
        let handles: Vec<_> = all
            .into_iter()
            .enumerate()
            .map(|(i, c)| s.spawn(move || load(c, i as u64, bs, blocks, q, pct, duration)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("worker panicked")))).collect()
    });
    let secs = start.elapsed().as_secs_f64();
    let mut lat = Vec::new();
    let (mut reads, mut writes) = (0, 0);
    for r in results {
        let st = r?;
        reads += st.reads;
        writes += st.writes;
        lat.extend(st.lat);
    }
    lat.sort_unstable();
    Ok(Report { connections: conns, secs, reads, writes, bs, lat, fixed: None })
}

/// One connection's load loop: keep `q` requests in flight until `duration` is over.
fn load(
    mut c: Connection,
    seed: u64,
    bs: usize,
    blocks: u64,
    q: usize,
    read_pct: u32,
    duration: Duration,
) -> Result<Stats> {
    let mut rng = 0x9E37_79B9_7F4A_7C15u64 ^ (seed + 1).wrapping_mul(0xD6E8_FEB8_6659_FD93);
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut bufs: Vec<Vec<u8>> = (0..q).map(|_| vec![0u8; bs]).collect();
    let payload: Vec<u8> = (0..bs).map(|i| (i * 31 % 251) as u8 + 1).collect();
    let mut started = vec![Instant::now(); q];
    let mut st = Stats { reads: 0, writes: 0, lat: Vec::with_capacity(1 << 20) };
    let end = Instant::now() + duration;
    let mut free: Vec<usize> = (0..q).collect();
    let mut subs: Vec<Submit<'_>> = Vec::with_capacity(q);
    loop {
        let now = Instant::now();
        if now < end && !free.is_empty() {
            subs.clear();
            for &slot in &free {
                let offset = next() % blocks * bs as u64;
                let read = (next() % 100) < u64::from(read_pct);
                let (cmd, payload) =
                    if read { (CMD_READ, None) } else { (CMD_WRITE, Some(Payload::Bytes(&payload[..]))) };
                subs.push(Submit { cmd, flags: 0, offset, length: bs as u64, payload, slot });
                started[slot] = now;
            }
            free.clear();
            c.submit(&subs)?;
        }
        if c.in_flight() == 0 {
            break;
        }
        // Take every reply that is already here, then refill the window in one send.
        loop {
            let done = c.receive(&mut bufs)?;
            if let Err(e) = done.result {
                bail!("{} at offset {} failed: {e}", if done.cmd == CMD_READ { "read" } else { "write" }, done.offset);
            }
            st.lat.push(started[done.slot].elapsed().as_nanos().min(u128::from(u32::MAX)) as u32);
            if done.cmd == CMD_READ {
                st.reads += 1;
            } else {
                st.writes += 1;
            }
            free.push(done.slot);
            if c.in_flight() == 0 || !c.buffered() {
                break;
            }
        }
    }
    let _ = c.disconnect();
    Ok(st)
}
