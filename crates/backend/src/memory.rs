//! `memory:SIZE`: a sparse RAM disk.
//!
//! Memory is held in 32 KiB chunks, allocated on the first write that is not all
//! zeroes. Untouched, zeroed and trimmed chunks hold no memory and report as holes,
//! so a 1 TiB disk starts instantly. Chunks live in 64 shards, each a `RwLock` over
//! a `BTreeMap`, so connections on different cores rarely contend and the next
//! allocated chunk after any offset is found without scanning.

use crate::*;
use std::collections::BTreeMap;
use std::sync::RwLock;

/// Bytes per chunk.
pub const CHUNK: u64 = 32 * 1024;
const SHARDS: usize = 64;

type Chunk = Box<[u8]>;

pub struct MemoryBackend {
    size: u64,
    shards: Vec<RwLock<BTreeMap<u64, Chunk>>>,
}

fn shard_of(idx: u64) -> usize {
    (idx % SHARDS as u64) as usize
}

/// Splits `offset..offset+len` into (chunk index, offset within chunk, length) pieces.
fn pieces(offset: u64, len: u64) -> impl Iterator<Item = (u64, usize, usize)> {
    let end = offset + len;
    let mut pos = offset;
    std::iter::from_fn(move || {
        if pos >= end {
            return None;
        }
        let idx = pos / CHUNK;
        let within = pos % CHUNK;
        let n = (CHUNK - within).min(end - pos);
        pos += n;
        Some((idx, within as usize, n as usize))
    })
}

fn is_zero(b: &[u8]) -> bool {
    // Compare in 16-byte blocks; the compiler vectorises this well.
    let (head, rest) = b.split_at(b.len() % 16);
    head.iter().all(|&x| x == 0) && rest.chunks_exact(16).all(|c| u128::from_ne_bytes(c.try_into().unwrap()) == 0)
}

impl MemoryBackend {
    pub fn new(size: u64) -> Self {
        MemoryBackend { size, shards: (0..SHARDS).map(|_| RwLock::new(BTreeMap::new())).collect() }
    }

    fn shard(&self, idx: u64) -> &RwLock<BTreeMap<u64, Chunk>> {
        &self.shards[shard_of(idx)]
    }

    fn present(&self, idx: u64) -> bool {
        self.shard(idx).read().unwrap_or_else(|e| e.into_inner()).contains_key(&idx)
    }

    /// The first allocated chunk at or after `idx`, if any.
    fn next_present(&self, idx: u64) -> Option<u64> {
        self.shards
            .iter()
            .filter_map(|s| s.read().unwrap_or_else(|e| e.into_inner()).range(idx..).next().map(|(k, _)| *k))
            .min()
    }

    /// Bytes of memory held by chunks (for tests and statistics).
    pub fn allocated_bytes(&self) -> u64 {
        self.shards.iter().map(|s| s.read().unwrap_or_else(|e| e.into_inner()).len() as u64 * CHUNK).sum()
    }

    fn zero_range(&self, offset: u64, length: u64) {
        for (idx, within, n) in pieces(offset, length) {
            let mut shard = self.shard(idx).write().unwrap_or_else(|e| e.into_inner());
            if n as u64 == CHUNK {
                shard.remove(&idx);
            } else if let Some(c) = shard.get_mut(&idx) {
                c[within..within + n].fill(0);
                if is_zero(c) {
                    shard.remove(&idx);
                }
            }
        }
    }
}

