//! `ferry bench`: load generators that measure this machine.
//!
//! `ferry bench nbd URI` keeps `--requests` requests in flight on each of `--connections`
//! connections for `--duration` seconds (random offsets aligned to `--block-size`,
//! `--read-percent` of them reads, the rest writes) and reports IOPS, throughput and
//! latency percentiles. It works against any NBD server, so peers are measured with the
//! same client.

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
    }
}

struct Stats {
    reads: u64,
    writes: u64,
    /// Latencies in nanoseconds.
    lat: Vec<u32>,
}

fn nbd(a: NbdArgs) -> Result<i32> {
    let uri = Uri::parse(&a.uri)?;
    let bs = parse_size(&a.block_size).context("--block-size")? as usize;
    if bs == 0 || bs > 32 << 20 {
        bail!("--block-size must be between 1 byte and 32M");
    }
    if a.read_percent > 100 {
        bail!("--read-percent must be 0 to 100");
    }
    if a.requests == 0 || a.connections == 0 || a.duration.is_nan() || a.duration <= 0.0 {
        bail!("--connections, --requests and --duration must be positive");
    }
    let opts = ConnectOptions::default();
    let first = Connection::connect(&uri, &opts).with_context(|| format!("connecting to {uri}"))?;
    if a.read_percent < 100 && first.has_flag(FLAG_READ_ONLY) {
        bail!("{uri} is read-only: use --read-percent 100");
    }
    let mut conns = a.connections;
    if conns > 1 && !first.has_flag(FLAG_CAN_MULTI_CONN) {
        eprintln!("ferry bench: the server does not allow multi-conn; using 1 connection");
        conns = 1;
    }
    let span = match &a.span {
        Some(s) => parse_size(s)?.min(first.size()),
        None => first.size(),
    };
    let blocks = span / bs as u64;
    if blocks == 0 {
        bail!("the export ({span} bytes) is smaller than one block");
    }
    let mut all = vec![first];
    for _ in 1..conns {
        all.push(Connection::connect(&uri, &opts)?);
    }
    let duration = Duration::from_secs_f64(a.duration);
    let start = Instant::now();
    let results: Vec<Result<Stats>> = std::thread::scope(|s| {
        let handles: Vec<_> = all
            .into_iter()
            .enumerate()
            .map(|(i, c)| s.spawn(move || load(c, i as u64, bs, blocks, a.requests, a.read_percent, duration)))
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
    let pct = |p: f64| -> f64 {
        if lat.is_empty() {
            return 0.0;
        }
        let i = ((lat.len() as f64 * p / 100.0).ceil() as usize).clamp(1, lat.len()) - 1;
        lat[i] as f64 / 1000.0
    };
    let ops = reads + writes;
    let iops = ops as f64 / secs;
    let gibs = ops as f64 * bs as f64 / secs / (1u64 << 30) as f64;
    if a.json {
        let v = json!({
            "uri": uri.to_string(), "connections": conns, "requests": a.requests, "block_size": bs,
            "read_percent": a.read_percent, "seconds": secs, "reads": reads, "writes": writes,
            "iops": iops, "gib_per_s": gibs,
            "latency_us": {"p50": pct(50.0), "p99": pct(99.0), "p99.9": pct(99.9)},
        });
        println!("{v}");
    } else {
        println!(
            "{conns} connection(s) x {} in flight, {bs}-byte requests, {}% reads, {secs:.2} s",
            a.requests, a.read_percent
        );
        println!("IOPS: {iops:.0}  ({reads} reads, {writes} writes)");
        println!("throughput: {gibs:.3} GiB/s");
        println!("latency us: p50 {:.1}  p99 {:.1}  p99.9 {:.1}", pct(50.0), pct(99.0), pct(99.9));
    }
    Ok(0)
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
