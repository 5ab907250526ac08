//! `ferry bench conns URI --idle N`: a busy client beside many idle connections.
//!
//! Runs the `bench nbd` load alone, then opens N connections that finish the handshake
//! and stay silent (plain sockets and the handshake state machine of `ferry-proto`:
//! no thread and a few bytes each, so the bench itself holds 10,000 of them cheaply),
//! runs the same load beside them, and reports both with their ratio. With
//! `--server-pid` it also reads the server's resident memory and threads from
//! /proc: before, with the idle connections open, and after the load.

use crate::bench::{run_load, LoadSpec, Report};
use anyhow::{bail, Context, Result};
use clap::Args;
use ferry_backend::parse_size;
use ferry_client::{Transport, Uri};
use ferry_proto::client::{ClientConfig, ClientHandshake, ClientProgress};
use ferry_sock::Stream;
use rustix::event::{poll, PollFd, PollFlags};
use serde_json::json;
use std::io::{IoSlice, Read};
use std::net::{SocketAddr, ToSocketAddrs};
use std::time::{Duration, Instant};

#[derive(Args, Debug)]
pub struct ConnsArgs {
    /// NBD URI of the export (plaintext: nbd:// or nbd+unix://).
    uri: String,
    /// Idle connections to open beside the busy ones.
    #[arg(long, value_name = "N")]
    idle: usize,
    /// Seconds of busy load, alone and then beside the idle connections.
    #[arg(long, default_value_t = 10.0, value_name = "SECS")]
    busy_seconds: f64,
    /// Busy connections.
    #[arg(short = 'C', long, default_value_t = 2, value_name = "N")]
    connections: usize,
    /// Requests in flight per busy connection.
    #[arg(short = 'R', long, default_value_t = 32, value_name = "N")]
    requests: usize,
    /// Bytes per request (random reads).
    #[arg(long, default_value = "4K", value_name = "BYTES")]
    block_size: String,
    /// The server's process id: report its resident memory (VmRSS) and threads.
    #[arg(long, value_name = "PID")]
    server_pid: Option<u32>,
    /// Rounds of (alone, open the idle connections, beside them, close them); the
    /// medians are reported, so a noisy machine shows less in the ratio.
    #[arg(long, default_value_t = 3, value_name = "N")]
    rounds: usize,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

/// A process's resident memory (KiB) and thread count, from /proc/PID/status.
fn proc_status(pid: u32) -> Result<(u64, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("reading /proc/{pid}/status (is --server-pid right?)"))?;
    let field = |name: &str| -> Option<u64> {
        let line = text.lines().find(|l| l.starts_with(name))?;
        line[name.len()..].split_whitespace().next()?.parse().ok()
    };
    match (field("VmRSS:"), field("Threads:")) {
        (Some(rss), Some(threads)) => Ok((rss, threads)),
        _ => bail!("/proc/{pid}/status has no VmRSS or Threads line"),
    }
}

/// A process's CPU time (user + system) in seconds, from /proc/PID/stat.
fn proc_cpu(pid: u32) -> Result<f64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command (which may hold spaces) start after the last ')'.
    let rest = text.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the ')'.
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).context("malformed /proc/PID/stat");
    Ok((ticks(11)? + ticks(12)?) / 100.0)
}

/// Opens one connection and runs the handshake to the transmission phase.
fn open_idle(uri: &Uri, tcp: Option<&SocketAddr>, buf: &mut Vec<u8>) -> Result<Stream> {
    let mut s = match (&uri.transport, tcp) {
        (Transport::Unix { path }, _) => Stream::connect_unix(path)?,
        (Transport::Tcp { .. }, Some(a)) => Stream::connect_tcp(a)?,
        (Transport::Tcp { host, .. }, None) => bail!("{host}: no address"),
    };
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut hs = ClientHandshake::new(ClientConfig::new(&uri.export));
    let mut out = Vec::new();
    let (mut head, mut tail) = (0, 0);
    buf.resize(64 * 1024, 0);
    loop {
        loop {
            let (n, p) = hs.feed(&buf[head..tail], &mut out)?;
            head += n;
            if !out.is_empty() {
                s.send_all(&mut [IoSlice::new(&out)])?;
                out.clear();
            }
            match p {
                ClientProgress::Connected(_) => return Ok(s),
                ClientProgress::Continue if n > 0 => {}
                ClientProgress::Continue => break,
                other => bail!("unexpected handshake result {other:?}"),
            }
        }
        buf.copy_within(head..tail, 0);
        tail -= head;
        head = 0;
        match s.read(&mut buf[tail..])? {
            0 => bail!("the server closed the connection during the handshake"),
            n => tail += n,
        }
    }
}

