//! A blocked Bloom filter of blob ids, kept beside each run of the local index cache
//! ([`crate::runs`]; not part of the format): a lookup of an id that a run does not hold,
//! what a backup asks of most of its new chunks, reads one 64-byte block of the filter
//! (one cache line) instead of a block of the run file.
//!
//! Blob ids are SHA-256 outputs (keyed, in an encrypted repository): their bytes are
//! already uniform, so they are the hash. Bytes 0..8 pick the block, and [`K`] 9-bit
//! fields of bytes 8..8+2K the bits in it. [`BITS_PER_ENTRY`] bits an entry: about 0.5%
//! of the ids a run does not hold read its block anyway.
//!
//! The filter only ever says "absent" for an id it was not given: it is built from every
//! entry of its run, and its stored form is checked (its own checksum, and the run's
//! table checksum and entry count it was built for) before it is used; one that fails is
//! built again from the run. A wrong "absent" would only make a backup store a chunk
//! again, never lose one, but it is not produced. Pure: no I/O.

/// Bytes of a filter block: one cache line.
const BLOCK_BYTES: usize = 64;
const BLOCK_BITS: u64 = BLOCK_BYTES as u64 * 8;
/// Bits set per id.
const K: usize = 7;
/// Filter bits per run entry.
pub(crate) const BITS_PER_ENTRY: u64 = 12;
/// The most bytes of a filter (beyond: a run has none, and every lookup reads its block).
pub(crate) const MAX_BYTES: u64 = 1 << 30;
const MAGIC: &[u8; 8] = b"ferryblm";
const VERSION: u32 = 1;
/// Bytes of a stored filter's header: magic, version, blocks, the run's table checksum,
/// the run's entries, the bits' CRC-32.
pub(crate) const HEADER: usize = 32;

/// The blocks of a filter of `entries` ids; `None` beyond [`MAX_BYTES`].
fn blocks_for(entries: u64) -> Option<u64> {
    let blocks = entries.checked_mul(BITS_PER_ENTRY)?.div_ceil(BLOCK_BITS).max(1);
    (blocks.checked_mul(BLOCK_BYTES as u64)? <= MAX_BYTES).then_some(blocks)
}

/// A filter: blocks of [`BLOCK_BYTES`], as 8 words each.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct Bloom {
    words: Vec<u64>,
}

impl std::fmt::Debug for Bloom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Bloom({} blocks)", self.blocks())
    }
}

impl Bloom {
    /// An empty filter for `entries` ids; `None` when it would be over [`MAX_BYTES`].
    pub(crate) fn new(entries: u64) -> Option<Bloom> {
        Some(Bloom { words: vec![0; blocks_for(entries)? as usize * 8] })
    }

    fn blocks(&self) -> usize {
        self.words.len() / 8
    }

    /// Whether the filter has the size a filter of `entries` ids has (the size its stored
    /// form is checked against).
    pub(crate) fn sized_for(&self, entries: u64) -> bool {
        blocks_for(entries) == Some(self.blocks() as u64)
    }

    /// The block of `id` and its bits in it.
    fn place(&self, id: &[u8; 32]) -> (usize, [u16; K]) {
        let h = u64::from_le_bytes(id[..8].try_into().unwrap_or_default());
        let block = ((h as u128 * self.blocks() as u128) >> 64) as usize;
        let mut bits = [0u16; K];
        for (i, b) in bits.iter_mut().enumerate() {
            *b = u16::from_le_bytes([id[8 + 2 * i], id[9 + 2 * i]]) % BLOCK_BITS as u16;
        }
        (block, bits)
    }

    pub(crate) fn insert(&mut self, id: &[u8; 32]) {
        let (block, bits) = self.place(id);
        let words = &mut self.words[block * 8..block * 8 + 8];
        for b in bits {
            words[b as usize / 64] |= 1 << (b % 64);
        }
    }

    /// False only for an id that was never inserted.
    pub(crate) fn may_contain(&self, id: &[u8; 32]) -> bool {
        let (block, bits) = self.place(id);
        let words = &self.words[block * 8..block * 8 + 8];
        bits.iter().all(|b| words[*b as usize / 64] & (1 << (b % 64)) != 0)
    }

