//! `ferry info URI`: what an export is and what it can do.
//!
//! `--json` uses the field names nbdinfo uses, so scripts can read either tool's output:
//! `protocol`, `TLS`, `structured`, `extended_headers`, and per export `export-name`,
//! `description`, `uri`, `contexts`, `is_rotational`, `is_read_only`, `can_cache`,
//! `can_df`, `can_fast_zero`, `can_flush`, `can_fua`, `can_multi_conn`, `can_trim`,
//! `can_zero`, `block_size_minimum`, `block_size_preferred`, `block_size_maximum`,
//! `export-size`.
//!
//! `--map[=CONTEXT]` prints a metadata context's map (`--map` alone: `base:allocation`;
//! `qemu:dirty-bitmap:NAME`, `qemu:allocation-depth`, any name the export offers), of an
//! NBD export or of a local image (whose contexts are what `ferry serve` would offer).
//! With one context the output is nbdinfo's, byte for byte: a line per extent of
//! `offset length type description` (widths 10, 10 and 3, two spaces apart; the
//! description only for values nbdinfo names), or with `--json` nbdinfo's array of
//! `{ "offset", "length", "type", "description" }` objects, one per line.
//!
//! `--map` given several times reads the contexts side by side, in lock step: a row per
//! range over which no context changes, rows alike merged. Text: `offset length`, then
//! for each context in the order given two spaces, its type (width 3), two spaces and
//! its description (padded to the widest the context has: 9 for base:allocation, 5 for
//! a dirty bitmap, 16 for allocation depth; the last column unpadded). JSON: an
//! array of `{ "offset", "length", "contexts": [{ "name", "type", "description" }, ...] }`.

use anyhow::{Context, Result};
use clap::Args;
use ferry_client::copy::contexts::ContextReader;
use ferry_client::{ConnectOptions, Connection, Uri};
use ferry_proto::consts::*;
use ferry_proto::ReplyMode;
use serde_json::{json, Value};

#[derive(Args, Debug)]
pub struct InfoArgs {
    /// NBD URI (nbd://HOST[:PORT]/EXPORT or nbd+unix:///EXPORT?socket=PATH), a local disk
    /// image (qcow2 or raw; qcow2:PATH, raw:PATH), or an RBD image: rbd:POOL/IMAGE[@SNAP]
    /// (size, object size, features, snapshots), or a snapshot in a backup repository:
    /// REPO::NAME[@ID].
    uri: String,
    /// Machine-readable output (nbdinfo's field names).
    #[arg(long)]
    json: bool,
    /// qemu-img's spelling: `--output=json` is --json, `--output=human` the default.
    #[arg(long, value_enum, value_name = "FMT")]
    output: Option<OutputFormat>,
    /// Format of a local image, as qemu-img info's -f: the same as writing raw:PATH or
    /// qcow2:PATH. Without it, an image starting with the qcow2 magic is qcow2.
    #[arg(short = 'f', long, value_name = "FORMAT", value_parser = crate::completions::format_values(), ignore_case = true)]
    format: Option<ferry_open::Format>,
    /// Describe every export of the server.
    #[arg(short = 'L', long)]
    list: bool,
    /// Print the map of a metadata context: base:allocation (the default),
    /// qemu:dirty-bitmap:NAME, qemu:allocation-depth. Repeat it to see several side by side.
    #[arg(long, value_name = "CONTEXT", num_args = 0..=1, require_equals = true, default_missing_value = META_BASE_ALLOCATION)]
    map: Vec<String>,
    /// Print only the size in bytes.
    #[arg(long)]
    size: bool,
    /// Print nothing; exit 0 if the export can do this, 2 if it cannot, 1 on an error
    /// (nbdinfo's --can; `connect` is 2 when the server cannot be reached).
    #[arg(long, value_enum, value_name = "WHAT", conflicts_with_all = ["is", "size", "map", "list"])]
    can: Option<Can>,
    /// Print nothing; exit 0 if the export is read-only / rotational, or the connection
    /// uses TLS, 2 if not, 1 on an error (nbdinfo's --is).
    #[arg(long, value_enum, value_name = "WHAT", conflicts_with_all = ["size", "map", "list"])]
    is: Option<Is>,
    /// Open a local image even while another program (qemu, ferry serve) writes it, as
    /// qemu-img info's -U does; what is shown may be stale.
    #[arg(short = 'U', long)]
    force_share: bool,
    #[command(flatten)]
    remote: crate::remote_args::RemoteArgs,
}

