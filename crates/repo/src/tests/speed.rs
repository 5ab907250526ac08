//! A snapshot read fast (issue 35): whole chunks decoded in their place in the reader's
//! buffer (a restore), small reads through the cache from many threads, and none of it
//! at the cost of a byte unchecked.
use super::{backup, disk, new_repo, where_is, CS};
use crate::SnapshotImage;
use ferry_backend::Backend;

const MIB: usize = 1 << 20;

/// Reads `img` whole in `step`-byte reads from `start` (the bytes before it with one read).
fn read_in(img: &SnapshotImage, start: usize, step: usize) -> Vec<u8> {
    let mut out = vec![0u8; img.size() as usize];
    if start > 0 {
        img.read(&mut out[..start], 0).unwrap();
    }
    let mut pos = start;
    while pos < out.len() {
        let n = step.min(out.len() - pos);
        img.read(&mut out[pos..pos + n], pos as u64).unwrap();
        pos += n;
    }
    out
}

/// A restore's reads (1 MiB, whole chunks, decoded where they go) and reads that cut
/// chunks give the snapshot's bytes, plain and encrypted; whole chunks are not cached.
#[test]
fn whole_and_cut_reads_give_the_snapshot_byte_for_byte() {
    for encrypt in [false, true] {
        let (_store, repo) = new_repo(encrypt);
        // A short last chunk: the tail of the last 1 MiB read is one.
        let data = disk(5 * MIB + 12345, 31);
        let snap = backup(&repo, "d", &data, None);
        let img = SnapshotImage::open(repo.clone(), &snap).unwrap();
        assert!(read_in(&img, 0, MIB) == data, "1 MiB reads (encrypted: {encrypt})");
        assert_eq!(img.cached_bytes(), 0, "chunks read whole are not cached");
        // Reads that start inside a chunk and end inside another: the chunks in between
        // whole, the ends in part.
        let img = SnapshotImage::open(repo.clone(), &snap).unwrap();
        assert!(read_in(&img, 5000, 3 * CS + 777) == data, "cut reads (encrypted: {encrypt})");
    }
}

/// A damaged chunk fails every read that needs it, whole (decoded in the reader's
/// buffer, which is then not handed back as good) or in part, each time: it is never
/// cached. Raw and compressed chunks, plain and encrypted repositories.
#[test]
fn a_damaged_chunk_fails_each_read_and_is_never_cached() {
    for encrypt in [false, true] {
        // Chunk 7 holds random bytes (stored raw), chunk 8 text (zstd).
        for chunk in [7usize, 8] {
            let (store, repo) = new_repo(encrypt);
            let data = disk(2 * MIB, 12);
            let snap = backup(&repo, "d", &data, None);
            let (pack, at) = where_is(&repo, &snap, chunk);
            store.tamper(&pack, |v| v[at as usize] ^= 1);
            let img = SnapshotImage::open(repo.clone(), &snap).unwrap();
            let range = format!("{}..{}", chunk * CS, (chunk + 1) * CS);
            let mut big = vec![0xAAu8; MIB];
            let e = img.read(&mut big, 0).unwrap_err().to_string();
            assert!(e.contains(&range), "encrypted {encrypt}, chunk {chunk}: {e}");
            // The damaged chunk's bytes, decoded in place, are not left in the buffer.
            let bad = &big[chunk * CS..(chunk + 1) * CS];
            assert!(bad.iter().all(|&b| b == 0) || bad.iter().all(|&b| b == 0xAA), "unchecked bytes left");
            for _ in 0..2 {
                let mut small = vec![0u8; 4096];
                let e = img.read(&mut small, (chunk * CS + 100) as u64).unwrap_err().to_string();
                assert!(e.contains(&range), "encrypted {encrypt}, chunk {chunk}: {e}");
                assert_eq!(img.cached_bytes(), 0, "a damaged chunk was cached");
            }
            // The other chunks read well, whole and in part.
            let mut other = vec![0u8; MIB];
            img.read(&mut other, MIB as u64).unwrap();
            assert!(other[..] == data[MIB..]);
            let o = (chunk + 1) * CS + 100;
            let mut small = vec![0u8; 4096];
            img.read(&mut small, o as u64).unwrap();
            assert!(small[..] == data[o..o + 4096]);
        }
    }
}

/// Many threads read small pieces of the same few chunks at once, and of many chunks
/// through a cache far smaller than them (evicting as they go): every byte is right,
/// and the cache stays within its bound.
#[test]
fn concurrent_small_reads_of_shared_and_evicted_chunks_are_exact() {
    let (_store, repo) = new_repo(true);
    let data = disk(40 * MIB, 5);
    let snap = backup(&repo, "d", &data, None);
    // Budget 0: the image keeps its minimum, 16 MiB, of 40 MiB of chunks.
    let img = SnapshotImage::open_with_cache(repo, &snap, 0).unwrap();
    let chunks = data.len() / CS;
    std::thread::scope(|s| {
        for t in 0..8usize {
            let (img, data) = (&img, &data);
            s.spawn(move || {
                let mut q = img.io_queue().unwrap();
                let mut x = (t as u64 + 1) * 0x9E37_79B9;
                let mut offsets = Vec::new();
                for i in 0..600usize {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    // Half the reads on chunks 1-3 (shared by every thread), half anywhere.
                    let c = if i % 2 == 0 { 1 + (x as usize % 3) } else { x as usize % chunks };
                    let o = c * CS + (x >> 20) as usize % (CS - 4096);
                    q.submit_read(vec![0; 4096], o as u64);
                    offsets.push(o);
                    if q.len() >= 16 {
                        let (buf, r) = q.complete().unwrap();
                        r.unwrap();
                        let o = offsets.remove(0);
                        assert!(buf[..] == data[o..o + 4096], "thread {t}: the read at {o}");
                    }
                }
                while let Some((buf, r)) = q.complete() {
                    r.unwrap();
                    let o = offsets.remove(0);
                    assert!(buf[..] == data[o..o + 4096], "thread {t}: the read at {o}");
                }
            });
        }
    });
    assert!(img.cached_bytes() <= crate::MIN_CACHE_BYTES, "{} bytes cached", img.cached_bytes());
    assert!(img.cached_bytes() > 0);
}
