//! The resume journal of `ferry copy --resume`: one small text file saying how much of
//! a copy is known to be written *and flushed* at the destination.
//!
//! ```text
//! ferry-resume 1
//! ferry-version 0.1.0
//! source file:/data/src.img size=… dev=… ino=… mtime=…
//! destination file:/data/dst.img dev=… ino=…
//! options request-size=1048576 sparse=true
//! source-size 4294967296
//! watermark 1073741824
//! destination-zeroed 1
//! crc32 1a2b3c4d
//! ```
//!
//! `watermark` W: every byte of the source below W is at the destination and flushed.
//! `destination-zeroed`: the first run found (or made) the destination reading as zeroes
//! everywhere (a file or qcow2 image it created), so above W it holds either zeroes or
//! the source's own bytes, and a resumed copy may still skip writing zeroes there. The
//! identities are strings the caller builds (kind, canonical spec, and for local files
//! device, inode and, for a source, mtime): a journal whose identities, options, source
//! size or ferry version differ from the copy being started is refused, as is one whose
//! checksum (CRC-32 of every line before it) does not match (torn or edited).
//!
//! Every store writes a temporary file beside the journal, syncs it, renames it over the
//! journal and syncs the directory, so a crash leaves the old or the new journal, whole.
//! The temporary file has a random name and is made with `O_CREAT | O_EXCL | O_NOFOLLOW`
//! and mode 0600 (nothing planted under its name is written through, and the journal is
//! readable by its owner only); a journal is opened with `O_NOFOLLOW`, so a symbolic link
//! planted at its path is refused, never read or written through. The identities hold
//! no secret (the caller redacts them: no password, no query string), and every message
//! that shows one redacts it again ([`redacted`]), for journals written before.

use std::fmt::Write as _;
use std::io::{self, Write as _};
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Format version of the journal file.
pub const FORMAT: u32 = 1;

/// The first word of a journal file.
const MAGIC: &str = "ferry-resume";

/// A journal is a few hundred bytes; anything larger than this is not one.
pub const MAX_JOURNAL_BYTES: u64 = 64 * 1024;

/// Longest identity or options string a journal keeps.
pub const MAX_FIELD_BYTES: usize = 16 * 1024;

/// Default bytes of completed source between two journal updates.
pub const DEFAULT_INTERVAL_BYTES: u64 = 256 << 20;

/// Default longest time between two journal updates while the copy advances.
pub const DEFAULT_INTERVAL_TIME: Duration = Duration::from_secs(5);

/// What a journal records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// The ferry that wrote it (`CARGO_PKG_VERSION`).
    pub ferry_version: String,
    pub source: String,
    pub destination: String,
    /// The copy options that change what is written (request size, sparse...).
    pub options: String,
    pub source_size: u64,
    /// Every byte below this is written and flushed at the destination.
    pub watermark: u64,
    /// The destination read as zeroes everywhere when the first run began writing it.
    pub destination_zeroed: bool,
}

/// Why a journal cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("resume journal {path}: {source}")]
    Io { path: String, source: io::Error },
    /// Not a journal, torn, or edited.
    #[error("resume journal {path} is not usable: {why}; use --restart to copy from the beginning")]
    Corrupt { path: String, why: String },
    /// A valid journal of another copy (or of this copy before something changed).
    #[error("resume journal {path} does not match this copy: {why}; use --restart to copy from the beginning")]
    Mismatch { path: String, why: String },
}

/// CRC-32 (IEEE 802.3, reflected, as zlib computes it).
pub fn crc32(data: &[u8]) -> u32 {
    const TABLE: [u32; 256] = {
        let mut t = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut k = 0;
            while k < 8 {
                c = if c & 1 != 0 { 0xEDB8_8320 ^ (c >> 1) } else { c >> 1 };
                k += 1;
            }
            t[i] = c;
            i += 1;
        }
        t
    };
    let mut c = !0u32;
    for &b in data {
        c = TABLE[((c ^ b as u32) & 0xFF) as usize] ^ (c >> 8);
    }
    !c
}

/// A value on one line: backslashes and line ends escaped.
fn escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('\n', "\\n").replace('\r', "\\r")
}