/// Idle connections the server has closed (readable: EOF) or that report an error.
fn closed_count(idle: &[Stream]) -> Result<usize> {
    let mut closed = 0;
    for chunk in idle.chunks(1024) {
        let mut fds: Vec<PollFd> = chunk.iter().map(|s| PollFd::new(s, PollFlags::IN)).collect();
        poll(&mut fds, Some(&rustix::event::Timespec { tv_sec: 0, tv_nsec: 0 }))?;
        closed += fds.iter().filter(|f| !f.revents().is_empty()).count();
    }
    Ok(closed)
}

fn line(name: &str, r: &Report) -> String {
    format!(
        "{name:<22} {:>9.0} {:>8.3} {:>9.1} {:>9.1} {:>9.1}",
        r.iops(),
        r.gib_per_s(),
        r.pct(50.0),
        r.pct(99.0),
        r.pct(99.9)
    )
}

pub fn run(a: ConnsArgs) -> Result<i32> {
    let uri = Uri::parse(&a.uri)?;
    if uri.tls.is_some() {
        bail!("bench conns opens its idle connections in plaintext: use an nbd:// or nbd+unix:// URI");
    }
    let bs = parse_size(&a.block_size).context("--block-size")? as usize;
    if a.busy_seconds.is_nan() || a.busy_seconds <= 0.0 {
        bail!("--busy-seconds must be positive");
    }
    let nofile = ferry_server::raise_fd_limit();
    if a.idle as u64 + 64 > nofile {
        bail!(
            "{} idle connections need as many file descriptors, but RLIMIT_NOFILE is {nofile} even after \
             raising it to its hard limit: raise the hard limit (ulimit -Hn) or ask for fewer",
            a.idle
        );
    }
    let spec = LoadSpec {
        uri: uri.clone(),
        connections: a.connections,
        requests: a.requests,
        bs,
        read_percent: 100,
        duration: Duration::from_secs_f64(a.busy_seconds),
        span: None,
    };
    let status = |when: &str| -> Result<Option<(u64, u64)>> {
        let Some(pid) = a.server_pid else { return Ok(None) };
        let st = proc_status(pid)?;
        if !a.json {
            println!("server {when}: RSS {:.1} MiB, {} threads", st.0 as f64 / 1024.0, st.1);
        }
        Ok(Some(st))
    };
    if a.rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    let tcp = match &uri.transport {
        Transport::Tcp { host, port } => (host.as_str(), *port).to_socket_addrs()?.next(),
        Transport::Unix { .. } => None,
    };
    let before = status("before")?;
    let (mut alone, mut beside) = (Vec::new(), Vec::new());
    // Server CPU microseconds per request of each run (with --server-pid): unlike
    // throughput, it hardly moves when other processes take the CPU away.
    // The bench's own CPU per request too: if the idle connections slowed the client
    // down, it would show there.
    let (mut cpu_alone, mut cpu_beside) = (Vec::new(), Vec::new());
    let (mut own_alone, mut own_beside) = (Vec::new(), Vec::new());
    let me = std::process::id();
    let measure = |cpu: &mut Vec<f64>, own: &mut Vec<f64>| -> Result<Report> {
        let c0 = a.server_pid.map(proc_cpu).transpose()?;
        let o0 = proc_cpu(me)?;
        let r = run_load(&spec)?;
        let n = (r.reads + r.writes).max(1) as f64;
        own.push((proc_cpu(me)? - o0) * 1e6 / n);
        if let (Some(c0), Some(pid)) = (c0, a.server_pid) {
            cpu.push((proc_cpu(pid)? - c0) * 1e6 / n);
        }
        Ok(r)
    };
    let (mut with_idle, mut after, mut closed, mut open_secs) = (None, None, 0, 0.0);
    for round in 1..=a.rounds {
        // Odd rounds run alone first, even rounds last (A B, B A, ...): a machine whose
        // load drifts during a round then favours neither side.
        let alone_first = round % 2 == 1;
        if alone_first {
            alone.push(measure(&mut cpu_alone, &mut own_alone)?);
        }
        let t0 = Instant::now();
        let mut idle = Vec::with_capacity(a.idle);
        let mut buf = Vec::new();
        for i in 0..a.idle {
            let s = open_idle(&uri, tcp.as_ref(), &mut buf)
                .with_context(|| format!("opening idle connection {} of {}", i + 1, a.idle))?;
            idle.push(s);
        }
        open_secs = t0.elapsed().as_secs_f64();
        if !a.json {
            println!("round {round}: opened {} idle connections (handshake finished) in {open_secs:.2} s", a.idle);
        }
        // Let the server notice they are idle (its grace period is 250 ms).
        std::thread::sleep(Duration::from_secs(1));
        with_idle = status("with the idle connections")?;
        beside.push(measure(&mut cpu_beside, &mut own_beside)?);
        after = status("after the busy load beside them")?;
        closed += closed_count(&idle)?;
        drop(idle);
        // Let the server close them before the next run alone.
        std::thread::sleep(Duration::from_secs(1));
        if !alone_first {
            alone.push(measure(&mut cpu_alone, &mut own_alone)?);
        }
    }
    // Paired ratios: each round's run beside the idle connections over its run alone,
    // so drift in the machine's load cancels out round by round.
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let iops_rounds: Vec<(f64, f64)> = alone.iter().zip(&beside).map(|(a, b)| (a.iops(), b.iops())).collect();
    let iops_ratio = median(iops_rounds.iter().map(|(a, b)| b / a).collect());
    let p99_ratio = median(alone.iter().zip(&beside).map(|(a, b)| b.pct(99.0) / a.pct(99.0)).collect());
    let cpu = (!cpu_alone.is_empty()).then(|| {
        let ratio = median(cpu_alone.iter().zip(&cpu_beside).map(|(a, b)| b / a).collect());
        (median(cpu_alone.clone()), median(cpu_beside.clone()), ratio)
    });
    let own_ratio = median(own_alone.iter().zip(&own_beside).map(|(a, b)| b / a).collect());
    let own = (median(own_alone), median(own_beside), own_ratio);
    let alone = Some(Report::median(alone));
    let beside = Report::median(beside);
    if a.json {
        let rep = |r: &Report| {
            json!({"iops": r.iops(), "gib_per_s": r.gib_per_s(),
                   "latency_us": {"p50": r.pct(50.0), "p99": r.pct(99.0), "p99.9": r.pct(99.9)}})
        };
        let st = |s: Option<(u64, u64)>| s.map(|(rss, th)| json!({"rss_kib": rss, "threads": th}));
        println!(
            "{}",
            json!({
                "uri": uri.to_string(), "idle": a.idle, "idle_closed_by_server": closed,
                "open_seconds": open_secs, "connections": a.connections, "requests": a.requests,
                "block_size": bs, "alone": alone.as_ref().map(rep), "beside_idle": rep(&beside),
                "rounds": a.rounds, "iops_rounds": iops_rounds,
                "paired_ratio": {"iops": iops_ratio, "p99": p99_ratio},
                "server_cpu_us_per_request": cpu.map(|(a, b, r)| json!({"alone": a, "beside": b, "paired_ratio": r})),
                "client_cpu_us_per_request": json!({"alone": own.0, "beside": own.1, "paired_ratio": own.2}),
                "server": {"before": st(before), "with_idle": st(with_idle), "after": st(after)},
            })
        );
    } else {
        println!(
            "busy load: {} connection(s) x {} in flight, {bs}-byte random reads, {} s each; medians of {} rounds",
            a.connections, a.requests, a.busy_seconds, a.rounds
        );
        println!("{:<22} {:>9} {:>8} {:>9} {:>9} {:>9}", "", "IOPS", "GiB/s", "p50 us", "p99 us", "p99.9 us");
        if let Some(r) = &alone {
            println!("{}", line("alone", r));
        }
        println!("{}", line(&format!("beside {} idle", a.idle), &beside));
        let per_round: Vec<String> =
            iops_rounds.iter().map(|(a, b)| format!("{:.0}k/{:.0}k", a / 1e3, b / 1e3)).collect();
        println!("IOPS alone/beside per round: {}", per_round.join(" "));
        println!("median of the rounds' ratios beside/alone: IOPS {iops_ratio:.3}, p99 {p99_ratio:.3}");
        if let Some((ca, cb, r)) = cpu {
            println!("server CPU per request: alone {ca:.2} us, beside {cb:.2} us, paired ratio {r:.3}");
        }
        println!("bench CPU per request: alone {:.2} us, beside {:.2} us, paired ratio {:.3}", own.0, own.1, own.2);
        println!("idle connections closed by the server meanwhile: {closed} of {} x {} rounds", a.idle, a.rounds);
    }
    Ok(0)
}
