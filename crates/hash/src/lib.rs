//! The blkhash construction: a digest of a disk's guest-visible content that is the same
//! for a raw file, a sparse file and an NBD export of the same bytes, and fast to compute.
//!
//! ```text
//! digest = H( H(block_1) || H(block_2) || ... || H(block_n) || le64(length) )
//! ```
//!
//! Blocks are `block_size` bytes (64 KiB by default); the last one is hashed at its real
//! length. A full block of zeroes always has the same digest, computed once, so holes and
//! zero blocks cost nothing. Blocks may be hashed in any order and on any thread;
//! [`BlockHasher::add`] puts the block digests back in order for the outer hash, keeping
//! only those that arrived early. The thread count cannot change the result.
//!
//! # What this crate owns
//!
//! `BlockHasher`: the blkhash construction, thread-safe, order-independent; SHA-256 block
//! digests in batches through `tape-sha256`'s multi-buffer kernels (one SHA-256 is
//! latency-bound; independent blocks side by side are not)
//!
//! `unsafe`: forbidden.
#![forbid(unsafe_code)]

use sha2::Digest as _;
use std::collections::BTreeMap;
use std::sync::Mutex;

/// Hash functions ferry can use for blkhash.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algorithm {
    Sha256,
    Sha512,
    Sha1,
    Md5,
    Blake3,
}

impl std::str::FromStr for Algorithm {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "sha256" => Algorithm::Sha256,
            "sha512" => Algorithm::Sha512,
            "sha1" => Algorithm::Sha1,
            "md5" => Algorithm::Md5,
            "blake3" => Algorithm::Blake3,
            _ => return Err(format!("unknown digest {s:?}; use sha256, sha512, sha1, md5 or blake3")),
        })
    }
}

/// A running outer hash.
enum Outer {
    Sha256(sha2::Sha256),
    Sha512(sha2::Sha512),
    Sha1(sha1::Sha1),
    Md5(md5::Md5),
    Blake3(Box<blake3::Hasher>),
}

impl Outer {
    fn new(a: Algorithm) -> Outer {
        match a {
            Algorithm::Sha256 => Outer::Sha256(sha2::Sha256::new()),
            Algorithm::Sha512 => Outer::Sha512(sha2::Sha512::new()),
            Algorithm::Sha1 => Outer::Sha1(sha1::Sha1::new()),
            Algorithm::Md5 => Outer::Md5(md5::Md5::new()),
            Algorithm::Blake3 => Outer::Blake3(Box::new(blake3::Hasher::new())),
        }
    }
    fn update(&mut self, b: &[u8]) {
        match self {
            Outer::Sha256(h) => h.update(b),
            Outer::Sha512(h) => h.update(b),
            Outer::Sha1(h) => h.update(b),
            Outer::Md5(h) => h.update(b),
            Outer::Blake3(h) => {
                h.update(b);
            }
        }
    }
    fn finish(self) -> Vec<u8> {
        match self {
            Outer::Sha256(h) => h.finalize().to_vec(),
            Outer::Sha512(h) => h.finalize().to_vec(),
            Outer::Sha1(h) => h.finalize().to_vec(),
            Outer::Md5(h) => h.finalize().to_vec(),
            Outer::Blake3(h) => h.finalize().as_bytes().to_vec(),
        }
    }
}

impl Algorithm {
    /// Digest length in bytes.
    pub fn digest_len(self) -> usize {
        match self {
            Algorithm::Sha256 | Algorithm::Blake3 => 32,
            Algorithm::Sha512 => 64,
            Algorithm::Sha1 => 20,
            Algorithm::Md5 => 16,
        }
    }

    /// One-shot digest of `data`, written to `out` (`self.len()` bytes).
    pub fn digest_into(self, data: &[u8], out: &mut [u8]) {
        match self {
            Algorithm::Sha256 => out.copy_from_slice(&sha2::Sha256::digest(data)),
            Algorithm::Sha512 => out.copy_from_slice(&sha2::Sha512::digest(data)),
            Algorithm::Sha1 => out.copy_from_slice(&sha1::Sha1::digest(data)),
            Algorithm::Md5 => out.copy_from_slice(&md5::Md5::digest(data)),
            Algorithm::Blake3 => out.copy_from_slice(blake3::hash(data).as_bytes()),
        }
    }