    /// The stored form, bound to the run it was built from (`run_crc`: its tables'
    /// checksum; `entries`: its entry count).
    pub(crate) fn encode(&self, run_crc: u32, entries: u64) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER + self.words.len() * 8);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&(self.blocks() as u32).to_le_bytes());
        out.extend_from_slice(&run_crc.to_le_bytes());
        out.extend_from_slice(&entries.to_le_bytes());
        out.extend_from_slice(&[0; 4]);
        for w in &self.words {
            out.extend_from_slice(&w.to_le_bytes());
        }
        let crc = crc32fast::hash(&out[HEADER..]);
        out[28..32].copy_from_slice(&crc.to_le_bytes());
        out
    }

    /// The length a stored filter of `entries` has, if it may have one.
    pub(crate) fn stored_len(entries: u64) -> Option<u64> {
        Some(HEADER as u64 + blocks_for(entries)? * BLOCK_BYTES as u64)
    }

    /// A stored filter, checked: of this version, of the run whose tables' checksum is
    /// `run_crc` and that has `entries` entries, sized for them, its bits whole.
    pub(crate) fn decode(b: &[u8], run_crc: u32, entries: u64) -> Result<Bloom, String> {
        let want = Bloom::stored_len(entries).ok_or("its run is too large to have one")?;
        if b.len() as u64 != want {
            return Err(format!("it has {} bytes, not {want}", b.len()));
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        if &b[..8] != MAGIC || u32_at(8) != VERSION {
            return Err("it is not a filter of this version".into());
        }
        let stored_entries = u64::from_le_bytes(b[20..28].try_into().unwrap_or_default());
        if u32_at(16) != run_crc || stored_entries != entries {
            return Err("it was built for another run".into());
        }
        if (u32_at(12) as u64) * BLOCK_BYTES as u64 + HEADER as u64 != want {
            return Err("its block count does not match its run".into());
        }
        if crc32fast::hash(&b[HEADER..]) != u32_at(28) {
            return Err("it fails its checksum".into());
        }
        let words = b[HEADER..].chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default())).collect();
        Ok(Bloom { words })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u64) -> [u8; 32] {
        crate::repo::sha256(&n.to_le_bytes())
    }

    #[test]
    fn every_id_inserted_is_maybe_and_few_others_are() {
        for n in [0u64, 1, 5, 1000, 100_000] {
            let mut f = Bloom::new(n).unwrap();
            (0..n).for_each(|i| f.insert(&id(i)));
            assert!((0..n).all(|i| f.may_contain(&id(i))), "an id inserted is said absent ({n} ids)");
            if n >= 1000 {
                let others = 100_000u64;
                let fp = (0..others).filter(|i| f.may_contain(&id(1 << 40 | i))).count() as f64 / others as f64;
                assert!(fp < 0.015, "{fp} of absent ids read their block ({n} ids)");
            }
        }
    }

    #[test]
    fn a_stored_filter_reads_back_only_for_its_run_and_whole() {
        let mut f = Bloom::new(3000).unwrap();
        (0..3000).for_each(|i| f.insert(&id(i)));
        let b = f.encode(0xabcd, 3000);
        assert_eq!(b.len() as u64, Bloom::stored_len(3000).unwrap());
        assert_eq!(Bloom::decode(&b, 0xabcd, 3000).unwrap(), f);
        assert!(Bloom::decode(&b, 0xabce, 3000).is_err(), "another run's tables");
        assert!(Bloom::decode(&b, 0xabcd, 2999).is_err(), "another entry count");
        assert!(Bloom::decode(&b[..b.len() - 1], 0xabcd, 3000).is_err());
        for at in [0, 9, 13, 40, b.len() - 1] {
            let mut bad = b.clone();
            bad[at] ^= 0x10;
            assert!(Bloom::decode(&bad, 0xabcd, 3000).is_err(), "a flipped byte at {at} was taken");
        }
        // Bits cleared (what could make it say "absent" wrongly) fail the checksum.
        let mut cleared = b.clone();
        cleared[HEADER..].fill(0);
        assert!(Bloom::decode(&cleared, 0xabcd, 3000).is_err());
        assert!(Bloom::new(u64::MAX).is_none() && Bloom::stored_len(u64::MAX).is_none());
        assert!(Bloom::new(MAX_BYTES).is_none(), "over the bound");
    }
}