/// `--output`'s values, as qemu-img spells them.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputFormat {
    Human,
    Json,
}

/// What `--can` asks, with nbdinfo's names.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Can {
    Cache,
    Connect,
    Df,
    FastZero,
    Flush,
    Fua,
    MultiConn,
    Read,
    StructuredReply,
    Trim,
    Write,
    Zero,
}

/// What `--is` asks, with nbdinfo's names.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Is {
    ReadOnly,
    Rotational,
    Tls,
}

/// `--can` / `--is`: the answer as an exit status, 0 (yes) or 2 (no).
fn test_flag(uri: &Uri, opts: &ConnectOptions, can: Option<Can>, is: Option<Is>) -> Result<i32> {
    let c = match Connection::connect(uri, opts) {
        Ok(c) => c,
        Err(e) if can == Some(Can::Connect) => {
            log::info!("cannot connect to {uri}: {e}");
            return Ok(2);
        }
        Err(e) => return Err(e).with_context(|| format!("connecting to {uri}")),
    };
    let f = |bit| c.has_flag(bit);
    let yes = match (can, is) {
        (Some(can), _) => match can {
            Can::Cache => f(FLAG_SEND_CACHE),
            Can::Connect | Can::Read => true,
            Can::Df => f(FLAG_SEND_DF),
            Can::FastZero => f(FLAG_SEND_FAST_ZERO),
            Can::Flush => f(FLAG_SEND_FLUSH),
            Can::Fua => f(FLAG_SEND_FUA),
            Can::MultiConn => f(FLAG_CAN_MULTI_CONN),
            Can::StructuredReply => c.mode() != ReplyMode::Simple,
            Can::Trim => f(FLAG_SEND_TRIM),
            Can::Write => !f(FLAG_READ_ONLY),
            Can::Zero => f(FLAG_SEND_WRITE_ZEROES),
        },
        (None, Some(Is::ReadOnly)) => f(FLAG_READ_ONLY),
        (None, Some(Is::Rotational)) => f(FLAG_ROTATIONAL),
        (None, Some(Is::Tls)) => c.stream().tls_description().is_some(),
        (None, None) => anyhow::bail!("neither --can nor --is was given"),
    };
    let _ = c.disconnect();
    Ok(if yes { 0 } else { 2 })
}

pub fn run(mut args: InfoArgs) -> Result<i32> {
    if let Some(f) = args.format {
        args.uri = crate::serve::with_format(&args.uri, f).context("--format")?;
    }
    if args.output == Some(OutputFormat::Json) {
        args.json = true;
    }
    let loc = ferry_open::Location::parse(&args.uri)?;
    if args.can.is_some() || args.is.is_some() {
        let ferry_open::Location::Nbd(uri) = loc else {
            anyhow::bail!(
                "--can and --is ask an NBD server: serve the image (ferry serve {}) and ask the export",
                args.uri
            );
        };
        return test_flag(&uri, &ConnectOptions::default(), args.can, args.is);
    }
    if args.map.is_empty() && !args.size {
        if let Some(code) = ferry_open::rbd_info(&loc, args.json)? {
            return Ok(code);
        }
    }
    let uri = match loc {
        ferry_open::Location::Nbd(u) => u,
        loc => return local(&args, &loc),
    };
    let opts = ConnectOptions::default();
    if args.size {
        let c = Connection::connect(&uri, &opts)?;
        println!("{}", c.size());
        let _ = c.disconnect();
        return Ok(0);
    }
    if !args.map.is_empty() {
        let reader = ContextReader::nbd(&uri, &opts, &args.map)?;
        return map(reader, &args.map, args.json);
    }
    let names: Vec<(String, String)> = if args.list {
        Connection::list(&uri, &opts).with_context(|| format!("listing exports of {uri}"))?
    } else {
        vec![(uri.export.clone(), String::new())]
    };
    let mut exports = Vec::new();
    let mut mode = None;
    let mut tls = None;
    for (name, _) in &names {
        let u = Uri { export: name.clone(), ..uri.clone() };
        let c = Connection::connect(&u, &opts).with_context(|| format!("connecting to {u}"))?;
        mode = Some(c.mode());
        tls = c.stream().tls_description();
        let mut e = describe(&c, &u);
        let meta = c.can_block_status();
        let _ = c.disconnect();
        // Every context the export offers (dirty bitmaps, allocation depth), as nbdinfo
        // lists them; asked after disconnecting, for servers that take one client at a time.
        if meta {
            if let Ok(l) = Connection::list_contexts(&u, &opts) {
                if !l.is_empty() {
                    e["contexts"] = json!(l);
                }
            }
        }
        exports.push(e);
    }
    let mode = mode.unwrap_or(ReplyMode::Simple);
    let doc = json!({
        "protocol": "newstyle-fixed",
        "TLS": tls.is_some(),
        "structured": mode != ReplyMode::Simple,
        "extended_headers": mode == ReplyMode::Extended,
        "exports": exports,
    });
    if args.json {
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        print_text(&doc);
    }
    Ok(0)
}