impl Backend for MemoryBackend {
    fn describe(&self) -> String {
        format!("memory:{}", self.size)
    }
    fn size(&self) -> u64 {
        self.size
    }
    fn caps(&self) -> Capabilities {
        Capabilities::everything()
    }
    fn read(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let mut at = 0;
        for (idx, within, n) in pieces(offset, buf.len() as u64) {
            let dst = &mut buf[at..at + n];
            match self.shard(idx).read().unwrap_or_else(|e| e.into_inner()).get(&idx) {
                Some(c) => dst.copy_from_slice(&c[within..within + n]),
                None => dst.fill(0),
            }
            at += n;
        }
        Ok(())
    }
    fn write(&self, buf: &[u8], offset: u64, _fua: bool) -> Result<()> {
        let mut at = 0;
        for (idx, within, n) in pieces(offset, buf.len() as u64) {
            let src = &buf[at..at + n];
            at += n;
            let mut shard = self.shard(idx).write().unwrap_or_else(|e| e.into_inner());
            match shard.get_mut(&idx) {
                Some(c) => c[within..within + n].copy_from_slice(src),
                // Zeroes written to a hole stay a hole: no memory for them.
                None if is_zero(src) => {}
                None => {
                    let mut c = vec![0u8; CHUNK as usize].into_boxed_slice();
                    c[within..within + n].copy_from_slice(src);
                    shard.insert(idx, c);
                }
            }
        }
        Ok(())
    }
    fn flush(&self) -> Result<()> {
        Ok(())
    }
    fn trim(&self, offset: u64, length: u64, _fua: bool) -> Result<()> {
        self.zero_range(offset, length);
        Ok(())
    }
    fn zero(&self, offset: u64, length: u64, _mode: ZeroMode, _fua: bool) -> Result<()> {
        // Dropping a chunk is always at least as fast as writing it, so FAST_ZERO succeeds,
        // and a RAM disk has nothing to provision, so NO_HOLE changes nothing.
        self.zero_range(offset, length);
        Ok(())
    }
    fn extents(&self, offset: u64, length: u64, max: usize, out: &mut Vec<Extent>) -> Result<()> {
        let end = offset + length;
        let mut pos = offset;
        let start_len = out.len();
        while pos < end && out.len() - start_len < max {
            let idx = pos / CHUNK;
            let chunk_end = ((idx + 1) * CHUNK).min(end);
            if self.present(idx) {
                push_extent(out, chunk_end - pos, DATA);
                pos = chunk_end;
            } else {
                let next = self.next_present(idx + 1).map_or(end, |n| (n * CHUNK).min(end));
                push_extent(out, next - pos, HOLE);
                pos = next;
            }
        }
        Ok(())
    }
    fn sparse_read_threshold(&self) -> Option<u64> {
        // Smaller reads are served from the chunk (zeroes for a hole) without a
        // separate lookup: it costs more than the 4 KiB it would save.
        Some(CHUNK)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sparse_write_read_trim() {
        let m = MemoryBackend::new(1 << 40);
        assert_eq!(m.allocated_bytes(), 0);
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8 + 1).collect();
        m.write(&data, 12345, false).unwrap();
        let mut back = vec![0u8; data.len()];
        m.read(&mut back, 12345).unwrap();
        assert_eq!(back, data);
        assert!(m.allocated_bytes() > 0);
        let mut ex = Vec::new();
        m.extents(0, 1 << 20, 100, &mut ex).unwrap();
        assert_eq!(ex[0].flags, DATA);
        assert_eq!(ex.iter().map(|e| e.length).sum::<u64>(), 1 << 20);
        m.trim(0, 1 << 20, false).unwrap();
        assert_eq!(m.allocated_bytes(), 0);
        m.read(&mut back, 12345).unwrap();
        assert!(back.iter().all(|&b| b == 0));
        // zeroes to a hole allocate nothing
        m.write(&vec![0u8; 70_000], 0, false).unwrap();
        assert_eq!(m.allocated_bytes(), 0);
        ex.clear();
        m.extents(1 << 39, 1 << 39, 100, &mut ex).unwrap();
        assert_eq!(ex, vec![Extent { length: 1 << 39, flags: HOLE }]);
    }

    #[test]
    fn partial_zero_frees_chunk_when_all_zero() {
        let m = MemoryBackend::new(1 << 20);
        m.write(&[1, 2, 3], 10, false).unwrap();
        assert_eq!(m.allocated_bytes(), CHUNK);
        m.zero(10, 2, ZeroMode::default(), false).unwrap();
        assert_eq!(m.allocated_bytes(), CHUNK);
        m.zero(12, 1, ZeroMode::default(), false).unwrap();
        assert_eq!(m.allocated_bytes(), 0);
    }
}
