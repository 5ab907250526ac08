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
        let reader = contexts::ContextReader::local(&self.backend, &self.name, &names)
            .map_err(|e| CopyError::Setup(format!("source {e}")))?;
        let contexts::ContextReader::Local { contexts: ctxs, .. } = reader else {
            return Err(CopyError::Setup("not a local context reader".into()));
        };
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
    use ferry_backend::MemoryBackend;

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