fn describe(c: &Connection, uri: &Uri) -> Value {
    let i = c.info();
    let f = |bit| c.has_flag(bit);
    let mut e = json!({
        "export-name": uri.export,
        "uri": uri.to_string(),
        "contexts": if c.can_block_status() { vec![META_BASE_ALLOCATION] } else { vec![] },
        "is_rotational": f(FLAG_ROTATIONAL),
        "is_read_only": f(FLAG_READ_ONLY),
        "can_cache": f(FLAG_SEND_CACHE),
        "can_df": f(FLAG_SEND_DF),
        "can_fast_zero": f(FLAG_SEND_FAST_ZERO),
        "can_flush": f(FLAG_SEND_FLUSH),
        "can_fua": f(FLAG_SEND_FUA),
        "can_multi_conn": f(FLAG_CAN_MULTI_CONN),
        "can_trim": f(FLAG_SEND_TRIM),
        "can_zero": f(FLAG_SEND_WRITE_ZEROES),
        "export-size": i.size,
    });
    if let Some(d) = i.description.as_ref().filter(|d| !d.is_empty()) {
        e["description"] = json!(d);
    }
    if let Some(b) = i.block_size {
        e["block_size_minimum"] = json!(b.minimum);
        e["block_size_preferred"] = json!(b.preferred);
        e["block_size_maximum"] = json!(b.maximum);
    }
    e
}

fn print_text(doc: &Value) {
    let features = match (doc["structured"].as_bool(), doc["extended_headers"].as_bool()) {
        (_, Some(true)) => "extended headers",
        (Some(true), _) => "structured replies",
        _ => "simple replies",
    };
    let tls = if doc["TLS"].as_bool() == Some(true) { "with" } else { "without" };
    println!("protocol: newstyle-fixed {tls} TLS, using {features}");
    for e in doc["exports"].as_array().into_iter().flatten() {
        println!("export={:?}:", e["export-name"].as_str().unwrap_or(""));
        if let Some(d) = e.get("description").and_then(Value::as_str) {
            // The server's words: shown, never obeyed by the terminal.
            println!("\tdescription: {}", ferry_proto::client::printable(d.as_bytes()));
        }
        println!("\texport-size: {}", e["export-size"]);
        println!("\turi: {}", e["uri"].as_str().unwrap_or(""));
        println!("\tcontexts:");
        for c in e["contexts"].as_array().into_iter().flatten() {
            println!("\t\t{}", c.as_str().unwrap_or(""));
        }
        for (k, v) in e.as_object().into_iter().flatten() {
            if k.starts_with("is_") || k.starts_with("can_") || k.starts_with("block_size") {
                println!("\t{k}: {v}");
            }
        }
    }
}

/// nbdinfo's words for a context's value, where it has any.
fn describe_value(context: &str, t: u32) -> Option<String> {
    if context == META_BASE_ALLOCATION {
        return match t {
            0 => Some("data".into()),
            STATE_HOLE => Some("hole".into()),
            STATE_ZERO => Some("zero".into()),
            3 => Some("hole,zero".into()),
            _ => None,
        };
    }
    if context.starts_with(META_DIRTY_BITMAP_PREFIX) {
        return match t {
            0 => Some("clean".into()),
            STATE_DIRTY => Some("dirty".into()),
            _ => None,
        };
    }
    if context == META_ALLOCATION_DEPTH {
        return Some(match t {
            0 => "absent".into(),
            1 => "local".into(),
            n => format!("backing depth {n}"),
        });
    }
    None
}

