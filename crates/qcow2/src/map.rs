//! Guest offset → host location: the L1 table, L2 tables (standard and extended, with
//! subclusters) and the L2 table cache.

use crate::header::Header;
use crate::Qcow2Error;
use std::collections::HashMap;

/// L1/L2 entry bits.
pub const OFLAG_COPIED: u64 = 1 << 63;
pub const OFLAG_COMPRESSED: u64 = 1 << 62;
pub const OFLAG_ZERO: u64 = 1;
/// Bits 9-55: a cluster-aligned host offset.
pub const OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;

/// Where a guest range's bytes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mapping {
    /// Not allocated in this image: the backing file's bytes, or zeroes.
    Unallocated,
    /// Reads as zeroes.
    Zero,
    /// At this host offset (of the range's first byte).
    Data(u64),
    /// Inside a compressed cluster at `host` (`len` compressed bytes); the range starts
    /// `skip` bytes into the decompressed cluster.
    Compressed { host: u64, len: u64, skip: u64 },
}

/// The image's shape, derived from the header once.
#[derive(Debug, Clone, Copy)]
pub struct Geometry {
    pub cluster_bits: u32,
    pub cluster_size: u64,
    pub extended_l2: bool,
    /// Entries per L2 table.
    pub l2_entries: u64,
    pub size: u64,
    pub version: u32,
    /// An external data file: host offset 0 is a real offset when COPIED is set.
    pub data_file: bool,
}

impl Geometry {
    pub fn new(h: &Header) -> Geometry {
        let cs = h.cluster_size();
        let entry = if h.extended_l2() { 16 } else { 8 };
        Geometry {
            cluster_bits: h.cluster_bits,
            cluster_size: cs,
            extended_l2: h.extended_l2(),
            l2_entries: cs / entry,
            size: h.size,
            version: h.version,
            data_file: h.data_file.is_some(),
        }
    }

    /// Guest bytes one L2 table maps.
    pub fn l2_span(&self) -> u64 {
        self.l2_entries << self.cluster_bits
    }

    /// The mapping of guest offset `off`, given its L2 entry (and subcluster bitmap),
    /// and how many bytes from `off` share it (up to the end of the subcluster/cluster).
    pub fn decode(&self, entry: u64, bitmap: u64, off: u64) -> Result<(Mapping, u64), Qcow2Error> {
        let cs = self.cluster_size;
        let in_cluster = off & (cs - 1);
        let to_cluster_end = cs - in_cluster;
        if entry & OFLAG_COMPRESSED != 0 {
            if self.data_file {
                return Err(Qcow2Error::Corrupt(format!(
                    "compressed cluster at guest offset {off} in an image with an external data file"
                )));
            }
            let shift = 62 - (self.cluster_bits - 8);
            let host = entry & ((1u64 << shift) - 1);
            let sectors = ((entry >> shift) & ((1u64 << (self.cluster_bits - 8)) - 1)) + 1;
            let len = sectors * 512 - (host & 511);
            return Ok((Mapping::Compressed { host, len, skip: in_cluster }, to_cluster_end));
        }
        let host = entry & OFFSET_MASK;
        let allocated = host != 0 || (self.data_file && entry & OFLAG_COPIED != 0);
        if allocated && host & (cs - 1) != 0 {
            return Err(Qcow2Error::Corrupt(format!("unaligned host offset {host:#x} for guest offset {off}")));
        }
        if !self.extended_l2 {
            if self.version >= 3 && entry & OFLAG_ZERO != 0 {
                return Ok((Mapping::Zero, to_cluster_end));
            }
            return Ok((
                if allocated { Mapping::Data(host + in_cluster) } else { Mapping::Unallocated },
                to_cluster_end,
            ));
        }
        let scs = cs / 32;
        let sc = in_cluster / scs;
        let to_sc_end = scs - (in_cluster & (scs - 1));
        let alloc_bit = bitmap & (1 << sc) != 0;
        let zero_bit = bitmap & (1 << (32 + sc)) != 0;
        // Merge following subclusters with the same state.
        let same = |i: u64| (bitmap & (1 << i) != 0) == alloc_bit && (bitmap & (1 << (32 + i)) != 0) == zero_bit;
        let mut run = to_sc_end;
        let mut next = sc + 1;
        while next < 32 && same(next) {
            run += scs;
            next += 1;
        }
        match (alloc_bit, zero_bit) {
            (true, true) => {
                Err(Qcow2Error::Corrupt(format!("subcluster of guest offset {off} is both allocated and zero")))
            }
            (true, false) if !allocated => Err(Qcow2Error::Corrupt(format!(
                "subcluster of guest offset {off} is allocated in an unallocated cluster"
            ))),
            (true, false) => Ok((Mapping::Data(host + in_cluster), run)),
            (false, true) => Ok((Mapping::Zero, run)),
            (false, false) => Ok((Mapping::Unallocated, run)),
        }
    }
}

/// One cached L2 table: raw entries (two u64 per entry with extended L2).
pub struct L2Table {
    pub raw: Vec<u64>,
    pub dirty: bool,
    last_use: u64,
}

impl L2Table {
    pub fn from_bytes(b: &[u8]) -> L2Table {
        let raw = b.chunks_exact(8).map(|c| u64::from_be_bytes(c.try_into().unwrap_or([0; 8]))).collect();
        L2Table { raw, dirty: false, last_use: 0 }
    }

    pub fn zeroed(words: usize) -> L2Table {
        L2Table { raw: vec![0; words], dirty: true, last_use: 0 }
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        self.raw.iter().flat_map(|w| w.to_be_bytes()).collect()
    }
}

/// L2 tables by host offset, bounded by bytes; dirty tables stay until written.
pub struct L2Cache {
    tables: HashMap<u64, L2Table>,
    tick: u64,
    capacity: usize,
}

impl L2Cache {
    /// At most `capacity` clean tables are kept.
    pub fn new(capacity: usize) -> L2Cache {
        L2Cache { tables: HashMap::new(), tick: 0, capacity: capacity.max(4) }
    }

    pub fn get(&mut self, host: u64) -> Option<&mut L2Table> {
        self.tick += 1;
        let t = self.tick;
        let e = self.tables.get_mut(&host)?;
        e.last_use = t;
        Some(e)
    }

    pub fn insert(&mut self, host: u64, mut table: L2Table) -> &mut L2Table {
        if self.tables.len() >= self.capacity {
            self.evict();
        }
        self.tick += 1;
        table.last_use = self.tick;
        self.tables.entry(host).or_insert(table)
    }

    /// Drops the older half of the clean tables.
    fn evict(&mut self) {
        let mut uses: Vec<u64> = self.tables.values().filter(|t| !t.dirty).map(|t| t.last_use).collect();
        if uses.is_empty() {
            return;
        }
        uses.sort_unstable();
        let cut = uses[uses.len() / 2];
        self.tables.retain(|_, t| t.dirty || t.last_use > cut);
    }

    /// Dirty tables: (host offset, table).
    pub fn dirty(&mut self) -> impl Iterator<Item = (&u64, &mut L2Table)> {
        self.tables.iter_mut().filter(|(_, t)| t.dirty)
    }

    pub fn dirty_count(&self) -> usize {
        self.tables.values().filter(|t| t.dirty).count()
    }
}