    /// Digests of independent `blocks`, `digest_len()` bytes each, in order, into `out`.
    ///
    /// One SHA-256 is bound by the latency of its round chain, not by what the CPU can
    /// issue: SHA-NI runs at about 1.8 GB/s a core whatever the library. Independent
    /// blocks hashed side by side (AVX-512/AVX2 lanes, or interleaved SHA-NI streams)
    /// fill that gap, so SHA-256 goes through `tape_sha256`'s multi-buffer kernels; the
    /// other functions hash one block after the other.
    pub fn digest_many(self, blocks: &[&[u8]], out: &mut [u8]) {
        let d = self.digest_len();
        assert_eq!(out.len(), blocks.len() * d, "digest_many: output is not one digest per block");
        match self {
            Algorithm::Sha256 => {
                let (digests, _) = out.as_chunks_mut::<32>();
                let lanes = tape_sha256::lane_width();
                let tail = blocks.len() % lanes;
                // The SHA-NI kernel hashes a last group of 3 equal blocks one after the
                // other; padded with a copy of its first block to a group of 4, they take
                // the time of 2 blocks, not 3.
                let head = blocks.len() - tail;
                let last = &blocks[head..];
                if lanes == SHA256_GROUP && tail == 3 && last.iter().all(|b| b.len() == last[0].len()) {
                    tape_sha256::hash_many(&blocks[..head], &mut digests[..head]);
                    let padded = [last[0], last[1], last[2], last[0]];
                    let mut group = [[0u8; 32]; SHA256_GROUP];
                    tape_sha256::hash_many(&padded, &mut group);
                    digests[head..].copy_from_slice(&group[..tail]);
                } else {
                    tape_sha256::hash_many(blocks, digests);
                }
            }
            _ => {
                for (b, o) in blocks.iter().zip(out.chunks_exact_mut(d)) {
                    self.digest_into(b, o);
                }
            }
        }
    }
}

/// How many blocks of equal length to gather before [`Algorithm::digest_many`], for a
/// caller that can wait for a few: 4 where the running CPU's SHA-256 kernel hashes 4 or
/// more side by side (4 interleaved SHA-NI streams: 4 chunks in the time of 2; the
/// AVX-512 kernels hand a small remainder to those streams where the CPU has SHA-NI, and
/// hash it in 16 lanes where it has not), else 1 (gathering buys nothing). The padding of
/// a last group of 3 in [`Algorithm::digest_many`] is done only with the 4-stream kernel.
pub fn sha256_group() -> usize {
    if tape_sha256::lane_width() >= SHA256_GROUP {
        SHA256_GROUP
    } else {
        1
    }
}

/// The SHA-NI kernel's streams.
const SHA256_GROUP: usize = 4;

/// Whether every byte is zero (16 bytes at a time; vectorised by the compiler).
pub fn is_zero(b: &[u8]) -> bool {
    let (head, rest) = b.split_at(b.len() % 16);
    head.iter().all(|&x| x == 0)
        && rest.chunks_exact(16).all(|c| u128::from_ne_bytes(c.try_into().unwrap_or_default()) == 0)
}

struct Order {
    outer: Outer,
    /// Index of the next block the outer hash needs.
    next: u64,
    /// Digests of blocks that arrived before `next` reached them, by first block index.
    early: BTreeMap<u64, Vec<u8>>,
}

/// Computes a blkhash from blocks given in any order, from any thread.
pub struct BlockHasher {
    alg: Algorithm,
    block_size: usize,
    zero_digest: Vec<u8>,
    order: Mutex<Order>,
}

