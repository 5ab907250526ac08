//! Any [`Backend`] (a disk image format, a network store) as a copy source or
//! destination. Backends are `Send + Sync`, so every worker shares the one object.

use super::endpoint::{push_extent, read_each, write_each, Caps, Data, Done, Map, Ops, Read, Write};
use super::{contexts, CopyError};
use ferry_backend::{Backend, Extent, ZeroMode};
use ferry_sock::AlignedBuf;
use std::sync::Arc;

/// A [`Backend`] as a copy source or destination, shared by every worker.
///
/// As a source its `extents` are the allocation map (holes and zero extents are not
/// read); as a destination it must be at least as large as the source and writable, and
/// zeroes go through `Backend::zero` (which may deallocate) where the backend declares
/// it, as data otherwise.
#[derive(Clone)]
pub struct BackendEndpoint {
    name: String,
    backend: Arc<dyn Backend>,
    zeroed: bool,
}

impl BackendEndpoint {
    /// `name` is what error messages call it (usually the path or spec it was opened from).
    pub fn new(name: String, backend: Arc<dyn Backend>) -> BackendEndpoint {
        BackendEndpoint { name, backend, zeroed: false }
    }

    /// Declares that the backend reads as zeroes everywhere (it was just created), so as a
    /// destination its holes and zero blocks need no writing.
    pub fn zeroed(mut self) -> BackendEndpoint {
        self.zeroed = true;
        self
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }
}

impl std::fmt::Debug for BackendEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BackendEndpoint").field("name", &self.name).field("backend", &self.backend.describe()).finish()
    }
}

/// The same name and the same backend object.
impl PartialEq for BackendEndpoint {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name && self.zeroed == other.zeroed && Arc::ptr_eq(&self.backend, &other.backend)
    }
}

impl Eq for BackendEndpoint {}

impl Ops for BackendEndpoint {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn size(&self) -> Option<u64> {
        Some(self.backend.size())
    }

    fn caps(&self) -> Caps {
        let c = self.backend.caps();
        Caps {
            parallel: true,
            zero: c.zero,
            zeroed: self.zeroed,
            extents: true,
            read_only: c.read_only,
            ..Caps::default()
        }
    }

    fn reopen(&self) -> Result<Box<dyn Ops>, CopyError> {
        Ok(Box::new(self.clone()))
    }

    /// From `Backend::extents`, asked again from where each answer stopped.
    fn extents(&mut self, size: u64) -> Result<Map, CopyError> {
        let mut out = Map::new();
        let mut ex: Vec<Extent> = Vec::new();
        let mut pos = 0;
        while pos < size {
            ex.clear();
            self.backend
                .extents(pos, size - pos, 1 << 16, &mut ex)
                .map_err(|e| CopyError::request("extents", pos, size - pos, e))?;
            let before = pos;
            for Extent { length, flags } in ex.drain(..) {
                let length = length.min(size - pos);
                if length == 0 {
                    break;
                }
                push_extent(&mut out, pos, length, flags);
                pos += length;
            }
            if pos == before {
                return Err(CopyError::Setup(format!("source {} reported no extent at offset {pos}", self.name)));
            }
        }
        Ok(out)
    }

    fn select(&mut self, context: &str, mask: u32, size: u64) -> Result<Map, CopyError> {
        let names = [ferry_proto::consts::META_BASE_ALLOCATION.to_string(), context.to_string()];
        let ctxs = contexts::local_contexts(&self.backend, &self.name, &names)
            .map_err(|e| CopyError::Setup(format!("source {e}")))?;
        contexts::select_map(size, u64::MAX, true, mask, |pos, len| contexts::local_fetch(&ctxs, pos, len))
            .map_err(|e| CopyError::Setup(format!("source {}: {context}: {e}", self.name)))
    }

    fn read(&mut self, reqs: &[Read], bufs: &mut [AlignedBuf], done: &mut Done<'_>) -> Result<(), CopyError> {
        read_each(reqs, bufs, done, |buf, at| self.backend.read(buf, at))
    }

