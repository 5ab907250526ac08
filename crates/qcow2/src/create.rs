//! New images: `Qcow2::create` lays out a version 3 image (header, refcount table, L1
//! table, refcount blocks) that qemu-img check accepts, then opens it writable;
//! `Qcow2::create_with` also names a backing file (an overlay).

use crate::header::{encode_backing, encode_v3, MAX_L1_BYTES, MAX_REFTABLE_BYTES};
use crate::{has_qcow2_magic, io_err, Qcow2, Qcow2Error};
use ferry_backend::{Access, FileId, ImageUse};
use std::os::unix::fs::FileExt;
use std::path::{Component, Path, PathBuf};

/// The backing file of a new image, as its header names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backing {
    /// The name stored: a relative name is resolved against the new image's directory.
    pub name: String,
    /// `qcow2` or `raw`.
    pub format: String,
}

impl Backing {
    /// `file` as the backing file of a new image at `image`: named relative to the
    /// image's directory when the two share a directory above the root (so they can be
    /// moved together), by its absolute path otherwise; its format probed (the qcow2
    /// magic, else raw). `file` must exist.
    pub fn for_image(file: &Path, image: &Path) -> Result<Backing, Qcow2Error> {
        let abs = file.canonicalize().map_err(io_err(format!("cannot open backing file {}", file.display())))?;
        let format = if has_qcow2_magic(&abs) { "qcow2" } else { "raw" }.to_string();
        let dir = match image.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let name = match dir.canonicalize() {
            Ok(d) => relative(&abs, &d).unwrap_or_else(|| abs.clone()),
            Err(_) => abs,
        };
        let name = name
            .into_os_string()
            .into_string()
            .map_err(|n| Qcow2Error::Invalid(format!("backing file name {n:?} is not UTF-8")))?;
        Ok(Backing { name, format })
    }
}

/// The files of the backing chain `b` names for a new image at `path`.
fn backing_files(path: &Path, b: &Backing) -> Result<Vec<FileId>, Qcow2Error> {
    let name = Path::new(&b.name);
    let p = match path.parent() {
        Some(d) if name.is_relative() => d.join(name),
        _ => name.to_path_buf(),
    };
    let what = format!("cannot open backing file {}", p.display());
    if b.format == "qcow2" {
        let opts = crate::Options { read_only: true, ..Default::default() };
        let q = Qcow2::open_for(&p, &opts, ImageUse::new(Access::Inspect)).map_err(|e| match e {
            Qcow2Error::Io { what: w, source } => Qcow2Error::Io { what: format!("backing file: {w}"), source },
            other => Qcow2Error::Invalid(format!("backing file {}: {other}", p.display())),
        })?;
        Ok(q.open_files().iter().map(|f| f.id).collect())
    } else {
        Ok(vec![FileId::of_path(&p).map_err(io_err(what))?])
    }
}

/// `target` relative to the directory `base` (both absolute and canonical), when they
/// share more than the root.
fn relative(target: &Path, base: &Path) -> Option<PathBuf> {
    let t: Vec<Component> = target.components().collect();
    let b: Vec<Component> = base.components().collect();
    let common = t.iter().zip(&b).take_while(|(x, y)| x == y).count();
    if common < 2 {
        return None;
    }
    let mut out = PathBuf::new();
    for _ in common..b.len() {
        out.push("..");
    }
    for c in &t[common..] {
        out.push(c);
    }
    Some(out)
}

impl Qcow2 {
    /// Creates (or truncates) `path` as an empty qcow2 image of `size` bytes with
    /// `cluster_size`-byte clusters (a power of two, 512 B to 2 MiB), opened writable.
    pub fn create(path: &Path, size: u64, cluster_size: u64) -> Result<Qcow2, Qcow2Error> {
        Self::create_with(path, size, cluster_size, None)
    }

