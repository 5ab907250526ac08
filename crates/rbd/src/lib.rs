//! Ceph RBD images as ferry backends, through Ceph's own client library (librbd).
//!
//! [`RbdImage`] implements [`ferry_backend::Backend`], so `ferry serve` exports an image
//! and `ferry copy` reads from or writes into one like any other backend. The spec is
//! `rbd:POOL[/NAMESPACE]/IMAGE[@SNAP][?conf=PATH&id=USER&keyring=PATH&timeout=SECS]`
//! (qemu's `:key=value` form is accepted too); any other key is a Ceph option passed to
//! librados (`mon_host=...`).
//!
//! The `Backend` trait is synchronous: the server calls it from each connection's thread
//! and the copy engine from each worker. Inside one call, a read or write is cut at object
//! boundaries and every piece is in flight at once through librbd's asynchronous API
//! (one completion each, no thread per request). The server keeps every READ and WRITE it has
//! received on a connection in flight through [`Backend::io_queue`] and answers each as
//! it completes, so a client with many reads in flight on one connection has them all in
//! flight in librbd; many calls are in flight at once
//! through several connections or workers sharing one image handle.
//!
//! All `unsafe` code is in the `ffi` module.
//!
//! # Ceph RBD, and more than one machine
//!
//! `crates/rbd` (`ferry-rbd`) puts an RBD image behind the same `Backend` trait as a file, so
//! the server, the copy engine (`Endpoint::Backend`) and `ferry hash` use it unchanged; the
//! opener picks it for `rbd:` specs in `crates/open/src/rbd.rs`, behind the Cargo
//! feature `rbd` (off by default, on in scripts/test and release builds; off, the binary links no Ceph library and says how to get it).
//! The trait is synchronous, so inside one call a read or write is cut at object boundaries
//! and every piece goes to librbd's asynchronous API at once, then the call waits for all of
//! them. The backend also offers a request queue (`Backend::io_queue`, one per connection):
//! the connection's thread submits every READ, and every WRITE without FUA (with a copy of
//! its payload), it has received to it (at most 64 requests and 32 MiB per connection),
//! answers the oldest as soon as it completes (`rbd_aio_is_complete`), and waits for one
//! only when the client has sent nothing new (`poll` with a zero timeout), so new requests
//! join those in flight as they arrive, the way qemu-nbd's coroutines keep librbd busy.
//! Other requests run beside those in flight (the protocol orders no two requests in
//! flight), so a client that interleaves BLOCK_STATUS with its reads (qemu-img convert)
//! does not drain the queue each time; a FLUSH is answered after every write before it
//! (and covers them), a disconnect after every request before it. Each queued request owns
//! its buffer until it completes (dropping the queue waits for all of them), so librbd
//! never touches memory that was handed back; a read's reply goes out from its buffer
//! without a copy. A read-only export's queue answers writes with the read-only error, in
//! turn (file and memory backends keep one request at a time). Concurrency beyond one
//! connection comes from several connections (each a thread) and the copy engine's
//! workers, which share one image handle. There is no thread per request, and librbd's writeback cache and read-ahead are on (the
//! cache from the first write: NBD clients make writes durable with FLUSH, which ferry passes
//! on; read-ahead for the whole image, so one sequential connection still streams). `ferry
//! copy` opens its images without the cache: its writes are large and flushed once at the
//! end, and with the cache a write to an OSD that died waits forever, while without it the
//! copy fails after `rados_osd_op_timeout` (60 s; tested with 5). A server's FLUSH to a dead
//! OSD goes through the cache and can wait as long as the cluster is away (a known limit of
//! serving with the cache on).
//!
//! **Many ferry servers in front of one pool.** The data lives in the Ceph cluster, not on
//! the machine running ferry, so ferry scales out by running more servers: each on its own
//! host, each serving the images its clients need, all talking to the same pool; any
//! server can serve any image, and a client that loses its server can reconnect to another.
//! What must not happen is two writers of one image with separate caches. Two rules keep it
//! safe:
//!
//! - *Multi-conn is per server.* `CAN_MULTI_CONN` promises that a FLUSH on one connection
//!   covers writes completed on every connection *to that server*. ferry keeps that promise
//!   because all its connections to an export share one librbd handle, hence one cache, and
//!   FLUSH flushes it. It promises nothing about connections to another server; a client
//!   must not spread one image's writes over several servers.
//! - *The exclusive lock is per image.* With the exclusive-lock feature (the default), a
//!   writable ferry takes the image's lock on open and keeps it until it exits: a second
//!   writer (another ferry, qemu, `rbd import`) is refused with "locked by another client"
//!   rather than silently taking turns with it, which would make each server's cache stale
//!   for the other. Readers do not need the lock: snapshots (`@SNAP`) and `--read-only`
//!   exports can be served by any number of servers at once, which is how one golden image
//!   is fanned out to many hosts. Moving a writable image to another server is: stop the
//!   first (its lock and cache are released and flushed on exit; a killed server's lock is
//!   broken by librbd once the dead client's watch expires: the next writer's open waits
//!   about 30 s, measured), start the second.
//!
//! # What this crate owns
//!
//! `RbdImage`: a Ceph RBD image as a `Backend` (spec parsing, connect with bounded
//! timeouts, open/create, exclusive lock, aio reads and writes cut at object boundaries,
//! zero/discard/flush, extents from `rbd_diff_iterate2`, errors that name the image and
//! what to do). The librados/librbd declarations are generated by bindgen from the
//! installed headers at build time
//!
//! `unsafe`: only in its `ffi` module (safe handles over `rados_t`, `rados_ioctx_t`, `rbd_image_t`), each block with a `// SAFETY:` comment; `deny(unsafe_code)` elsewhere.
#![deny(unsafe_code)]

