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

/// A filter: blocks of [`BLOCK_BYTES`], as stored (bit `b` of a block is bit `b % 8` of
/// its byte `b / 8`), so that a stored filter is used as read, without a copy.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct Bloom {
    bits: Vec<u8>,
}

impl std::fmt::Debug for Bloom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Bloom({} blocks)", self.blocks())
    }
}

/// A stored filter's header, checked: what its bits must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    /// Bytes of its bits (after the header); at most [`MAX_BYTES`].
    pub(crate) bits_len: usize,
    crc: u32,
}

impl Bloom {
    /// An empty filter for `entries` ids; `None` when it would be over [`MAX_BYTES`].
    pub(crate) fn new(entries: u64) -> Option<Bloom> {
        Some(Bloom { bits: vec![0; blocks_for(entries)? as usize * BLOCK_BYTES] })
    }

    fn blocks(&self) -> usize {
        self.bits.len() / BLOCK_BYTES
    }

    /// Whether the filter has the size a filter of `entries` ids has (the size its stored
    /// form is checked against).
    pub(crate) fn sized_for(&self, entries: u64) -> bool {
        blocks_for(entries) == Some(self.blocks() as u64)
    }

    /// The bytes of the block of `id` and its bits in it.
    fn place(&self, id: &[u8; 32]) -> (usize, [u16; K]) {
        let h = u64::from_le_bytes(id[..8].try_into().unwrap_or_default());
        let block = ((h as u128 * self.blocks() as u128) >> 64) as usize;
        let mut bits = [0u16; K];
        for (i, b) in bits.iter_mut().enumerate() {
            *b = u16::from_le_bytes([id[8 + 2 * i], id[9 + 2 * i]]) % BLOCK_BITS as u16;
        }
        (block * BLOCK_BYTES, bits)
    }

    pub(crate) fn insert(&mut self, id: &[u8; 32]) {
        let (at, bits) = self.place(id);
        let block = &mut self.bits[at..at + BLOCK_BYTES];
        for b in bits {
            block[b as usize / 8] |= 1 << (b % 8);
        }
    }

    /// False only for an id that was never inserted.
    pub(crate) fn may_contain(&self, id: &[u8; 32]) -> bool {
        let (at, bits) = self.place(id);
        let block = &self.bits[at..at + BLOCK_BYTES];
        bits.iter().all(|b| block[*b as usize / 8] & (1 << (b % 8)) != 0)
    }

    /// The stored form's header, bound to the run the filter was built from (`run_crc`:
    /// its tables' checksum; `entries`: its entry count); the bits ([`Bloom::bits`])
    /// follow it.
    pub(crate) fn header(&self, run_crc: u32, entries: u64) -> [u8; HEADER] {
        let mut h = [0u8; HEADER];
        h[..8].copy_from_slice(MAGIC);
        h[8..12].copy_from_slice(&VERSION.to_le_bytes());
        h[12..16].copy_from_slice(&(self.blocks() as u32).to_le_bytes());
        h[16..20].copy_from_slice(&run_crc.to_le_bytes());
        h[20..28].copy_from_slice(&entries.to_le_bytes());
        h[28..32].copy_from_slice(&crc32fast::hash(&self.bits).to_le_bytes());
        h
    }

    /// The stored form's bits (after [`Bloom::header`]).
    pub(crate) fn bits(&self) -> &[u8] {
        &self.bits
    }

    /// The stored form in one buffer (header and bits).
    pub(crate) fn encode(&self, run_crc: u32, entries: u64) -> Vec<u8> {
        [&self.header(run_crc, entries)[..], &self.bits].concat()
    }

    /// The length a stored filter of `entries` has, if it may have one.
    pub(crate) fn stored_len(entries: u64) -> Option<u64> {
        Some(HEADER as u64 + blocks_for(entries)? * BLOCK_BYTES as u64)
    }

    /// A stored filter's header, checked before its bits are read (or room is made for
    /// them): of this version, of the run whose tables' checksum is `run_crc` and that has
    /// `entries` entries, and of the block count a filter of them has.
    pub(crate) fn check_header(h: &[u8], run_crc: u32, entries: u64) -> Result<Header, String> {
        let want = blocks_for(entries).ok_or("its run is too large to have one")?;
        let h: &[u8; HEADER] = h.try_into().map_err(|_| format!("its header has {} bytes, not {HEADER}", h.len()))?;
        let u32_at = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
        if &h[..8] != MAGIC || u32_at(8) != VERSION {
            return Err("it is not a filter of this version".into());
        }
        let stored_entries = u64::from_le_bytes(h[20..28].try_into().unwrap_or_default());
        if u32_at(16) != run_crc || stored_entries != entries {
            return Err("it was built for another run".into());
        }
        if u32_at(12) as u64 != want {
            return Err("its block count does not match its run".into());
        }
        // `want` blocks are at most MAX_BYTES (blocks_for): the product fits.
        Ok(Header { bits_len: (want * BLOCK_BYTES as u64) as usize, crc: u32_at(28) })
    }