    /// [`Qcow2::create`], with a backing file when given: the new image is an overlay
    /// (unallocated clusters read the backing file), opened writable with its backing
    /// chain (read-only, locked as a backing file). The backing file may be any size.
    pub fn create_with(
        path: &Path,
        size: u64,
        cluster_size: u64,
        backing: Option<&Backing>,
    ) -> Result<Qcow2, Qcow2Error> {
        if !cluster_size.is_power_of_two() || !(512..=2 << 20).contains(&cluster_size) {
            return Err(Qcow2Error::Invalid(format!(
                "cluster size {cluster_size} is not a power of two from 512 to 2M"
            )));
        }
        let cs = cluster_size;
        let bits = cs.trailing_zeros();
        let l2_span = (cs / 8) * cs;
        let l1_size = size.div_ceil(l2_span).max(1);
        if l1_size * 8 > MAX_L1_BYTES {
            return Err(Qcow2Error::Invalid(format!(
                "{size} bytes is too large for {cs}-byte clusters; use larger clusters"
            )));
        }
        let l1_clusters = (l1_size * 8).div_ceil(cs);
        let per_block = cs / 2;
        let (mut rt, mut rb) = (1u64, 1u64);
        loop {
            let total = 1 + rt + l1_clusters + rb;
            let rb2 = total.div_ceil(per_block);
            let rt2 = (rb2 * 8).div_ceil(cs);
            if (rb2, rt2) == (rb, rt) {
                break;
            }
            (rb, rt) = (rb2, rt2);
        }
        if rt * cs > MAX_REFTABLE_BYTES {
            return Err(Qcow2Error::Invalid(
                "the refcount table would be larger than 8 MiB; use larger clusters".into(),
            ));
        }
        let total = 1 + rt + l1_clusters + rb;
        let rt_off = cs;
        let l1_off = (1 + rt) * cs;
        let rb_off = (1 + rt + l1_clusters) * cs;
        let mut header = encode_v3(size, bits, l1_size as u32, l1_off, rt_off, rt as u32);
        if let Some(b) = backing {
            if b.format != "qcow2" && b.format != "raw" {
                return Err(Qcow2Error::Unsupported(format!(
                    "backing format {:?} (ferry writes overlays of qcow2 and raw files)",
                    b.format
                )));
            }
            encode_backing(&mut header, &b.name, &b.format, cs)?;
        }
        // The backing chain's files, found before `path` is touched: the new image must
        // not be one of them (emptying it would destroy what it is to read).
        let chain = match backing {
            Some(b) => backing_files(path, b)?,
            None => Vec::new(),
        };
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(io_err(format!("cannot create {}", path.display())))?;
        // Locked before it is emptied: a file another program holds is left alone.
        ferry_backend::lock::lock(&f, path, ImageUse::new(Access::Destination).qcow2())
            .map_err(|e| io_err(format!("cannot create {}", path.display()))(e.into()))?;
        let id = FileId::of(&f).map_err(io_err(format!("cannot create {}", path.display())))?;
        if chain.contains(&id) {
            return Err(Qcow2Error::Invalid(format!(
                "{} is in its own backing chain: creating it would destroy the backing file's data",
                path.display()
            )));
        }
        f.set_len(0).map_err(io_err(format!("cannot empty {}", path.display())))?;
        let w = |b: &[u8], at: u64| f.write_all_at(b, at).map_err(io_err(format!("cannot write {}", path.display())));
        f.set_len(total * cs).map_err(io_err(format!("cannot size {}", path.display())))?;
        w(&header, 0)?;
        let table: Vec<u8> = (0..rb).flat_map(|i| (rb_off + i * cs).to_be_bytes()).collect();
        w(&table, rt_off)?;
        let counts: Vec<u8> = (0..total).flat_map(|_| 1u16.to_be_bytes()).collect();
        w(&counts, rb_off)?;
        f.sync_all().map_err(io_err(format!("cannot sync {}", path.display())))?;
        drop(f);
        Qcow2::open(path, false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_backend::{Backend, ZeroMode};

    #[test]
    fn relative_names() {
        let r = |t: &str, b: &str| relative(Path::new(t), Path::new(b)).map(|p| p.display().to_string());
        assert_eq!(r("/a/b/base.raw", "/a/b").as_deref(), Some("base.raw"));
        assert_eq!(r("/a/base/x.qcow2", "/a/b/c").as_deref(), Some("../../base/x.qcow2"));
        assert_eq!(r("/a/b/c/x", "/a").as_deref(), Some("b/c/x"));
        assert_eq!(r("/dev/sdb", "/home/u"), None);
    }

    #[test]
    fn overlay_reads_through_where_unwritten() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("base")).unwrap();
        std::fs::create_dir(d.path().join("top")).unwrap();
        let raw = d.path().join("base/b.raw");
        std::fs::write(&raw, vec![0xaa; 1 << 20]).unwrap();
        let top = d.path().join("top/o.qcow2");
        let b = Backing::for_image(&raw, &top).unwrap();
        assert_eq!(b, Backing { name: "../base/b.raw".into(), format: "raw".into() });
        {
            let q = Qcow2::create_with(&top, 2 << 20, 65536, Some(&b)).unwrap();
            assert_eq!(q.info().backing_chain.len(), 1);
            q.write(&[1u8; 1000], 70_000, false).unwrap();
            q.zero(131_072, 65536, ZeroMode { may_trim: true, fast: false }, false).unwrap();
            q.zero(300_000, 100, ZeroMode { may_trim: true, fast: false }, false).unwrap();
        }
        let check = |q: &Qcow2| {
            let mut buf = vec![0u8; 2 << 20];
            q.read(&mut buf, 0).unwrap();
            for (i, &x) in buf.iter().enumerate() {
                let want = match i {
                    70_000..71_000 => 1,
                    131_072..196_608 | 300_000..300_100 => 0,
                    _ if i >= 1 << 20 => 0,
                    _ => 0xaa,
                };
                assert_eq!(x, want, "byte {i}");
            }
        };
        let q = Qcow2::open(&top, true).unwrap();
        check(&q);
        // A qcow2 backing file, named from the same directory.
        let top2 = d.path().join("top/o2.qcow2");
        let b2 = Backing::for_image(&top, &top2).unwrap();
        assert_eq!(b2, Backing { name: "o.qcow2".into(), format: "qcow2".into() });
        drop(q);
        let q2 = Qcow2::create_with(&top2, 2 << 20, 4096, Some(&b2)).unwrap();
        assert_eq!(q2.info().backing_chain.len(), 2);
        check(&q2);
    }

