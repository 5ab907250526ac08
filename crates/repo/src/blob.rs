//! One chunk or page as stored in a pack (FORMAT.md §4): zstd or raw, then sealed.
use crate::crypto::Crypto;
use crate::format::{BlobKind, Digest};
use std::borrow::Cow;
use std::cell::RefCell;

/// The encoding byte of a body stored as it is.
pub const RAW: u8 = 0;
/// The encoding byte of a body that is one zstd frame.
pub const ZSTD: u8 = 1;

/// SHA-256 of a blob's plain bytes: the same function and code as blkhash's block
/// digests (`ferry hash`), so a chunk's digest is its block digest.
pub fn digest(plain: &[u8]) -> Digest {
    let mut d = [0u8; 32];
    ferry_hash::Algorithm::Sha256.digest_into(plain, &mut d);
    d
}

thread_local! {
    /// Each thread's compressor (its level) and scratch buffer: a zstd context costs
    /// more to make than a 64 KiB chunk costs to compress.
    static COMPRESSOR: RefCell<Option<(i32, zstd::bulk::Compressor<'static>, Vec<u8>)>> = const { RefCell::new(None) };
    static DECOMPRESSOR: RefCell<Option<zstd::bulk::Decompressor<'static>>> = const { RefCell::new(None) };
}

/// `plain` as one zstd frame at `level`, appended to `out`, if that is shorter than
/// `plain`; false (and `out` untouched) if not.
fn compress_into(plain: &[u8], level: i32, out: &mut Vec<u8>) -> bool {
    if plain.len() < 2 {
        return false;
    }
    COMPRESSOR.with(|c| {
        let mut c = c.borrow_mut();
        if c.as_ref().is_none_or(|(l, _, _)| *l != level) {
            match zstd::bulk::Compressor::new(level) {
                Ok(z) => *c = Some((level, z, Vec::new())),
                Err(_) => return false,
            }
        }
        let Some((_, z, scratch)) = c.as_mut() else { return false };
        scratch.clear();
        // Room for one byte less than `plain`: a frame that does not fit did not shrink.
        scratch.reserve(plain.len() - 1);
        let cap = plain.len() - 1;
        match z.compress_to_buffer(plain, scratch) {
            Ok(n) if n <= cap => {
                out.extend_from_slice(&scratch[..n]);
                true
            }
            _ => false,
        }
    })
}

/// The plain length one zstd frame, exactly `z`, says it holds (`None`: it does not say),
/// when that is at most `max_plain`.
fn frame_content(z: &[u8], max_plain: usize) -> Result<Option<usize>, String> {
    match zstd::zstd_safe::find_frame_compressed_size(z) {
        Ok(n) if n == z.len() => {}
        Ok(n) => return Err(format!("its zstd frame is {n} bytes long but the blob has {} bytes of it", z.len())),
        Err(_) => return Err("its body is not a zstd frame".into()),
    }
    match zstd::zstd_safe::get_frame_content_size(z) {
        Ok(Some(n)) if n > max_plain as u64 => {
            Err(format!("its zstd frame holds {n} bytes; at most {max_plain} are allowed"))
        }
        Ok(Some(n)) => Ok(Some(n as usize)),
        Ok(None) => Ok(None),
        Err(_) => Err("its zstd frame header is damaged".into()),
    }
}

/// `f` with this thread's zstd decompressor.
fn with_decompressor<T>(
    f: impl FnOnce(&mut zstd::bulk::Decompressor<'static>) -> Result<T, String>,
) -> Result<T, String> {
    DECOMPRESSOR.with(|d| {
        let mut d = d.borrow_mut();
        if d.is_none() {
            *d = Some(zstd::bulk::Decompressor::new().map_err(|e| format!("zstd: {e}"))?);
        }
        let Some(d) = d.as_mut() else { return Err("zstd: no decompressor".to_string()) };
        f(d)
    })
}

/// One zstd frame, exactly `z`, decompressed into at most `max_plain` bytes.
fn decompress(z: &[u8], max_plain: usize) -> Result<Vec<u8>, String> {
    let cap = frame_content(z, max_plain)?.unwrap_or(max_plain);
    with_decompressor(|d| {
        let mut plain = Vec::with_capacity(cap);
        match d.decompress_to_buffer(z, &mut plain) {
            Ok(_) if plain.len() <= max_plain => Ok(plain),
            Ok(_) => Err(format!("its zstd frame holds more than {max_plain} bytes")),
            Err(e) => Err(format!("its zstd frame does not decompress into at most {cap} bytes: {e}")),
        }
    })
}

/// One zstd frame, exactly `z`, decompressed into `out`, which it must fill exactly.
fn decompress_into(z: &[u8], out: &mut [u8]) -> Result<(), String> {
    let want = out.len();
    if let Some(n) = frame_content(z, want)?.filter(|&n| n != want) {
        return Err(format!("its zstd frame holds {n} bytes, not {want}"));
    }
    with_decompressor(|d| match d.decompress_to_buffer(z, out) {
        Ok(n) if n == want => Ok(()),
        Ok(n) => Err(format!("its zstd frame holds {n} bytes, not {want}")),
        Err(e) => Err(format!("its zstd frame does not decompress into {want} bytes: {e}")),
    })
}

/// The additional data of a blob's AEAD: "ferry blob " || kind || id.
pub fn aad(kind: BlobKind, id: &Digest) -> Vec<u8> {
    let mut a = b"ferry blob ".to_vec();
    a.push(kind as u8);
    a.extend_from_slice(id);
    a
}

/// Appends the stored form of `plain` (a blob of `kind` with id `id`) to `out`, and
/// returns its length. `level` is the zstd level.
pub fn encode_into(crypto: &Crypto, kind: BlobKind, id: &Digest, plain: &[u8], level: i32, out: &mut Vec<u8>) -> usize {
    let start = out.len();
    out.reserve(1 + plain.len() + crypto.overhead());
    out.resize(start + crypto.overhead_before(), 0);
    out.push(ZSTD);
    if !compress_into(plain, level, out) {
        let at = out.len() - 1;
        out[at] = RAW;
        out.extend_from_slice(plain);
    }
    crypto.seal_in_place(&aad(kind, id), out, start);
    out.len() - start
}

/// A stored blob back to its plain bytes, checked against its id (`crypto.blob_id` of
/// the plain bytes' digest must be `id`): at most `max_plain` bytes are ever allocated
/// for the plain bytes. The error says what failed (authentication, decompression,
/// length, digest).
pub fn decode(
    crypto: &Crypto,
    kind: BlobKind,
    id: &Digest,
    stored: &[u8],
    max_plain: usize,
) -> Result<Vec<u8>, String> {
    let plain = decode_unchecked(crypto, kind, id, stored, max_plain)?;
    if crypto.blob_id(&digest(&plain)) != *id {
        return Err("its plain bytes do not match its id (their digest differs)".into());
    }
    Ok(plain)
}

/// [`decode`] without its last step, the digest check: for a caller that checks the
/// digests of several blobs at once (side by side, with
/// [`ferry_hash::Algorithm::digest_many`]) before it uses their bytes.
pub fn decode_unchecked(
    crypto: &Crypto,
    kind: BlobKind,
    id: &Digest,
    stored: &[u8],
    max_plain: usize,
) -> Result<Vec<u8>, String> {
    let body: Cow<[u8]> = match crypto {
        Crypto::None => Cow::Borrowed(stored),
        _ => Cow::Owned(crypto.open(&aad(kind, id), stored).map_err(|e| e.to_string())?),
    };
    let plain = match body.split_first() {
        None => return Err("it is empty (not even its encoding byte)".into()),
        Some((&RAW, p)) if p.len() > max_plain => {
            return Err(format!("it holds {} plain bytes; at most {max_plain} are allowed", p.len()))
        }
        Some((&RAW, _)) => match body {
            Cow::Borrowed(b) => b[1..].to_vec(),
            Cow::Owned(mut v) => {
                v.remove(0);
                v
            }
        },
        Some((&ZSTD, z)) => decompress(z, max_plain)?,
        Some((b, _)) => return Err(format!("its encoding byte is {b}, neither 0 (raw) nor 1 (zstd)")),
    };
    Ok(plain)
}

/// [`decode_unchecked`] into `out`, which the plain bytes must fill exactly (else an
/// error): no plain copy of the blob is made, only `out` written (an encrypted blob is
/// opened into `scratch`, which the caller keeps for its next one). For a caller that
/// reads whole chunks into its own buffer and checks their digests there before it
/// hands the buffer on (a restore). On an error `out` may hold bytes that failed their check: the caller clears them (the
/// reader zeroes a failed chunk's range).
pub fn decode_unchecked_into(
    crypto: &Crypto,
    kind: BlobKind,
    id: &Digest,
    stored: &[u8],
    out: &mut [u8],
    scratch: &mut Vec<u8>,
) -> Result<(), String> {
    let aad = aad(kind, id);
    let body = crypto.open_via(&aad, stored, scratch).map_err(|e| e.to_string())?;
    match body.split_first() {
        None => Err("it is empty (not even its encoding byte)".into()),
        Some((&RAW, p)) if p.len() == out.len() => {
            out.copy_from_slice(p);
            Ok(())
        }
        Some((&RAW, p)) => Err(format!("it holds {} plain bytes, not {}", p.len(), out.len())),
        Some((&ZSTD, z)) => decompress_into(z, out),
        Some((b, _)) => Err(format!("its encoding byte is {b}, neither 0 (raw) nor 1 (zstd)")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crypto::{new_key, KdfLimit, KeyContext};
    use crate::format::KdfCost;
    use crate::format::Limits;

    fn encrypted() -> Crypto {
        new_key(
            b"pw",
            KdfCost { m_kib: 8192, t: 1, p: 1 },
            KdfLimit::Default,
            KeyContext { version: 2, repo_id: "r", chunk_size: 65536, page_entries: 256 },
        )
        .unwrap()
        .1
    }

    /// Deterministic bytes that do not compress.
    fn noise(len: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    fn text(len: usize) -> Vec<u8> {
        b"a chunk of a disk that compresses well. ".iter().copied().cycle().take(len).collect()
    }

    fn encode(c: &Crypto, kind: BlobKind, plain: &[u8]) -> (Digest, Vec<u8>) {
        let id = c.blob_id(&digest(plain));
        let mut out = b"pack so far".to_vec();
        let n = encode_into(c, kind, &id, plain, 3, &mut out);
        assert_eq!(n, out.len() - 11);
        (id, out.split_off(11))
    }

    #[test]
    fn blobs_round_trip_compressed_or_raw() {
        for c in [Crypto::None, encrypted()] {
            for (plain, compressed) in
                [(text(65536), true), (noise(65536, 1), false), (vec![7], false), (vec![], false)]
            {
                let (id, stored) = encode(&c, BlobKind::Data, &plain);
                let body = c.open(&aad(BlobKind::Data, &id), &stored).unwrap();
                assert_eq!(body[0], if compressed { ZSTD } else { RAW });
                if compressed {
                    assert!(body.len() < 1000, "{}", body.len());
                } else {
                    assert_eq!(body.len(), plain.len() + 1);
                }
                assert_eq!(decode(&c, BlobKind::Data, &id, &stored, 65536).unwrap(), plain);
            }
        }
    }

    #[test]
    fn damaged_blobs_are_refused() {
        for c in [Crypto::None, encrypted()] {
            let plain = text(65536);
            let (id, stored) = encode(&c, BlobKind::Data, &plain);
            // Another id, another kind (encrypted: its AAD), a smaller plain limit.
            let mut other = id;
            other[0] ^= 1;
            assert!(decode(&c, BlobKind::Data, &other, &stored, 65536).is_err());
            if c.is_encrypted() {
                let e = decode(&c, BlobKind::Page, &id, &stored, 65536).unwrap_err();
                assert!(e.contains("authentication"), "{e}");
            }
            let e = decode(&c, BlobKind::Data, &id, &stored, 65535).unwrap_err();
            assert!(e.contains("65536") && e.contains("65535"), "{e}");
            // Every truncation and every flipped byte.
            for n in 0..stored.len() {
                assert!(decode(&c, BlobKind::Data, &id, &stored[..n], 65536).is_err(), "{n} bytes");
                let mut t = stored.clone();
                t[n] ^= 0x10;
                // Unencrypted, a change zstd ignores (an unused header bit) is harmless: what
                // comes out is checked against the id.
                if let Ok(p) = decode(&c, BlobKind::Data, &id, &t, 65536) {
                    assert!(!c.is_encrypted() && p == plain, "byte {n}");
                }
            }
            // Bytes after the frame.
            if !c.is_encrypted() {
                let mut t = stored.clone();
                t.push(0);
                assert!(decode(&c, BlobKind::Data, &id, &t, 65536).unwrap_err().contains("frame"));
                let e = decode(&c, BlobKind::Data, &id, &[9, 1, 2], 65536).unwrap_err();
                assert!(e.contains("encoding byte is 9"), "{e}");
                assert!(decode(&c, BlobKind::Data, &id, &[], 65536).unwrap_err().contains("empty"));
                let raw = [&[RAW][..], &plain].concat();
                assert_eq!(decode(&c, BlobKind::Data, &id, &raw, 65536).unwrap(), plain);
                assert!(decode(&c, BlobKind::Data, &id, &raw, 100).unwrap_err().contains("at most 100"));
            }
        }
    }

    /// A frame of 256 MiB of zeroes (a few KiB) is refused before it is decompressed,
    /// and one that does not say its size is stopped at the limit.
    #[test]
    fn zstd_bombs_are_bounded() {
        let zeros = vec![0u8; 256 << 20];
        let z = zstd::bulk::compress(&zeros, 1).unwrap();
        assert!(z.len() < 64 << 10);
        let bomb = [&[ZSTD][..], &z].concat();
        let started = std::time::Instant::now();
        let e = decode(&Crypto::None, BlobKind::Data, &[0; 32], &bomb, 65536).unwrap_err();
        assert!(e.contains("268435456") && e.contains("65536"), "{e}");
        assert!(started.elapsed().as_millis() < 100);

        let mut c = zstd::bulk::Compressor::new(1).unwrap();
        c.set_parameter(zstd::zstd_safe::CParameter::ContentSizeFlag(false)).unwrap();
        let no_size = c.compress(&zeros[..4 << 20]).unwrap();
        assert!(matches!(zstd::zstd_safe::get_frame_content_size(&no_size), Ok(None)));
        let bomb = [&[ZSTD][..], &no_size].concat();
        let e = decode(&Crypto::None, BlobKind::Data, &[0; 32], &bomb, 65536).unwrap_err();
        assert!(e.contains("at most 65536"), "{e}");
        // The same kind of frame within the limit decodes.
        let small = c.compress(&text(1000)).unwrap();
        let id = digest(&text(1000));
        assert_eq!(
            decode(&Crypto::None, BlobKind::Data, &id, &[&[ZSTD][..], &small].concat(), 1000).unwrap(),
            text(1000)
        );
        // Two frames are not one.
        let two = [&[ZSTD][..], &small, &small].concat();
        assert!(decode(&Crypto::None, BlobKind::Data, &id, &two, 65536).is_err());
    }

    /// In an unencrypted repository a chunk's id is its blkhash block digest: a
    /// snapshot's blkhash (`ferry hash`, 64 KiB blocks) comes from its ids alone.
    #[test]
    fn unencrypted_data_ids_are_blkhash_block_digests() {
        let disk = [noise(65536, 3), vec![0; 65536], text(65536), noise(1000, 4)].concat();
        let h = ferry_hash::BlockHasher::new(ferry_hash::Algorithm::Sha256, 65536);
        h.add(0, &disk);
        let want = h.finish(disk.len() as u64).unwrap();
        let mut outer = Vec::new();
        for chunk in disk.chunks(65536) {
            let (id, stored) = encode(&Crypto::None, BlobKind::Data, chunk);
            assert_eq!(decode(&Crypto::None, BlobKind::Data, &id, &stored, 65536).unwrap(), chunk);
            outer.extend_from_slice(&id);
        }
        outer.extend_from_slice(&(disk.len() as u64).to_le_bytes());
        assert_eq!(digest(&outer).to_vec(), want);
    }

    #[test]
    fn pages_are_bounded_by_page_entries() {
        let l = Limits::DEFAULT;
        let page = noise(l.max_plain(BlobKind::Page), 9);
        let c = encrypted();
        let (id, stored) = encode(&c, BlobKind::Page, &page);
        assert_eq!(decode(&c, BlobKind::Page, &id, &stored, l.max_plain(BlobKind::Page)).unwrap(), page);
        assert!(decode(&c, BlobKind::Page, &id, &stored, 32 * 255).is_err());
        assert!(decode(&c, BlobKind::Data, &id, &stored, 65536).is_err());
    }
}

/// Throughput of the blob path on 64 KiB chunks (not a test: `cargo test --release -p
/// ferry-repo --lib blob::throughput -- --ignored --nocapture`). The chunks are this test
/// binary's own bytes (machine code and data, as a disk's files are) and random bytes.
#[cfg(test)]
mod throughput {
    use super::*;
    use crate::crypto::{new_key, KdfLimit, KeyContext};
    use crate::format::KdfCost;
    use std::time::Instant;

    /// The best of three runs (the machine may be shared).
    fn rate(what: &str, bytes: usize, mut f: impl FnMut()) {
        let best = (0..3)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64()
            })
            .fold(f64::MAX, f64::min);
        println!("{what:<44} {:>8.0} MB/s", bytes as f64 / best / 1e6);
    }

    #[test]
    #[ignore]
    fn throughput() {
        let mut exe = std::fs::read(std::env::current_exe().unwrap()).unwrap();
        exe.truncate((exe.len().min(64 << 20)) & !0xffff);
        let mut random = vec![0u8; 32 << 20];
        getrandom::fill(&mut random).unwrap();
        let aes = new_key(
            b"pw",
            KdfCost { m_kib: 8192, t: 1, p: 1 },
            KdfLimit::Default,
            KeyContext { version: 2, repo_id: "r", chunk_size: 65536, page_entries: 256 },
        )
        .unwrap()
        .1;
        let t = Instant::now();
        new_key(
            b"pw",
            crate::crypto::DEFAULT_KDF,
            KdfLimit::Default,
            KeyContext { version: 2, repo_id: "r", chunk_size: 65536, page_entries: 256 },
        )
        .unwrap();
        println!("{:<44} {:>8.2} s", "Argon2id at the default cost (64 MiB, t=3, p=4)", t.elapsed().as_secs_f64());
        for (name, data) in [("binary", &exe), ("random", &random)] {
            let chunks: Vec<&[u8]> = data.chunks(65536).collect();
            let mut out = Vec::with_capacity(data.len() + chunks.len() * 64);
            rate(&format!("AES-256-GCM seal, {name}"), data.len(), || {
                for c in &chunks {
                    out.clear();
                    aes.seal_into(b"ferry blob ", c, &mut out);
                }
            });
            // Format version 1 (one key) against 2 (a key per blob: FORMAT.md §4a), the same blobs.
            let ids: Vec<Digest> = chunks.iter().map(|c| digest(c)).collect();
            for version in [1, 2] {
                let c = crate::crypto::fixed_for_fuzzing(version);
                rate(&format!("blob seal, format {version}, {name}"), data.len(), || {
                    for (chunk, id) in chunks.iter().zip(&ids) {
                        out.clear();
                        c.seal_into(&aad(BlobKind::Data, id), chunk, &mut out);
                    }
                });
                let sealed: Vec<Vec<u8>> =
                    chunks.iter().zip(&ids).map(|(chunk, id)| c.seal(&aad(BlobKind::Data, id), chunk)).collect();
                rate(&format!("blob open, format {version}, {name}"), data.len(), || {
                    for (s, id) in sealed.iter().zip(&ids) {
                        c.open(&aad(BlobKind::Data, id), s).unwrap();
                    }
                });
            }
            let sealed: Vec<Vec<u8>> = chunks.iter().map(|c| aes.seal(b"a", c)).collect();
            rate(&format!("AES-256-GCM open, {name}"), data.len(), || {
                for s in &sealed {
                    aes.open(b"a", s).unwrap();
                }
            });
            rate(&format!("SHA-256 digest, {name}"), data.len(), || {
                for c in &chunks {
                    std::hint::black_box(digest(c));
                }
            });
            for level in [1, 3] {
                let mut stored = 0;
                let mut blobs = Vec::new();
                rate(&format!("zstd -{level} encode (no encryption), {name}"), data.len(), || {
                    (stored, blobs) = (0, Vec::new());
                    for c in &chunks {
                        let mut out = Vec::new();
                        let id = digest(c);
                        stored += encode_into(&Crypto::None, BlobKind::Data, &id, c, level, &mut out);
                        blobs.push((id, out));
                    }
                });
                println!(
                    "{:<44} {:>8.3}",
                    format!("  stored/plain at level {level}"),
                    stored as f64 / data.len() as f64
                );
                rate(&format!("zstd -{level} decode + digest check, {name}"), data.len(), || {
                    for (id, b) in &blobs {
                        decode(&Crypto::None, BlobKind::Data, id, b, 65536).unwrap();
                    }
                });
                rate(&format!("zstd -{level} + AES encode, {name}"), data.len(), || {
                    let mut out = Vec::new();
                    for c in &chunks {
                        out.clear();
                        encode_into(&aes, BlobKind::Data, &digest(c), c, level, &mut out);
                    }
                });
            }
        }
    }
}