impl BlockHasher {
    pub fn new(alg: Algorithm, block_size: usize) -> BlockHasher {
        assert!(block_size > 0, "block size must be positive");
        let mut zero_digest = vec![0u8; alg.digest_len()];
        alg.digest_into(&vec![0u8; block_size], &mut zero_digest);
        BlockHasher {
            alg,
            block_size,
            zero_digest,
            order: Mutex::new(Order { outer: Outer::new(alg), next: 0, early: BTreeMap::new() }),
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn algorithm(&self) -> Algorithm {
        self.alg
    }

    /// Hashes the bytes at `offset` (a multiple of the block size). `data` covers whole
    /// blocks, except at the very end of the disk. Zero blocks are detected, not hashed.
    pub fn add(&self, offset: u64, data: &[u8]) {
        let first = self.first_block(offset);
        let d = self.alg.digest_len();
        let bs = self.block_size;
        let mut digests = vec![0u8; data.len().div_ceil(bs) * d];
        // Zero blocks take the digest computed once; the others are hashed together.
        let mut zeroes = Vec::new();
        let mut blocks = Vec::with_capacity(digests.len() / d);
        for (i, block) in data.chunks(bs).enumerate() {
            if block.len() == bs && is_zero(block) {
                zeroes.push(i);
            } else {
                blocks.push(block);
            }
        }
        if zeroes.is_empty() {
            self.alg.digest_many(&blocks, &mut digests);
        } else {
            let mut hashed = vec![0u8; blocks.len() * d];
            self.alg.digest_many(&blocks, &mut hashed);
            let mut hashed = hashed.chunks_exact(d);
            let mut zeroes = zeroes.into_iter().peekable();
            for (i, out) in digests.chunks_exact_mut(d).enumerate() {
                if zeroes.next_if_eq(&i).is_some() {
                    out.copy_from_slice(&self.zero_digest);
                } else if let Some(h) = hashed.next() {
                    out.copy_from_slice(h);
                }
            }
        }
        self.deliver(first, digests);
    }

    /// Records `len` bytes of zeroes at `offset` (a hole) without reading or hashing them.
    /// `len` covers whole blocks, except at the very end of the disk.
    pub fn add_zeroes(&self, offset: u64, len: u64) {
        let first = self.first_block(offset);
        let full = len / self.block_size as u64;
        let tail = (len % self.block_size as u64) as usize;
        let d = self.alg.digest_len();
        let mut digests = Vec::with_capacity((full as usize + 1) * d);
        for _ in 0..full {
            digests.extend_from_slice(&self.zero_digest);
        }
        if tail > 0 {
            let at = digests.len();
            digests.resize(at + d, 0);
            self.alg.digest_into(&vec![0u8; tail], &mut digests[at..]);
        }
        self.deliver(first, digests);
    }

    fn first_block(&self, offset: u64) -> u64 {
        assert!(offset.is_multiple_of(self.block_size as u64), "hash input at {offset} is not block-aligned");
        offset / self.block_size as u64
    }

    /// Feeds digests to the outer hash in block order, keeping early ones aside.
    fn deliver(&self, first: u64, digests: Vec<u8>) {
        if digests.is_empty() {
            return;
        }
        let d = self.alg.digest_len() as u64;
        let mut o = self.order.lock().unwrap_or_else(|e| e.into_inner());
        if first != o.next {
            o.early.insert(first, digests);
            return;
        }
        let o = &mut *o;
        o.outer.update(&digests);
        o.next += digests.len() as u64 / d;
        while let Some(v) = o.early.remove(&o.next) {
            o.outer.update(&v);
            o.next += v.len() as u64 / d;
        }
    }

    /// The final digest of a disk of `length` bytes. Every block must have been added.
    /// The hasher starts over afterwards.
    pub fn finish(&self, length: u64) -> Result<Vec<u8>, String> {
        let fresh = Order { outer: Outer::new(self.alg), next: 0, early: BTreeMap::new() };
        let mut o = std::mem::replace(&mut *self.order.lock().unwrap_or_else(|e| e.into_inner()), fresh);
        let blocks = length.div_ceil(self.block_size as u64);
        if o.next != blocks || !o.early.is_empty() {
            return Err(format!("hash is missing blocks: {} of {blocks} delivered in order", o.next));
        }
        o.outer.update(&length.to_le_bytes());
        Ok(o.outer.finish())
    }
}

impl std::fmt::Debug for BlockHasher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockHasher").field("alg", &self.alg).field("block_size", &self.block_size).finish()
    }
}