mod ffi;
mod spec;

pub use spec::{is_rbd, Spec};

use ferry_backend::{push_extent, Backend, Capabilities, Error, ErrorKind, Extent, ZeroMode, DATA, HOLE};
use std::io;
use std::sync::Arc;

/// The run-time librbd's version, `MAJOR.MINOR.EXTRA` (for `ferry --version`).
pub fn librbd_version() -> String {
    let (major, minor, extra) = ffi::version();
    format!("{major}.{minor}.{extra}")
}

/// librados' errno values that get their own message.
mod errno {
    pub const EPERM: i32 = 1;
    pub const ENOENT: i32 = 2;
    pub const EIO: i32 = 5;
    pub const EACCES: i32 = 13;
    pub const EBUSY: i32 = 16;
    pub const EEXIST: i32 = 17;
    pub const EROFS: i32 = 30;
    pub const ETIMEDOUT: i32 = 110;
}

/// Why an image could not be opened or created, with what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum RbdError {
    #[error("bad RBD spec {spec:?}: {why}; write rbd:POOL/IMAGE[@SNAP][?conf=PATH&id=USER&keyring=PATH]")]
    BadSpec { spec: String, why: String },
    #[error("{image}: cannot read the Ceph configuration{}: {err}; pass ?conf=PATH or set CEPH_CONF", .conf.as_ref().map(|c| format!(" {c}")).unwrap_or_default())]
    Config { image: String, conf: Option<String>, err: io::Error },
    #[error("{image}: bad Ceph option ({step}): {err}")]
    Option { image: String, step: &'static str, err: io::Error },
    #[error("{image}: no Ceph monitor at {mon_host} answered within {secs} s; check that the cluster is up and `mon host` in the configuration (or ?conf=PATH) is right")]
    Unreachable { image: String, mon_host: String, secs: u64 },
    #[error("{image}: the cluster refused client.{user} ({err}); check the keyring (?keyring=PATH) holds that user's key and its caps allow this pool (`ceph auth get client.{user}`)")]
    Denied { image: String, user: String, err: io::Error },
    #[error("{image}: pool {pool:?} does not exist; create it (`ceph osd pool create {pool}` and `rbd pool init {pool}`) or fix the spec")]
    NoPool { image: String, pool: String },
    #[error("{image}: no such image{}; check `rbd ls {pool}`{}", .snap.as_ref().map(|s| format!(" or no snapshot {s:?}")).unwrap_or_default(), .snap.as_ref().map(|_| " and `rbd snap ls`").unwrap_or_default())]
    NoImage { image: String, pool: String, snap: Option<String> },
    #[error("{image}: the image is locked by another client ({err}); stop that client (`rbd status {image_name}` lists it), or open a snapshot or read-only")]
    Locked { image: String, image_name: String, err: io::Error },
    #[error("{image}: already exists")]
    Exists { image: String },
    #[error("{image}: {step} failed: {err}")]
    Other { image: String, step: &'static str, err: io::Error },
}

fn os(errno: i32) -> io::Error {
    io::Error::from_raw_os_error(errno)
}

/// Facts about an image, for `ferry info`.
#[derive(Debug, Clone)]
pub struct Info {
    pub size: u64,
    pub object_size: u64,
    pub order: u32,
    pub features: Vec<&'static str>,
    /// (name, size) of each snapshot, oldest first.
    pub snapshots: Vec<(String, u64)>,
    pub read_only: bool,
    pub snapshot: Option<String>,
}

/// An open RBD image.
pub struct RbdImage {
    spec: Spec,
    image: Arc<ffi::Image>,
    size: u64,
    object_size: u64,
    order: u32,
    features: u64,
    read_only: bool,
}

/// Connects to the cluster a spec names and opens its pool. Without `cache`, librbd's
/// cache is off (the spec's own `rbd_cache=` still wins).
fn connect(spec: &Spec, cache: bool) -> Result<ffi::IoCtx, RbdError> {
    let image = spec.to_string();
    let secs = spec.timeout.as_secs().max(1);
    let mut options: Vec<(&str, String)> = vec![
        // A cluster that does not answer fails the connect after `secs`, not never.
        ("client_mount_timeout", secs.to_string()),
        ("rados_mon_op_timeout", secs.to_string()),
        // An OSD that does not answer fails the request (EIO to the client) after a
        // minute instead of hanging it forever.
        ("rados_osd_op_timeout", "60".to_string()),
        // NBD clients make writes durable with FLUSH (and FUA), which ferry passes to
        // librbd, so the write-back cache may work from the first write instead of only
        // after the first flush (the guard librbd keeps for guests that never flush).
        ("rbd_cache_writethrough_until_flush", "false".to_string()),
        // A sequential reader on one connection (qemu-img convert) keeps librbd's
        // read-ahead for the whole image instead of the first 50 MiB (the default
        // assumes a guest kernel doing its own), a few objects ahead.
        ("rbd_readahead_disable_after_bytes", "0".to_string()),
        ("rbd_readahead_max_bytes", (8u64 << 20).to_string()),
    ];
    if !cache {
        options.push(("rbd_cache", "false".to_string()));
    }
    if let Some(k) = &spec.keyring {
        options.push(("keyring", k.clone()));
    }
    for (k, v) in &spec.options {
        options.push((k.as_str(), v.clone()));
    }
    let cluster = ffi::Cluster::create(&spec.user, spec.conf.as_deref(), &options).map_err(|(step, e)| match step {
        "rados_conf_read_file" => RbdError::Config { image: image.clone(), conf: spec.conf.clone(), err: os(e) },
        _ => RbdError::Option { image: image.clone(), step, err: os(e) },
    })?;
    cluster.connect().map_err(|e| match e {
        errno::ETIMEDOUT => RbdError::Unreachable {
            image: image.clone(),
            mon_host: cluster
                .conf_get("mon_host")
                .filter(|m| !m.is_empty())
                .unwrap_or_else(|| "(none configured)".into()),
            secs,
        },
        errno::EACCES | errno::EPERM => RbdError::Denied { image: image.clone(), user: spec.user.clone(), err: os(e) },
        errno::ENOENT => RbdError::Config { image: image.clone(), conf: spec.conf.clone(), err: os(e) },
        _ => RbdError::Other { image: image.clone(), step: "connecting to the cluster", err: os(e) },
    })?;
    cluster.ioctx(&spec.pool, spec.namespace.as_deref()).map_err(|e| match e {
        errno::ENOENT => RbdError::NoPool { image, pool: spec.pool.clone() },
        errno::EACCES | errno::EPERM => RbdError::Denied { image, user: spec.user.clone(), err: os(e) },
        _ => RbdError::Other { image, step: "opening the pool", err: os(e) },
    })
}

impl RbdImage {
    /// Opens the image a spec names; at a snapshot or with `read_only`, read-only.
    /// A writable image with the exclusive-lock feature is locked for as long as it is
    /// open: another client holding the lock is an error, not a silent hand-over.
    pub fn open(spec: &str, read_only: bool) -> Result<RbdImage, RbdError> {
        Self::open_with(spec, read_only, true)
    }

    /// [`RbdImage::open`] with librbd's cache on or off. Serving wants it (small writes
    /// are merged until FLUSH); a copy does not: its writes are large, it flushes once at
    /// the end, and with the cache on a write to an OSD that died waits forever instead of
    /// failing after `rados_osd_op_timeout` (measured: still hung after 150 s; without
    /// the cache the copy fails with ETIMEDOUT).
    pub fn open_with(spec: &str, read_only: bool, cache: bool) -> Result<RbdImage, RbdError> {
        let spec = Spec::parse(spec)?;
        let io = connect(&spec, cache)?;
        let read_only = read_only || spec.snap.is_some();
        let name = spec.to_string();
        let other = |step: &'static str, e: i32| RbdError::Other { image: name.clone(), step, err: os(e) };
        let image = io.open(&spec.image, spec.snap.as_deref(), read_only).map_err(|e| match e {
            errno::ENOENT => {
                RbdError::NoImage { image: name.clone(), pool: spec.pool.clone(), snap: spec.snap.clone() }
            }
            errno::EACCES | errno::EPERM => {
                RbdError::Denied { image: name.clone(), user: spec.user.clone(), err: os(e) }
            }
            _ => other("opening the image", e),
        })?;
        let st = image.stat().map_err(|e| other("rbd_stat", e))?;
        let features = image.features().map_err(|e| other("rbd_get_features", e))?;
        if !read_only && features & ffi::RBD_FEATURE_EXCLUSIVE_LOCK as u64 != 0 {
            image.lock_exclusive().map_err(|e| match e {
                errno::EROFS | errno::EBUSY | errno::ETIMEDOUT => {
                    RbdError::Locked { image: name.clone(), image_name: spec.path(), err: os(e) }
                }
                _ => other("taking the exclusive lock", e),
            })?;
        }
        Ok(RbdImage {
            spec,
            image: Arc::new(image),
            size: st.size,
            object_size: st.object_size,
            order: st.order,
            features,
            read_only,
        })
    }

    /// Creates the image a spec names, `size` bytes with 4 MiB objects and the pool's
    /// default features. An existing image is [`RbdError::Exists`].
    pub fn create(spec: &str, size: u64) -> Result<(), RbdError> {
        let spec = Spec::parse(spec)?;
        let name = spec.to_string();
        if spec.snap.is_some() {
            return Err(RbdError::BadSpec { spec: name, why: "a snapshot cannot be created as an image".into() });
        }
        let io = connect(&spec, false)?;
        io.create(&spec.image, size, 22).map_err(|e| match e {
            errno::EEXIST => RbdError::Exists { image: name.clone() },
            errno::EACCES | errno::EPERM => {
                RbdError::Denied { image: name.clone(), user: spec.user.clone(), err: os(e) }
            }
            _ => RbdError::Other { image: name.clone(), step: "creating the image", err: os(e) },
        })
    }

    /// The spec this image was opened from, without its options.
    pub fn spec(&self) -> &Spec {
        &self.spec
    }

    pub fn object_size(&self) -> u64 {
        self.object_size
    }

    fn has(&self, feature: u32) -> bool {
        self.features & feature as u64 != 0
    }

    /// Size, object size, features and snapshots.
    pub fn info(&self) -> Result<Info, RbdError> {
        let names = [
            (ffi::RBD_FEATURE_LAYERING, "layering"),
            (ffi::RBD_FEATURE_STRIPINGV2, "striping"),
            (ffi::RBD_FEATURE_EXCLUSIVE_LOCK, "exclusive-lock"),
            (ffi::RBD_FEATURE_OBJECT_MAP, "object-map"),
            (ffi::RBD_FEATURE_FAST_DIFF, "fast-diff"),
            (ffi::RBD_FEATURE_DEEP_FLATTEN, "deep-flatten"),
            (ffi::RBD_FEATURE_JOURNALING, "journaling"),
        ];
        let snapshots = self.image.snapshots().map_err(|e| RbdError::Other {
            image: self.spec.to_string(),
            step: "listing snapshots",
            err: os(e),
        })?;
        Ok(Info {
            size: self.size,
            object_size: self.object_size,
            order: self.order,
            features: names.iter().filter(|(f, _)| self.has(*f)).map(|(_, n)| *n).collect(),
            snapshots: snapshots.into_iter().map(|(_, n, s)| (n, s)).collect(),
            read_only: self.read_only,
            snapshot: self.spec.snap.clone(),
        })
    }

    fn err(op: &'static str, offset: u64, length: u64, e: i32) -> Error {
        let e = if e == 0 { errno::EIO } else { e };
        Error::io(op, offset, length, os(e))
    }

    fn flush_if(&self, fua: bool, op: &'static str, offset: u64, length: u64) -> ferry_backend::Result<()> {
        if fua {
            self.image.flush().map_err(|e| Self::err(op, offset, length, e))?;
        }
        Ok(())
    }
}

impl Backend for RbdImage {
    fn describe(&self) -> String {
        self.spec.to_string()
    }

    /// The image's name (pool, namespace, image, snapshot), the cluster it is on (the
    /// configuration file, user and options, with a key's value hidden) and its size, for
    /// a resumed copy. An image deleted and made again under the same name and size is
    /// not told apart: resume from a snapshot (`@SNAP`) to be sure.
    fn identity(&self) -> Option<String> {
        let mut id = format!("{} size={} user={}", self.spec, self.size, self.spec.user);
        if let Some(c) = &self.spec.conf {
            id += &format!(" conf={c}");
        }
        for (k, v) in &self.spec.options {
            let shown = ferry_backend::redact_rbd(&format!("rbd:p/i?{k}={v}"));
            id += &format!(" {}", shown.trim_start_matches("rbd:p/i?"));
        }
        Some(id)
    }

    fn size(&self) -> u64 {
        self.size
    }

    /// Multi-conn is safe: every connection of one ferry server goes through this one
    /// image handle (one librbd cache), so a FLUSH on any connection covers writes
    /// completed on all of them. It says nothing about other processes: see
    /// the crate docs, "Many ferry servers in front of one pool".
    fn caps(&self) -> Capabilities {
        let w = !self.read_only;
        Capabilities {
            read_only: self.read_only,
            flush: true,
            fua: w,
            trim: w,
            zero: w,
            fast_zero: false,
            multi_conn: true,
            cache: false,
            extents: true,
        }
    }

    fn read(&self, buf: &mut [u8], offset: u64) -> ferry_backend::Result<()> {
        self.image.read(buf, offset, self.object_size).map_err(|e| Self::err("read", offset, buf.len() as u64, e))
    }

    /// Every request waits on an OSD round trip; many in flight cost about one, so the
    /// server keeps a connection's READs and WRITEs in flight together and answers each
    /// as it completes. A read-only image's queue refuses writes, as `write` does.
    fn io_queue(&self) -> Option<Box<dyn ferry_backend::IoQueue>> {
        let q =
            Box::new(Queue { queue: ffi::IoQueue::new(self.image.clone(), self.object_size), ops: Default::default() });
        Some(if self.read_only { ferry_backend::read_only_queue(q) } else { q })
    }

    fn write(&self, buf: &[u8], offset: u64, fua: bool) -> ferry_backend::Result<()> {
        if self.read_only {
            return Err(Error::new(ErrorKind::ReadOnly, "write", offset, buf.len() as u64));
        }
        self.image.write(buf, offset, self.object_size).map_err(|e| Self::err("write", offset, buf.len() as u64, e))?;
        self.flush_if(fua, "write", offset, buf.len() as u64)
    }

    fn flush(&self) -> ferry_backend::Result<()> {
        self.image.flush().map_err(|e| Self::err("flush", 0, 0, e))
    }

    fn trim(&self, offset: u64, length: u64, fua: bool) -> ferry_backend::Result<()> {
        if self.read_only {
            return Err(Error::new(ErrorKind::ReadOnly, "trim", offset, length));
        }
        self.image.discard(offset, length).map_err(|e| Self::err("trim", offset, length, e))?;
        self.flush_if(fua, "trim", offset, length)
    }

    fn zero(&self, offset: u64, length: u64, mode: ZeroMode, fua: bool) -> ferry_backend::Result<()> {
        if self.read_only {
            return Err(Error::new(ErrorKind::ReadOnly, "zero", offset, length));
        }
        if mode.fast {
            // Zeroing part of an object writes zeroes: not faster than a WRITE.
            return Err(Error::new(ErrorKind::NotSupported, "zero", offset, length));
        }
        // librbd takes the length as size_t; cut very long ranges so it always fits.
        let mut pos = offset;
        let end = offset + length;
        while pos < end {
            let n = (end - pos).min(1 << 30);
            self.image.write_zeroes(pos, n, !mode.may_trim).map_err(|e| Self::err("zero", pos, n, e))?;
            pos += n;
        }
        self.flush_if(fua, "zero", offset, length)
    }

    /// From librbd's allocation data (`rbd_diff_iterate2` since creation): whole objects
    /// from the object map where fast-diff is on, per-object listings otherwise (those
    /// cost a round trip per object, so one call covers at most 256 objects).
    fn extents(&self, offset: u64, length: u64, max: usize, out: &mut Vec<Extent>) -> ferry_backend::Result<()> {
        let fast = self.has(ffi::RBD_FEATURE_FAST_DIFF);
        let length = if fast { length } else { length.min(256 * self.object_size) };
        let end = offset + length;
        let found =
            self.image.allocated(offset, length, fast).map_err(|e| Self::err("block status", offset, length, e))?;
        let mut ex = Vec::new();
        let mut pos = offset;
        for (off, len, exists) in found {
            let (a, b) = (off.max(pos), (off + len).min(end));
            if b <= a {
                continue;
            }
            push_extent(&mut ex, a - pos, HOLE);
            push_extent(&mut ex, b - a, if exists { DATA } else { HOLE });
            pos = b;
        }
        push_extent(&mut ex, end - pos, HOLE);
        // Past `max`, the caller asks again from where the answer stopped.
        ex.truncate(max.max(1));
        out.extend(ex);
        Ok(())
    }
}

/// [`ferry_backend::IoQueue`] over librbd's asynchronous reads and writes, with errors as
/// the backend reports them.
struct Queue {
    queue: ffi::IoQueue,
    /// Per request in flight, oldest first: what it is and where (for the error message).
    ops: std::collections::VecDeque<(&'static str, u64)>,
}

impl ferry_backend::IoQueue for Queue {
    fn submit_read(&mut self, buf: Vec<u8>, offset: u64) {
        self.ops.push_back(("read", offset));
        self.queue.submit(buf, offset, false);
    }

    fn submit_write(&mut self, buf: Vec<u8>, offset: u64) {
        self.ops.push_back(("write", offset));
        self.queue.submit(buf, offset, true);
    }

    fn len(&self) -> usize {
        self.queue.len()
    }

    fn oldest_done(&self) -> bool {
        self.queue.oldest_done()
    }

    fn complete(&mut self) -> Option<(Vec<u8>, ferry_backend::Result<()>)> {
        let (buf, r) = self.queue.complete()?;
        let (op, offset) = self.ops.pop_front().unwrap_or(("read", 0));
        let r = r.map_err(|e| RbdImage::err(op, offset, buf.len() as u64, e));
        Some((buf, r))
    }
}