    fn err(r: Result<Qcow2, Qcow2Error>) -> String {
        r.err().expect("an error").to_string()
    }

    #[test]
    fn refuses_missing_and_own_backing_files() {
        let d = tempfile::tempdir().unwrap();
        let img = d.path().join("a.qcow2");
        let e = Backing::for_image(&d.path().join("nope.raw"), &img).unwrap_err().to_string();
        assert!(e.contains("cannot open backing file") && e.contains("nope.raw"), "{e}");
        let b = Backing { name: "nope.raw".into(), format: "raw".into() };
        assert!(Qcow2::create_with(&img, 1 << 20, 65536, Some(&b)).is_err());
        assert!(!img.exists());
        // The image itself, and an image whose backing file is the new image.
        drop(Qcow2::create(&img, 1 << 20, 65536).unwrap());
        let b = Backing::for_image(&img, &img).unwrap();
        let e = err(Qcow2::create_with(&img, 1 << 20, 65536, Some(&b)));
        assert!(e.contains("own backing chain"), "{e}");
        let over = d.path().join("over.qcow2");
        drop(Qcow2::create_with(&over, 1 << 20, 65536, Some(&b)).unwrap());
        let b = Backing::for_image(&over, &img).unwrap();
        let e = err(Qcow2::create_with(&img, 1 << 20, 65536, Some(&b)));
        assert!(e.contains("own backing chain"), "{e}");
        assert!(Qcow2::open(&over, true).is_ok());
        let b = Backing { name: "x".into(), format: "vmdk".into() };
        assert!(err(Qcow2::create_with(&over, 1 << 20, 65536, Some(&b))).contains("vmdk"));
    }
}