/// Lower-case hex of a digest.
pub fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The definition, computed the slow, obvious way.
    fn reference(alg: Algorithm, bs: usize, data: &[u8]) -> Vec<u8> {
        let mut outer = Vec::new();
        for b in data.chunks(bs) {
            let mut d = vec![0u8; alg.digest_len()];
            alg.digest_into(b, &mut d);
            outer.extend_from_slice(&d);
        }
        outer.extend_from_slice(&(data.len() as u64).to_le_bytes());
        let mut out = vec![0u8; alg.digest_len()];
        alg.digest_into(&outer, &mut out);
        out
    }

    fn data(n: usize) -> Vec<u8> {
        let mut x = 0x9E3779B97F4A7C15u64;
        let mut v: Vec<u8> = (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        // a run of zero blocks in the middle
        let z = (n / 3).min(3 * 65536);
        v[n / 3..n / 3 + z].fill(0);
        v
    }

    #[test]
    fn empty_input_vector() {
        let h = BlockHasher::new(Algorithm::Sha256, 65536);
        assert_eq!(hex(&h.finish(0).unwrap()), "af5570f5a1810b7af78caf4bc70a660f0df51e42baf91d4de5b2328de0e83dfc");
    }

    #[test]
    fn matches_definition_around_block_boundaries() {
        let bs = 65536;
        for n in [1, bs - 1, bs, bs + 1, 3 * bs, 5 * bs - 7, 10 * bs + 3] {
            let d = data(n);
            for alg in [Algorithm::Sha256, Algorithm::Sha512, Algorithm::Sha1, Algorithm::Md5, Algorithm::Blake3] {
                let h = BlockHasher::new(alg, bs);
                h.add(0, &d);
                assert_eq!(h.finish(n as u64).unwrap(), reference(alg, bs, &d), "{alg:?} n={n}");
            }
        }
    }

    #[test]
    fn digest_many_matches_one_at_a_time() {
        // Ragged lengths around the SHA-256 padding edges, more blocks than any kernel has
        // lanes, so full batches, partial ones and their tails are all exercised.
        let d = data(200_000);
        let mut blocks: Vec<&[u8]> = Vec::new();
        for (i, n) in [0, 1, 55, 56, 63, 64, 65, 119, 120, 128, 1000, 4096, 65536].iter().cycle().take(75).enumerate() {
            blocks.push(&d[i * 100..i * 100 + n]);
        }
        // Equal blocks too: short last groups of them are padded to a whole group.
        for i in 0..40 {
            blocks.push(&d[i * 1000..i * 1000 + 65536]);
        }
        for alg in [Algorithm::Sha256, Algorithm::Sha512, Algorithm::Sha1, Algorithm::Md5, Algorithm::Blake3] {
            for (from, count) in [0, 1, 3, 4, 5, 16, 31, 32, 33, 75]
                .into_iter()
                .map(|c| (0, c))
                .chain((1..=19).map(|c| (75, c)))
                .chain([(74, 4), (73, 8)])
            {
                let l = alg.digest_len();
                let blocks = &blocks[from..];
                let mut many = vec![0u8; count * l];
                alg.digest_many(&blocks[..count], &mut many);
                for (b, got) in blocks[..count].iter().zip(many.chunks_exact(l)) {
                    let mut want = vec![0u8; l];
                    alg.digest_into(b, &mut want);
                    assert_eq!(got, want, "{alg:?} from={from} count={count} len={}", b.len());
                }
            }
        }
    }

    #[test]
    fn many_blocks_with_zero_runs() {
        let bs = 65536;
        let n = 70 * bs + 17;
        let mut d = data(n);
        d[40 * bs..41 * bs].fill(0);
        d[45 * bs..45 * bs + 100].fill(0); // a block only partly zero
        for alg in [Algorithm::Sha256, Algorithm::Blake3] {
            let want = reference(alg, bs, &d);
            for piece in [bs, 16 * bs, 32 * bs, n] {
                let h = BlockHasher::new(alg, bs);
                for (i, c) in d.chunks(piece).enumerate() {
                    h.add((i * piece) as u64, c);
                }
                assert_eq!(h.finish(n as u64).unwrap(), want, "{alg:?} piece={piece}");
            }
        }
    }

    #[test]
    fn order_and_holes_do_not_matter() {
        let bs = 65536;
        let n = 40 * bs + 123;
        let mut d = data(n);
        d[8 * bs..20 * bs].fill(0);
        let want = reference(Algorithm::Sha256, bs, &d);
        let h = BlockHasher::new(Algorithm::Sha256, bs);
        // pieces in reverse order; the zero range as a hole
        let mut pieces: Vec<(usize, usize)> = vec![(0, 8 * bs), (20 * bs, n)];
        pieces.extend((8..20).step_by(4).map(|b| (b * bs, (b + 4) * bs)));
        for &(a, b) in pieces.iter().rev() {
            if a >= 8 * bs && b <= 20 * bs {
                h.add_zeroes(a as u64, (b - a) as u64);
            } else {
                h.add(a as u64, &d[a..b]);
            }
        }
        assert_eq!(h.finish(n as u64).unwrap(), want);
        // a trailing partial hole
        let mut z = vec![0u8; 2 * bs + 5];
        z[..10].fill(1);
        let h = BlockHasher::new(Algorithm::Sha256, bs);
        h.add(0, &z[..bs]);
        h.add_zeroes(bs as u64, (bs + 5) as u64);
        assert_eq!(h.finish(z.len() as u64).unwrap(), reference(Algorithm::Sha256, bs, &z));
    }

    #[test]
    fn missing_blocks_are_an_error() {
        let h = BlockHasher::new(Algorithm::Sha256, 4096);
        h.add(4096, &[1; 4096]);
        assert!(h.finish(8192).is_err());
    }
}
