//! `qemu:allocation-depth`: which layer of the backing chain allocates each range, as
//! qemu-nbd `-A` reports it. 0: no layer does (reads as zeroes); 1: this image does (data,
//! compressed or zero clusters alike); 2: its backing file; and so on. A raw backing
//! file allocates its whole size. Past the end of a shorter backing file the zeroes count
//! as that short layer's (qemu's rule), whatever lies below it.

use crate::{Mapping, Qcow2, Qcow2Error};
use ferry_backend::{push_extent, Extent, MetaContext};
use std::sync::Arc;

/// The `qemu:allocation-depth` context of one image.
struct AllocationDepth(Arc<Qcow2>);

impl MetaContext for AllocationDepth {
    fn name(&self) -> &str {
        ferry_proto::consts::META_ALLOCATION_DEPTH
    }
    fn extents(&self, offset: u64, length: u64, max: usize, out: &mut Vec<Extent>) -> ferry_backend::Result<()> {
        let mut v = Vec::new();
        self.0
            .depth_extents(offset, length, max.max(1), &mut v)
            .map_err(|e| self.0.to_backend_error("block status", offset, length, e))?;
        out.extend(v);
        Ok(())
    }
}

impl Qcow2 {
    /// This image's `qemu:allocation-depth` context.
    pub fn allocation_depth(self: &Arc<Qcow2>) -> Arc<dyn MetaContext> {
        Arc::new(AllocationDepth(self.clone()))
    }

    /// Appends to the empty `out` at most `max` (at least 1) extents from `offset`, each
    /// with its depth in `flags`, covering at most `length` bytes.
    fn depth_extents(&self, offset: u64, length: u64, max: usize, out: &mut Vec<Extent>) -> Result<(), Qcow2Error> {
        // This layer's map as runs of (length, allocated here).
        let mut runs: Vec<(u64, bool)> = Vec::new();
        {
            let mut st = self.lock();
            self.walk(&mut st, offset, length, |n, m| {
                let here = m != Mapping::Unallocated;
                match runs.last_mut() {
                    Some((l, last)) if *last == here => *l += n,
                    _ => runs.push((n, here)),
                }
                runs.len() <= max
            })?;
        }
        let mut pos = offset;
        for (n, here) in runs {
            if out.len() >= max {
                break;
            }
            let Some(bk) = self.backing.as_ref().filter(|_| !here) else {
                push_extent(out, n, if here { 1 } else { 0 });
                pos += n;
                continue;
            };
            let inside = bk.size().saturating_sub(pos).min(n);
            match &self.backing_image {
                Some(q) if inside > 0 => {
                    let mut sub = Vec::new();
                    q.depth_extents(pos, inside, max - out.len(), &mut sub)?;
                    let mut covered = 0;
                    for e in sub {
                        let l = e.length.min(inside - covered);
                        push_extent(out, l, if e.flags == 0 { 0 } else { e.flags + 1 });
                        covered += l;
                    }
                    if covered < inside {
                        break;
                    }
                }
                // A raw backing file allocates all of its size.
                _ => push_extent(out, inside, 2),
            }
            // Past the end of the backing file: its (synthesized) zeroes.
            push_extent(out, n - inside, 2);
            pos += n;
        }
        out.truncate(max);
        Ok(())
    }
}