    fn write(&mut self, reqs: &[Write<'_>], done: &mut Done<'_>) -> Result<(), CopyError> {
        let b = &self.backend;
        // A backend must never see a range past its end; only a stream (stdin, whose
        // size is not known before) can get there.
        let size = b.size();
        if let Some(w) = reqs.iter().find(|w| w.offset.checked_add(w.len()).is_none_or(|end| end > size)) {
            return Err(CopyError::Setup(format!(
                "destination {} is {size} bytes; the input goes on past its end ({} bytes at offset {}): \
                 make it larger",
                self.name,
                w.len(),
                w.offset
            )));
        }
        write_each(reqs, done, |w| match w.data {
            Data::Bytes(d) => b.write(d, w.offset, false).map_err(|e| e.to_string()),
            Data::Zero(n) => {
                b.zero(w.offset, n, ZeroMode { may_trim: true, fast: false }, false).map_err(|e| e.to_string())
            }
            Data::File { .. } => Err("a backend takes no file payloads".into()),
        })
    }

    fn flush(&mut self) -> Result<(), CopyError> {
        self.backend.flush().map_err(|e| CopyError::request("flush", 0, 0, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_backend::{MemoryBackend, MetaContext};
    use std::sync::Mutex;

    const K: u64 = 1024;

    /// 1 MiB: data in the first half, a hole in the second; a dirty bitmap `t` marks
    /// 64K..128K (data) and 600K..700K (hole). Every read is recorded.
    struct Marked {
        mem: MemoryBackend,
        reads: Mutex<Vec<(u64, u64)>>,
    }

    struct Dirty;
    impl MetaContext for Dirty {
        fn name(&self) -> &str {
            "qemu:dirty-bitmap:t"
        }
        fn extents(&self, offset: u64, length: u64, _max: usize, out: &mut Vec<Extent>) -> ferry_backend::Result<()> {
            // Answers in small pieces, to make the walk step.
            let layout = [
                (0, 64 * K, 0),
                (64 * K, 128 * K, 1),
                (128 * K, 600 * K, 0),
                (600 * K, 700 * K, 1),
                (700 * K, 1024 * K, 0),
            ];
            let &(_, e, f) = layout.iter().find(|l| l.0 <= offset && offset < l.1).unwrap();
            out.push(Extent { length: (e - offset).min(length), flags: f });
            Ok(())
        }
    }

    impl Backend for Marked {
        fn describe(&self) -> String {
            "marked".into()
        }
        fn size(&self) -> u64 {
            self.mem.size()
        }
        fn caps(&self) -> ferry_backend::Capabilities {
            self.mem.caps()
        }
        fn read(&self, buf: &mut [u8], offset: u64) -> ferry_backend::Result<()> {
            self.reads.lock().unwrap().push((offset, buf.len() as u64));
            self.mem.read(buf, offset)
        }
        fn write(&self, buf: &[u8], offset: u64, fua: bool) -> ferry_backend::Result<()> {
            self.mem.write(buf, offset, fua)
        }
        fn flush(&self) -> ferry_backend::Result<()> {
            Ok(())
        }
        fn trim(&self, offset: u64, length: u64, fua: bool) -> ferry_backend::Result<()> {
            self.mem.trim(offset, length, fua)
        }
        fn zero(&self, offset: u64, length: u64, mode: ZeroMode, fua: bool) -> ferry_backend::Result<()> {
            self.mem.zero(offset, length, mode, fua)
        }
        fn extents(&self, offset: u64, length: u64, _max: usize, out: &mut Vec<Extent>) -> ferry_backend::Result<()> {
            let half = 512 * K;
            if offset < half {
                out.push(Extent { length: (half - offset).min(length), flags: 0 });
            } else {
                out.push(Extent { length, flags: ferry_backend::HOLE });
            }
            Ok(())
        }
        fn meta_contexts(self: Arc<Self>) -> Vec<Arc<dyn MetaContext>> {
            vec![Arc::new(Dirty)]
        }
    }

    #[test]
    fn selected_copies_touch_only_the_selection_and_read_only_its_data() {
        use crate::copy::{copy, CopyOptions, Endpoint, Progress};
        let src = Arc::new(Marked { mem: MemoryBackend::new(1024 * K), reads: Mutex::new(Vec::new()) });
        let data: Vec<u8> = (0..512 * K).map(|i| (i % 251) as u8 + 1).collect();
        src.mem.write(&data, 0, false).unwrap();
        let by_bitmap = CopyOptions { select_context: Some("qemu:dirty-bitmap:t".into()), ..CopyOptions::default() };
        let by_list = CopyOptions {
            ranges: Some(Arc::new(vec![(64 * K, 64 * K), (600 * K, 100 * K)])),
            ..CopyOptions::default()
        };
        for opts in [by_bitmap, by_list] {
            src.reads.lock().unwrap().clear();
            let dst = Arc::new(MemoryBackend::new(1024 * K));
            dst.write(&vec![0xAA; 1024 * K as usize], 0, false).unwrap();
            let s = Endpoint::Backend(BackendEndpoint::new("src".into(), src.clone()));
            // Declared zeroed: a selection must not believe it.
            let d = Endpoint::Backend(BackendEndpoint::new("dst".into(), dst.clone()).zeroed());
            let r = copy(&s, &d, &opts, &Progress::default()).unwrap();
            assert_eq!(r.selected_bytes, Some(164 * K));
            assert_eq!(r.data_bytes, 64 * K);
            let mut got = vec![0u8; 1024 * K as usize];
            dst.read(&mut got, 0).unwrap();
            for (i, &b) in got.iter().enumerate() {
                let i = i as u64;
                let want = if (64 * K..128 * K).contains(&i) {
                    data[i as usize]
                } else if (600 * K..700 * K).contains(&i) {
                    0
                } else {
                    0xAA
                };
                assert_eq!(b, want, "byte {i}");
            }
            for &(o, l) in src.reads.lock().unwrap().iter() {
                assert!(o >= 64 * K && o + l <= 128 * K, "read {l} bytes at {o}");
            }
        }
        // A context the source does not have: named, with what it has.
        let opts = CopyOptions { select_context: Some("qemu:dirty-bitmap:x".into()), ..CopyOptions::default() };
        let s = Endpoint::Backend(BackendEndpoint::new("src".into(), src.clone()));
        let d = Endpoint::Backend(BackendEndpoint::new("dst".into(), Arc::new(MemoryBackend::new(1024 * K))));
        let e = copy(&s, &d, &opts, &Progress::default()).unwrap_err().to_string();
        assert!(e.contains("qemu:dirty-bitmap:x") && e.contains("base:allocation, qemu:dirty-bitmap:t"), "{e}");
        // Ranges out of order or past the end.
        for bad in [vec![(128 * K, 4096), (0, 4096)], vec![(1024 * K, 1)], vec![(0, 0)]] {
            let opts = CopyOptions { ranges: Some(Arc::new(bad)), ..CopyOptions::default() };
            assert!(copy(&s, &d, &opts, &Progress::default()).is_err());
        }
    }

    #[test]
    fn writes_past_the_end_are_refused_before_the_backend_sees_them() {
        let mut b = BackendEndpoint::new("mem".into(), Arc::new(MemoryBackend::new(4096)));
        let mut n = 0;
        let data = [1u8; 512];
        let ok = [Write { slot: 0, offset: 3584, data: Data::Bytes(&data) }];
        b.write(&ok, &mut |_, k| n += k).unwrap();
        assert_eq!(n, 512);
        for w in [
            Write { slot: 0, offset: 3585, data: Data::Bytes(&data) },
            Write { slot: 0, offset: 4096, data: Data::Zero(1) },
            Write { slot: 0, offset: u64::MAX, data: Data::Zero(2) },
        ] {
            let e = b.write(&[w], &mut |_, _| panic!("written")).unwrap_err().to_string();
            assert!(e.contains("mem is 4096 bytes") && e.contains("make it larger"), "{e}");
        }
    }
}