fn unescape(s: &str) -> Option<String> {
    let mut out = String::with_capacity(s.len());
    let mut it = s.chars();
    while let Some(c) = it.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match it.next()? {
            '\\' => out.push('\\'),
            'n' => out.push('\n'),
            'r' => out.push('\r'),
            _ => return None,
        }
    }
    Some(out)
}

/// `identity` as messages show it: every word that is a URL (`SCHEME://...`) without its
/// userinfo (`user:password@`), query string and fragment, where a password, a
/// presigned signature or a token would be. Identities ferry builds hold none; this
/// covers journals written before they were redacted.
pub fn redacted(identity: &str) -> String {
    identity
        .split(' ')
        .map(|word| {
            let Some(at) = word.find("://") else { return word.to_string() };
            let (scheme, rest) = (&word[..at + 3], &word[at + 3..]);
            let rest = &rest[..rest.find(['?', '#']).unwrap_or(rest.len())];
            let host_end = rest.find('/').unwrap_or(rest.len());
            let rest = match rest[..host_end].rfind('@') {
                Some(i) => &rest[i + 1..],
                None => rest,
            };
            format!("{scheme}{rest}")
        })
        .collect::<Vec<_>>()
        .join(" ")
}

impl Record {
    /// The file's bytes, checksum line included.
    pub fn encode(&self) -> Vec<u8> {
        let mut s = String::new();
        let _ = writeln!(s, "{MAGIC} {FORMAT}");
        let _ = writeln!(s, "ferry-version {}", escape(&self.ferry_version));
        let _ = writeln!(s, "source {}", escape(&self.source));
        let _ = writeln!(s, "destination {}", escape(&self.destination));
        let _ = writeln!(s, "options {}", escape(&self.options));
        let _ = writeln!(s, "source-size {}", self.source_size);
        let _ = writeln!(s, "watermark {}", self.watermark);
        let _ = writeln!(s, "destination-zeroed {}", u8::from(self.destination_zeroed));
        let crc = crc32(s.as_bytes());
        let _ = writeln!(s, "crc32 {crc:08x}");
        s.into_bytes()
    }

    /// Parses a journal file's bytes; the error says what is wrong with them.
    pub fn decode(bytes: &[u8]) -> Result<Record, String> {
        let text = std::str::from_utf8(bytes).map_err(|_| "it is not text".to_string())?;
        let Some(body_end) = text.rfind("crc32 ") else {
            return Err("it has no checksum line (truncated?)".into());
        };
        if body_end != 0 && !text[..body_end].ends_with('\n') {
            return Err("its checksum line is damaged".into());
        }
        let (body, tail) = text.split_at(body_end);
        let crc_text = tail["crc32 ".len()..].strip_suffix('\n').ok_or("its checksum line is truncated")?;
        let want = u32::from_str_radix(crc_text, 16).map_err(|_| format!("its checksum {crc_text:?} is not hex"))?;
        let got = crc32(body.as_bytes());
        if got != want || crc_text != format!("{want:08x}") {
            return Err(format!("its checksum does not match its contents (stored {crc_text}, computed {got:08x})"));
        }
        let mut lines = body.lines();
        let mut field = |name: &str| -> Result<String, String> {
            let line = lines.next().ok_or_else(|| format!("its {name} line is missing"))?;
            let v = line.strip_prefix(name).and_then(|r| r.strip_prefix(' ')).ok_or_else(|| {
                format!("expected its {name} line, found {:?}", redacted(&line.chars().take(40).collect::<String>()))
            })?;
            if v.len() > MAX_FIELD_BYTES {
                return Err(format!("its {name} line is longer than {MAX_FIELD_BYTES} bytes"));
            }
            unescape(v).ok_or_else(|| format!("its {name} line has a bad escape"))
        };
        let format =
            field(MAGIC).map_err(|_| "it does not start with \"ferry-resume\": not a ferry journal".to_string())?;
        if format != FORMAT.to_string() {
            return Err(format!("it is in journal format {format:?}, this ferry reads format {FORMAT}"));
        }
        let ferry_version = field("ferry-version")?;
        let source = field("source")?;
        let destination = field("destination")?;
        let options = field("options")?;
        let num = |name: &str, v: String| v.parse::<u64>().map_err(|_| format!("its {name} {v:?} is not a number"));
        let source_size = num("source-size", field("source-size")?)?;
        let watermark = num("watermark", field("watermark")?)?;
        let destination_zeroed = match field("destination-zeroed")?.as_str() {
            "0" => false,
            "1" => true,
            v => return Err(format!("its destination-zeroed {v:?} is not 0 or 1")),
        };
        if lines.next().is_some() {
            return Err("it has lines after its last field".into());
        }
        if watermark > source_size {
            return Err(format!("its watermark {watermark} is past the end of its {source_size}-byte source"));
        }
        Ok(Record { ferry_version, source, destination, options, source_size, watermark, destination_zeroed })
    }

