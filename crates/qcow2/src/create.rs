//! New images: `Qcow2::create` lays out a version 3 image (header, refcount table, L1
//! table, refcount blocks) that qemu-img check accepts, then opens it writable.

use crate::header::{encode_v3, MAX_L1_BYTES, MAX_REFTABLE_BYTES};
use crate::{io_err, Qcow2, Qcow2Error};
use ferry_backend::{Access, ImageUse};
use std::os::unix::fs::FileExt;
use std::path::Path;

impl Qcow2 {
    /// Creates (or truncates) `path` as an empty qcow2 image of `size` bytes with
    /// `cluster_size`-byte clusters (a power of two, 512 B to 2 MiB), opened writable.
    pub fn create(path: &Path, size: u64, cluster_size: u64) -> Result<Qcow2, Qcow2Error> {
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
        f.set_len(0).map_err(io_err(format!("cannot empty {}", path.display())))?;
        let w = |b: &[u8], at: u64| f.write_all_at(b, at).map_err(io_err(format!("cannot write {}", path.display())));
        f.set_len(total * cs).map_err(io_err(format!("cannot size {}", path.display())))?;
        w(&encode_v3(size, bits, l1_size as u32, l1_off, rt_off, rt as u32), 0)?;
        let table: Vec<u8> = (0..rb).flat_map(|i| (rb_off + i * cs).to_be_bytes()).collect();
        w(&table, rt_off)?;
        let counts: Vec<u8> = (0..total).flat_map(|_| 1u16.to_be_bytes()).collect();
        w(&counts, rb_off)?;
        f.sync_all().map_err(io_err(format!("cannot sync {}", path.display())))?;
        drop(f);
        Qcow2::open(path, false)
    }
}