    /// The filter of a checked header and the bits read after it, taken as they are if
    /// they are whole (their length and checksum the header's).
    pub(crate) fn from_bits(h: Header, bits: Vec<u8>) -> Result<Bloom, String> {
        if bits.len() != h.bits_len {
            return Err(format!("its bits have {} bytes, not {}", bits.len(), h.bits_len));
        }
        if crc32fast::hash(&bits) != h.crc {
            return Err("it fails its checksum".into());
        }
        Ok(Bloom { bits })
    }

    /// A stored filter in one buffer, checked ([`Bloom::check_header`],
    /// [`Bloom::from_bits`]).
    pub(crate) fn decode(b: &[u8], run_crc: u32, entries: u64) -> Result<Bloom, String> {
        let h = Bloom::check_header(b.get(..HEADER).unwrap_or(b), run_crc, entries)?;
        if b.len() - HEADER != h.bits_len {
            return Err(format!("it has {} bytes, not {}", b.len(), HEADER + h.bits_len));
        }
        Bloom::from_bits(h, b[HEADER..].to_vec())
    }
}

/// Checks a stored filter given as bytes, and looks up a few ids in one that passes:
/// what fuzzing drives. Bytes 0..4 are the run's table checksum and 4..12 its entries,
/// byte 12 the mode, the rest the filter. Where the mode's bit 0 is set the run is the
/// one the filter's header names, and where its bit 1 is the header's checksum is made
/// right first, so that the checks after those are reached too. Never panics, whatever
/// the bytes; a filter taken encodes to the bytes it was read from.
pub(crate) fn fuzz(data: &[u8]) {
    let Some((bind, b)) = data.split_at_checked(13) else { return };
    let mut b = b.to_vec();
    let mut run_crc = u32::from_le_bytes(bind[..4].try_into().unwrap_or_default());
    let mut entries = u64::from_le_bytes(bind[4..12].try_into().unwrap_or_default());
    if b.len() >= HEADER {
        if bind[12] & 1 == 1 {
            run_crc = u32::from_le_bytes(b[16..20].try_into().unwrap_or_default());
            entries = u64::from_le_bytes(b[20..28].try_into().unwrap_or_default());
        }
        if bind[12] & 2 == 2 {
            let crc = crc32fast::hash(&b[HEADER..]);
            b[28..32].copy_from_slice(&crc.to_le_bytes());
        }
    }
    if let Ok(f) = Bloom::decode(&b, run_crc, entries) {
        assert_eq!(f.encode(run_crc, entries), b);
        assert!(f.sized_for(entries));
        for id in [[0u8; 32], [0xff; 32], crate::repo::sha256(&b)] {
            let _ = f.may_contain(&id);
        }
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

    #[test]
    fn a_header_is_checked_before_its_bits_are_read() {
        let f = Bloom::new(3000).unwrap();
        let h = Bloom::check_header(&f.header(7, 3000), 7, 3000).unwrap();
        assert_eq!(h.bits_len, f.bits().len());
        assert_eq!(Bloom::from_bits(h, f.bits().to_vec()).unwrap(), f);
        assert!(Bloom::from_bits(h, vec![0; h.bits_len - 1]).is_err(), "short bits");
        assert!(Bloom::from_bits(h, vec![1; h.bits_len]).is_err(), "other bits");
        // A header claiming more blocks than its run's entries make is refused as such,
        // before anything is allocated for them.
        let mut big = f.header(7, 3000);
        big[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(Bloom::check_header(&big, 7, 3000), Err("its block count does not match its run".into()));
        assert!(Bloom::check_header(&big[..HEADER - 1], 7, 3000).is_err());
        assert!(Bloom::check_header(&f.header(7, u64::MAX), 7, u64::MAX).is_err(), "over the bound");
    }

    /// The stored form is the one written before filters were kept as bytes: blocks of 8
    /// little-endian 64-bit words, bit `b` of a block bit `b % 64` of its word `b / 64`.
    #[test]
    fn the_stored_bits_are_those_of_words() {
        let mut f = Bloom::new(500).unwrap();
        let mut words = vec![0u64; f.blocks() * 8];
        for i in 0..500 {
            let (at, bits) = f.place(&id(i));
            for b in bits {
                words[at / 8 + b as usize / 64] |= 1 << (b % 64);
            }
            f.insert(&id(i));
        }
        let stored: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        assert_eq!(f.bits(), &stored[..]);
    }

    #[test]
    fn fuzzing_inputs_do_not_panic() {
        let mut f = Bloom::new(40).unwrap();
        (0..40).for_each(|i| f.insert(&id(i)));
        let stored = f.encode(1, 40);
        for mode in 0..4u8 {
            let data = [&1u32.to_le_bytes()[..], &40u64.to_le_bytes(), &[mode], &stored].concat();
            fuzz(&data);
            for cut in [0, 5, 13, 13 + HEADER - 1, 13 + HEADER, data.len() - 1] {
                fuzz(&data[..cut]);
            }
        }
    }
}