    /// What differs between this stored record and the copy being started (`now`), in
    /// words; `None` when it is the same copy. Watermark and zeroed flag are state, not key.
    pub fn differs(&self, now: &Record) -> Option<String> {
        let mut what = Vec::new();
        if self.ferry_version != now.ferry_version {
            what.push(format!("it was written by ferry {}, this is ferry {}", self.ferry_version, now.ferry_version));
        }
        if self.source != now.source {
            what.push(format!(
                "the source is not the same (or changed since): journal has {:?}, now {:?}",
                redacted(&self.source),
                redacted(&now.source)
            ));
        }
        if self.source_size != now.source_size {
            what.push(format!("the source was {} bytes, now {}", self.source_size, now.source_size));
        }
        if self.destination != now.destination {
            what.push(format!(
                "the destination is not the same: journal has {:?}, now {:?}",
                redacted(&self.destination),
                redacted(&now.destination)
            ));
        }
        if self.options != now.options {
            what.push(format!("the copy options differ: journal has {:?}, now {:?}", self.options, now.options));
        }
        (!what.is_empty()).then(|| what.join("; "))
    }
}

/// Reads the journal at `path`: `None` when there is none.
pub fn load(path: &Path) -> Result<Option<Record>, JournalError> {
    let name = path.display().to_string();
    let io = |source| JournalError::Io { path: name.clone(), source };
    let f = match std::fs::OpenOptions::new().read(true).custom_flags(nofollow()).open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) if e.raw_os_error() == Some(rustix::io::Errno::LOOP.raw_os_error()) => {
            return Err(JournalError::Corrupt {
                path: name,
                why: "it is a symbolic link, which ferry never makes (and does not follow); remove it".into(),
            })
        }
        Err(e) => return Err(io(e)),
    };
    let meta = f.metadata().map_err(io)?;
    if !meta.is_file() {
        return Err(JournalError::Corrupt { path: name, why: "it is not a regular file".into() });
    }
    // A journal says how much of the destination is done: one that another user could
    // have written (planted beside a destination in /tmp, or made writable to others)
    // would make a copy skip what it never wrote. ferry makes journals 0600, its own.
    use std::os::unix::fs::MetadataExt;
    if !ours(path, meta.uid(), meta.mode()) {
        let me = rustix::process::geteuid().as_raw();
        return Err(JournalError::Corrupt {
            path: name,
            why: format!(
                "it is owned by uid {} with mode {:o}, where ferry makes journals its user's own (uid {me}, 0600): \
                 another user could have written it; if it is yours (a run as another user), chown it to uid \
                 {me} and chmod it 600, or --restart",
                meta.uid(),
                meta.mode() & 0o7777
            ),
        });
    }
    let len = meta.len();
    if len > MAX_JOURNAL_BYTES {
        return Err(JournalError::Corrupt {
            path: name,
            why: format!("it is {len} bytes, more than a journal's {MAX_JOURNAL_BYTES}"),
        });
    }
    let mut bytes = Vec::with_capacity(len as usize);
    io::Read::read_to_end(&mut io::Read::take(f, MAX_JOURNAL_BYTES + 1), &mut bytes).map_err(io)?;
    Record::decode(&bytes).map(Some).map_err(|why| JournalError::Corrupt { path: name, why })
}

/// Removes the journal at `path`, if there is one (a link there goes, not what it
/// points at), and what stores killed half-way left beside it.
pub fn remove(path: &Path) -> Result<(), JournalError> {
    remove_tmp_files(path);
    match std::fs::remove_file(path) {
        Ok(()) => sync_dir(path).map_err(|source| JournalError::Io { path: path.display().to_string(), source }),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(JournalError::Io { path: path.display().to_string(), source }),
    }
}

fn sync_dir(path: &Path) -> io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    std::fs::File::open(dir)?.sync_all()
}