/// A JSON string (descriptions and context names are the user's or ours, but quoted
/// properly all the same).
fn json_str(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

/// Prints the map of `contexts` (see the module's words for the formats).
fn map(mut reader: ContextReader, contexts: &[String], as_json: bool) -> Result<i32> {
    use std::fmt::Write as _;
    use std::io::Write as _;
    let desc = |i: usize, t: u32| describe_value(&contexts[i], t);
    // Descriptions padded per column so the columns line up: to the widest the context
    // has (known in advance: rows are printed as they come, never all kept in memory).
    let widths: Vec<usize> = contexts
        .iter()
        .map(|c| match c.as_str() {
            META_BASE_ALLOCATION => "hole,zero".len(),
            META_ALLOCATION_DEPTH => "backing depth 99".len(),
            c if c.starts_with(META_DIRTY_BITMAP_PREFIX) => "clean".len(),
            _ => 0,
        })
        .collect();
    let mut so = std::io::BufWriter::with_capacity(1 << 16, std::io::stdout().lock());
    let mut line = String::new();
    let mut first = true;
    if as_json {
        so.write_all(b"[\n")?;
    }
    reader
        .walk(|o, l, v| {
            line.clear();
            if as_json {
                if !std::mem::take(&mut first) {
                    line.push_str(",\n");
                }
                let _ = write!(line, "{{ \"offset\": {o}, \"length\": {l}, ");
                if let [t] = v[..] {
                    let _ = write!(line, "\"type\": {t}");
                    if let Some(d) = desc(0, t) {
                        let _ = write!(line, ", \"description\": {}", json_str(&d));
                    }
                } else {
                    line.push_str("\"contexts\": [");
                    for (i, &t) in v.iter().enumerate() {
                        let sep = if i > 0 { ", " } else { "" };
                        let _ = write!(line, "{sep}{{ \"name\": {}, \"type\": {t}", json_str(&contexts[i]));
                        if let Some(d) = desc(i, t) {
                            let _ = write!(line, ", \"description\": {}", json_str(&d));
                        }
                        line.push('}');
                    }
                    line.push(']');
                }
                line.push('}');
            } else {
                let _ = write!(line, "{o:>10}  {l:>10}");
                for (i, &t) in v.iter().enumerate() {
                    let _ = write!(line, "  {t:>3}");
                    let d = desc(i, t);
                    if i + 1 < v.len() {
                        let _ = write!(line, "  {:<w$}", d.unwrap_or_default(), w = widths[i]);
                    } else if let Some(d) = d {
                        let _ = write!(line, "  {d}");
                    }
                }
                line.truncate(line.trim_end().len());
                line.push('\n');
            }
            so.write_all(line.as_bytes()).map_err(|e| format!("writing the map: {e}"))
        })
        .context("reading the map")?;
    reader.close();
    if as_json {
        so.write_all(b"\n]\n")?;
    }
    so.flush()?;
    Ok(0)
}

/// `ferry info PATH`: format, virtual size, cluster size, backing chain, allocation.
fn local(args: &InfoArgs, loc: &ferry_open::Location) -> Result<i32> {
    use ferry_backend::{Access, Backend, FileBackend, ImageUse};
    use ferry_open::{Format, Location, StoreImage};
    // Locked as qemu-img info locks: a qcow2 image being written is refused (its
    // metadata may be half-written); a raw file takes no lock.
    let usage = ImageUse::new(Access::Inspect).force_share(args.force_share);
    if args.list {
        anyhow::bail!("--list needs an NBD URI; serve the image (ferry serve {}) and ask the export", args.uri);
    }
    if let (Location::Repo { repo, name, id }, true) = (loc, args.map.is_empty()) {
        return snapshot_info(args, repo, name, id.as_deref());
    }
    if !args.map.is_empty() {
        let how = ferry_open::ServeOpen { read_only: true, force_share: args.force_share, ..Default::default() };
        let (backend, _files) = ferry_open::open_backend(loc, how, &args.remote.remote())?;
        let reader = ContextReader::local(&backend, &args.uri, &args.map)?;
        return map(reader, &args.map, args.json);
    }
    let image = match loc {
        Location::Image { store: ferry_open::Store::File(p), .. } => match ferry_open::local_format_of(loc) {
            Some(Format::Qcow2) => {
                Image::Qcow2(p.display().to_string(), ferry_open::open_local_qcow2_image(loc, usage)?)
            }
            _ => Image::Raw(p),
        },
        Location::Image { store, format, .. } => {
            match ferry_open::open_on_store(store, *format, true, &args.remote.remote())? {
                StoreImage::Qcow2(q) => Image::Qcow2(q.describe(), q),
                StoreImage::Raw(b) => Image::Store(b),
            }
        }
        _ => anyhow::bail!("{:?} is neither an NBD URI nor a disk image", args.uri),
    };
    enum Image<'a> {
        Qcow2(String, std::sync::Arc<ferry_qcow2::Qcow2>),
        Raw(&'a std::path::Path),
        Store(std::sync::Arc<dyn Backend>),
    }
    let doc = match image {
        Image::Qcow2(p, q) => {
            let i = q.info();
            let a = q.allocation().with_context(|| format!("reading the L2 tables of {p}"))?;
            let chain: Vec<Value> = i
                .backing_chain
                .iter()
                .map(|c| json!({"filename": c.name, "path": c.path.display().to_string(), "format": c.format, "virtual-size": c.virtual_size}))
                .collect();
            // As qemu-img info lists them.
            let bitmaps: Vec<Value> = q
                .bitmaps()
                .iter()
                .map(|b| {
                    let mut flags = Vec::new();
                    if b.in_use {
                        flags.push("in-use");
                    }
                    if b.auto {
                        flags.push("auto");
                    }
                    json!({"flags": flags, "name": b.name, "granularity": b.granularity})
                })
                .collect();
            // qemu-img's: its bitmaps under format-specific (and at the top, as before).
            let specific = json!({"type": "qcow2", "data": {
                "compat": if i.version >= 3 { "1.1" } else { "0.10" },
                "compression-type": i.compression,
                "lazy-refcounts": i.lazy_refcounts,
                "bitmaps": bitmaps,
                "refcount-bits": i.refcount_bits,
                "corrupt": i.corrupt,
                "extended-l2": i.extended_l2,
            }});
            json!({
                "filename": p,
                "format": "qcow2",
                "format-specific": specific,
                // An image ferry opened has no dirty bit: one that has it is refused.
                "dirty-flag": false,
                "bitmaps": bitmaps,
                "virtual-size": i.virtual_size,
                "file-size": i.file_size,
                "version": i.version,
                "cluster-size": i.cluster_size,
                "compression-type": i.compression,
                "extended-l2": i.extended_l2,
                "refcount-bits": i.refcount_bits,
                "snapshots": i.snapshots,
                "data-file": i.data_file,
                "backing-chain": chain,
                "allocation": {"data": a.data, "compressed": a.compressed, "zero": a.zero, "unallocated": a.unallocated},
            })
        }
        Image::Store(b) => {
            json!({"filename": b.describe(), "format": "raw", "virtual-size": b.size(), "dirty-flag": false})
        }
        Image::Raw(p) => {
            let f =
                FileBackend::open_with(p, true, usage.raw()).with_context(|| format!("cannot open {}", p.display()))?;
            let mut ex = Vec::new();
            let mut pos = 0;
            while pos < f.size() {
                let before = ex.len();
                f.extents(pos, f.size() - pos, 1 << 16, &mut ex)?;
                let got: u64 = ex[before..].iter().map(|e| e.length).sum();
                if got == 0 {
                    break;
                }
                pos += got;
            }
            let data: u64 = ex.iter().filter(|e| e.flags & STATE_HOLE == 0).map(|e| e.length).sum();
            json!({
                "filename": p.display().to_string(),
                "format": "raw",
                "virtual-size": f.size(),
                "dirty-flag": false,
                "allocation": {"data": data, "unallocated": f.size() - data},
            })
        }
    };
    let mut doc = doc;
    // qemu-img's actual-size: the bytes the local file takes on its file system.
    if let Location::Image { store: ferry_open::Store::File(p), .. } = loc {
        use std::os::unix::fs::MetadataExt;
        if let Ok(m) = std::fs::metadata(p) {
            doc["actual-size"] = json!(m.blocks() * 512);
        }
    }
    if args.size {
        println!("{}", doc["virtual-size"]);
        return Ok(0);
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&doc)?);
        return Ok(0);
    }
    println!("image: {}", doc["filename"].as_str().unwrap_or(""));
    println!("format: {}", doc["format"].as_str().unwrap_or(""));
    println!("virtual size: {} bytes", doc["virtual-size"]);
    if doc["format"] == "qcow2" {
        println!("version: {}", doc["version"]);
        println!("cluster size: {} bytes", doc["cluster-size"]);
        println!("compression type: {}", doc["compression-type"].as_str().unwrap_or(""));
        if doc["extended-l2"] == true {
            println!("extended L2: yes (32 subclusters per cluster)");
        }
        if let Some(d) = doc["data-file"].as_str() {
            println!("data file: {d}");
        }
        if doc["snapshots"] != 0 {
            println!("internal snapshots: {}", doc["snapshots"]);
        }
        for b in doc["bitmaps"].as_array().into_iter().flatten() {
            let flags: Vec<&str> = b["flags"].as_array().into_iter().flatten().filter_map(|f| f.as_str()).collect();
            println!(
                "bitmap {}: granularity {} bytes{}",
                b["name"],
                b["granularity"],
                if flags.is_empty() { String::new() } else { format!(", flags: {}", flags.join(", ")) }
            );
        }
        for (n, c) in doc["backing-chain"].as_array().into_iter().flatten().enumerate() {
            println!(
                "backing file {}: {} (format: {}, {} bytes)",
                n + 1,
                c["path"].as_str().unwrap_or(""),
                c["format"].as_str().unwrap_or(""),
                c["virtual-size"]
            );
        }
    }
    let a = &doc["allocation"];
    for k in ["data", "compressed", "zero", "unallocated"] {
        if let Some(v) = a.get(k) {
            println!("{k}: {v} bytes");
        }
    }
    Ok(0)
}