/// `O_NOFOLLOW`: a symbolic link at the path fails the open.
fn nofollow() -> i32 {
    rustix::fs::OFlags::NOFOLLOW.bits() as i32
}

/// A name for a temporary file beside the journal: `JOURNAL.RANDOM.tmp`. The random part
/// comes from the standard library's per-process hash keys (seeded by the OS), the time
/// and a counter; `O_EXCL` makes a name that exists anyway fail, and another is tried.
fn tmp_path(path: &Path) -> PathBuf {
    use std::hash::{BuildHasher, Hasher};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.write_u32(std::process::id());
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".{:016x}.tmp", h.finish()));
    PathBuf::from(tmp)
}

/// Whether `p` is a temporary file of a store of the journal at `path`.
fn is_tmp_of(path: &Path, p: &Path) -> bool {
    let (Some(name), Some(other)) = (path.file_name(), p.file_name()) else { return false };
    let (name, other) = (name.to_string_lossy(), other.to_string_lossy());
    other
        .strip_prefix(name.as_ref())
        .and_then(|r| r.strip_prefix('.'))
        .and_then(|r| r.strip_suffix(".tmp"))
        .is_some_and(|r| r.len() == 16 && r.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// Removes what stores killed half-way left beside the journal at `path` (regular files
/// only; a link planted under such a name goes, not what it points at).
fn remove_tmp_files(path: &Path) {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        if is_tmp_of(path, &e.path()) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// Writes `record` to `path` atomically: a new temporary file (random name, `O_EXCL`,
/// `O_NOFOLLOW`, mode 0600), fsync, rename over the journal (which replaces a link there
/// rather than writing through it), fsync of the directory.
/// A new temporary file beside the journal, 0600, made with `O_EXCL|O_NOFOLLOW` under a
/// random name (another is tried if one is taken).
fn create_tmp(path: &Path) -> io::Result<(PathBuf, std::fs::File)> {
    let mut tries = 0;
    loop {
        let tmp = tmp_path(path);
        match std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).custom_flags(nofollow()).open(&tmp) {
            Ok(f) => return Ok((tmp, f)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && tries < 8 => tries += 1,
            Err(e) => return Err(e),
        }
    }
}

/// Whether a journal with owner `uid` and `mode` is one this user's ferry could have
/// made at `path`: owned by the effective user with no write bit for group or others, or
/// else the same as a file ferry makes beside it now (a filesystem that maps owners or
/// forces modes: NFS with root_squash, sshfs, CIFS, FAT and NTFS mounts).
fn ours(path: &Path, uid: u32, mode: u32) -> bool {
    use std::os::unix::fs::MetadataExt;
    if uid == rustix::process::geteuid().as_raw() && mode & 0o022 == 0 {
        return true;
    }
    let Ok((tmp, f)) = create_tmp(path) else { return false };
    let probe = f.metadata();
    let _ = std::fs::remove_file(&tmp);
    probe.is_ok_and(|p| p.uid() == uid && (mode & 0o022 == 0 || p.mode() & 0o022 != 0))
}

pub fn store(path: &Path, record: &Record) -> Result<(), JournalError> {
    let err = |source| JournalError::Io { path: path.display().to_string(), source };
    let (tmp, mut f) = create_tmp(path).map_err(err)?;
    let mut write = || -> io::Result<()> {
        f.write_all(&record.encode())?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        sync_dir(path)
    };
    write().map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        err(e)
    })
}

/// A copy's journal as the engine keeps it: where it is, the key it was opened with,
/// where a resumed copy starts, and when to store the next watermark.
#[derive(Debug)]
pub struct Journal {
    path: PathBuf,
    key: Record,
    /// The stored record this copy resumes (watermark, zeroed flag), if any.
    resumed: Option<Record>,
    every_bytes: u64,
    every_time: Duration,
    /// Watermark last stored, and when; progress bytes then.
    last: Mutex<(u64, Instant)>,
    last_done: AtomicU64,
}

impl Journal {
    /// A journal at `path` for the copy `key` (its watermark and zeroed flag are
    /// ignored): reads a stored one, which must be of the same copy, to resume from.
    /// `restart` deletes a stored one first.
    pub fn open(path: PathBuf, key: Record, restart: bool) -> Result<Journal, JournalError> {
        if restart {
            remove(&path)?;
        }
        let resumed = match load(&path)? {
            Some(r) => {
                if let Some(why) = r.differs(&key) {
                    return Err(JournalError::Mismatch { path: path.display().to_string(), why });
                }
                Some(r)
            }
            None => None,
        };
        Ok(Journal::with(path, key, resumed))
    }

    fn with(path: PathBuf, key: Record, resumed: Option<Record>) -> Journal {
        Journal {
            path,
            key,
            every_bytes: DEFAULT_INTERVAL_BYTES,
            every_time: DEFAULT_INTERVAL_TIME,
            last: Mutex::new((resumed.as_ref().map_or(0, |r| r.watermark), Instant::now())),
            last_done: AtomicU64::new(resumed.as_ref().map_or(0, |r| r.watermark)),
            resumed,
        }
    }

    /// Stores a new watermark after at least `bytes` of progress or `time`, whichever
    /// comes first (at least 1 byte; the time at least 1 ms).
    pub fn interval(mut self, bytes: u64, time: Duration) -> Journal {
        self.every_bytes = bytes.max(1);
        self.every_time = time.max(Duration::from_millis(1));
        self
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The stored journal this copy continues: (watermark, destination zeroed).
    pub fn resumed(&self) -> Option<(u64, bool)> {
        self.resumed.as_ref().map(|r| (r.watermark, r.destination_zeroed))
    }

    /// The source size the journal is keyed by, to check against the opened source.
    pub fn source_size(&self) -> u64 {
        self.key.source_size
    }

    /// Whether a watermark is due, given the progress counter.
    pub(crate) fn due(&self, done: u64) -> bool {
        let last = self.last_done.load(Ordering::Relaxed);
        if done.saturating_sub(last) >= self.every_bytes {
            return true;
        }
        done != last && self.last.lock().unwrap_or_else(|e| e.into_inner()).1.elapsed() >= self.every_time
    }

    /// Stores watermark `w` (every byte below it flushed at the destination).
    pub(crate) fn store(&self, w: u64, zeroed: bool, done: u64) -> Result<(), JournalError> {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        self.last_done.store(done, Ordering::Relaxed);
        last.1 = Instant::now();
        if w < last.0 || (w == last.0 && w != 0) {
            return Ok(());
        }
        let r = Record { watermark: w, destination_zeroed: zeroed, ..self.key.clone() };
        store(&self.path, &r)?;
        last.0 = w;
        Ok(())
    }

    /// The copy is complete and flushed: the journal goes.
    pub(crate) fn finish(&self) -> Result<(), JournalError> {
        remove(&self.path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec() -> Record {
        Record {
            ferry_version: "0.1.0".into(),
            source: "file:/a b\\c\nd size=5".into(),
            destination: "nbd://h/x".into(),
            options: "request-size=1048576 sparse=true".into(),
            source_size: 1 << 30,
            watermark: 4 << 20,
            destination_zeroed: true,
        }
    }

    #[test]
    fn crc32_check_value() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
        assert_eq!(crc32(b""), 0);
    }

    #[test]
    fn records_round_trip_and_damage_is_found() {
        let r = rec();
        let b = r.encode();
        assert_eq!(Record::decode(&b).unwrap(), r);
        // Every single flipped bit and every truncation is refused.
        for i in 0..b.len() {
            for bit in 0..8 {
                let mut c = b.clone();
                c[i] ^= 1 << bit;
                assert!(Record::decode(&c).is_err(), "flip of bit {bit} of byte {i} not detected");
            }
            assert!(Record::decode(&b[..i]).is_err(), "truncation to {i} bytes not detected");
        }
        assert!(Record::decode(b"").unwrap_err().contains("checksum"));
        let mut past = r.clone();
        past.watermark = past.source_size + 1;
        assert!(Record::decode(&past.encode()).unwrap_err().contains("past the end"));
    }

    #[test]
    fn differences_are_named() {
        let r = rec();
        assert_eq!(r.differs(&Record { watermark: 0, destination_zeroed: false, ..r.clone() }), None);
        let v = r.differs(&Record { ferry_version: "9.9.9".into(), ..r.clone() }).unwrap();
        assert!(v.contains("ferry 0.1.0") && v.contains("9.9.9"), "{v}");
        let s = r.differs(&Record { source: "other".into(), options: "x".into(), ..r.clone() }).unwrap();
        assert!(s.contains("source") && s.contains("options"), "{s}");
    }

    #[test]
    fn identities_are_shown_without_secrets() {
        assert_eq!(
            redacted("http://u:pa%40ss@h:8/a/b.raw?X-Amz-Signature=s#f size=5 etag=\"x\""),
            "http://h:8/a/b.raw size=5 etag=\"x\""
        );
        assert_eq!(redacted("file:/a?b dev=1 ino=2"), "file:/a?b dev=1 ino=2");
        assert_eq!(redacted("s3://bucket/key upload=ID"), "s3://bucket/key upload=ID");
        let r = Record { source: "https://u:secret@h/x?tok=secret".into(), ..rec() };
        let d = r.differs(&Record { source: "https://h/y".into(), ..rec() }).unwrap();
        assert!(!d.contains("secret") && d.contains("https://h/x"), "{d}");
    }

    #[test]
    fn links_at_the_journal_path_are_neither_followed_nor_written_through() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("target");
        std::fs::write(&target, b"precious").unwrap();
        let p = dir.path().join("j");
        std::os::unix::fs::symlink(&target, &p).unwrap();
        let e = load(&p).unwrap_err().to_string();
        assert!(e.contains("symbolic link"), "{e}");
        let e = Journal::open(p.clone(), rec(), false).unwrap_err().to_string();
        assert!(e.contains("symbolic link"), "{e}");
        store(&p, &rec()).unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"precious", "written through the link");
        assert!(!std::fs::symlink_metadata(&p).unwrap().file_type().is_symlink());
        assert_eq!(load(&p).unwrap(), Some(rec()));
        // A link planted where a temporary file of a store could be is not written either.
        std::os::unix::fs::symlink(&target, dir.path().join("j.0123456789abcdef.tmp")).unwrap();
        remove(&p).unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"precious");
        assert!(!dir.path().join("j.0123456789abcdef.tmp").exists());
    }

    #[test]
    fn store_load_open_remove() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("j");
        assert!(load(&p).unwrap().is_none());
        let key = Record { watermark: 0, destination_zeroed: false, ..rec() };
        let j = Journal::open(p.clone(), key.clone(), false).unwrap();
        assert_eq!(j.resumed(), None);
        j.store(0, true, 0).unwrap();
        j.store(8 << 20, true, 8 << 20).unwrap();
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(left, vec![std::ffi::OsString::from("j")], "temporary files left");
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(&p).unwrap().permissions().mode() & 0o777, 0o600);
        let j2 = Journal::open(p.clone(), key.clone(), false).unwrap();
        assert_eq!(j2.resumed(), Some((8 << 20, true)));
        let other = Record { destination: "elsewhere".into(), ..key.clone() };
        let e = Journal::open(p.clone(), other.clone(), false).unwrap_err().to_string();
        assert!(e.contains("does not match") && e.contains("--restart"), "{e}");
        let j3 = Journal::open(p.clone(), other, true).unwrap();
        assert_eq!(j3.resumed(), None);
        assert!(!p.exists());
        std::fs::write(&p, vec![b'x'; MAX_JOURNAL_BYTES as usize + 1]).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        let e = load(&p).unwrap_err().to_string();
        assert!(e.contains("more than a journal"), "{e}");
        j2.finish().unwrap();
        assert!(!p.exists());
    }

    /// A journal another user could have written is not trusted: writable by group or
    /// others, or owned by another user (a file planted beside a destination in /tmp).
    #[test]
    fn a_journal_others_could_write_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("j");
        let key = Record { watermark: 0, destination_zeroed: false, ..rec() };
        Journal::open(p.clone(), key.clone(), false).unwrap().store(8 << 20, true, 8 << 20).unwrap();
        assert!(load(&p).unwrap().is_some());
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o622)).unwrap();
        let e = load(&p).unwrap_err().to_string();
        assert!(e.contains("another user could have written it"), "{e}");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(load(&p).unwrap().is_some());
        // Owned by someone else (the suite runs as root, which can give it away).
        if rustix::process::geteuid().is_root() {
            std::os::unix::fs::chown(&p, Some(65534), None).unwrap();
            let e = load(&p).unwrap_err().to_string();
            assert!(e.contains("owned by uid 65534"), "{e}");
        }
    }
}