/// `ferry info REPO::NAME[@ID]`: the snapshot's manifest and its repository.
fn snapshot_info(args: &InfoArgs, repo_spec: &str, name: &str, id: Option<&str>) -> Result<i32> {
    let remote = args.remote.remote();
    let on = ferry_open::repo::snapshot_on_rollback(repo_spec, name, id);
    let repo = ferry_open::repo::open_repository_with(repo_spec, &remote, None, on)?;
    let shown = ferry_open::Location::repo_spec(repo_spec, name, id);
    let snap = ferry_open::repo::resolve(&repo, name, id).with_context(|| shown.clone())?;
    let m = &snap.manifest;
    if args.size {
        println!("{}", m.size);
        return Ok(0);
    }
    let cfg = repo.config();
    let doc = json!({
        "snapshot": snap.id,
        "name": m.name,
        "repository": repo_spec,
        "encrypted": cfg.encryption.is_some(),
        "format-version": cfg.version,
        "chunk-size": cfg.chunk_size,
        "virtual-size": m.size,
        "time": m.time,
        "parent": m.parent,
        "source": m.source,
        "changes": m.changes,
        "blkhash": m.blkhash,
        "stats": m.stats,
        "host": m.host,
        "ferry": m.ferry,
    });
    if args.json {
        println!("{}", serde_json::to_string_pretty(&doc)?);
        return Ok(0);
    }
    println!("snapshot: {}", snap.id);
    println!("disk: {}", m.name);
    println!(
        "repository: {repo_spec} ({}, format version {}, chunks of {} bytes)",
        if cfg.encryption.is_some() { "encrypted" } else { "not encrypted" },
        cfg.version,
        cfg.chunk_size
    );
    println!("virtual size: {} bytes", m.size);
    println!("time: {}", m.time);
    println!("parent: {}", m.parent.as_deref().unwrap_or("none"));
    println!("source: {}", m.source);
    println!("changes: {}", crate::repo::shown_changes(&m.changes));
    if let Some(h) = &m.blkhash {
        println!("blkhash: {h}");
    }
    println!(
        "backup: {} bytes read, {} new chunks, {} bytes stored",
        m.stats.read, m.stats.new_chunks, m.stats.new_stored
    );
    Ok(0)
}
