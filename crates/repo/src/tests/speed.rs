//! A snapshot read fast (issue 35): whole chunks decoded in their place in the reader's
//! buffer (a restore), small reads through the cache from many threads, and none of it
//! at the cost of a byte unchecked.
use super::{backup, disk, new_repo, where_is, Gate, CS};
use crate::store::Store;
use crate::{Repository, SnapshotImage};
use ferry_backend::Backend;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const MIB: usize = 1 << 20;

/// `snap` opened with a cache budget of `bytes` of its own: what other tests running
/// beside it cache does not count against it (the process's budget is one for all).
fn open_alone(repo: Arc<Repository>, snap: &crate::SnapshotInfo, bytes: u64) -> Arc<SnapshotImage> {
    SnapshotImage::open_sharing(repo, snap, bytes, Box::leak(Box::new(AtomicU64::new(0)))).unwrap()
}

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
    let img = open_alone(repo, &snap, 0);
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

/// Chunks whose digest is not the zero chunk's: what a cache can hold.
fn data_chunks(img: &SnapshotImage) -> Vec<usize> {
    (0..img.entries().len()).filter(|&c| img.entries()[c] != crate::format::ZERO).collect()
}

/// A served snapshot (`keep_whole_reads`) keeps the chunks it reads whole while its cache
/// has room: a later small read of one is answered from the cache (here, with every copy
/// in the store damaged after the whole read, it still gives the right bytes). A chunk
/// that fails its check is not kept, and fails each read of it.
#[test]
fn whole_reads_of_a_served_snapshot_fill_the_cache_with_checked_chunks() {
    for encrypt in [false, true] {
        let (store, repo) = new_repo(encrypt);
        let data = disk(4 * MIB, 9);
        let snap = backup(&repo, "d", &data, None);
        // Chunk 7 damaged before anything is read.
        let (pack, at) = where_is(&repo, &snap, 7);
        store.tamper(&pack, |v| v[at as usize] ^= 1);
        let img = open_alone(repo.clone(), &snap, 1 << 30);
        img.keep_whole_reads();
        let mut big = vec![0u8; MIB];
        assert!(img.read(&mut big, 0).is_err(), "the damaged chunk 7 fails its read");
        for at in (MIB..data.len()).step_by(MIB) {
            img.read(&mut big, at as u64).unwrap();
            assert!(big[..] == data[at..at + MIB]);
        }
        // Every data chunk of the reads that succeeded is kept (and some of the failed
        // read's good ones, those checked before chunk 7 failed it), never chunk 7.
        let kept: Vec<usize> = data_chunks(&img).into_iter().filter(|&c| c >= MIB / CS).collect();
        let all = data_chunks(&img).len();
        assert!(!kept.is_empty() && all > kept.len());
        let cached = img.cached_bytes() as usize;
        assert!(cached >= kept.len() * CS && cached < all * CS, "{cached} bytes cached");
        // Every kept chunk's stored copy damaged: small reads of them are the cache's.
        for &c in &kept {
            let (pack, at) = where_is(&repo, &snap, c);
            store.tamper(&pack, |v| v[at as usize] ^= 0x40);
        }
        for &c in &kept {
            let mut small = vec![0u8; 4096];
            let o = c * CS + 1000;
            img.read(&mut small, o as u64).unwrap();
            assert!(small[..] == data[o..o + 4096], "chunk {c} (encrypted {encrypt})");
        }
        // The damaged chunk was not kept: each read of it fails.
        for _ in 0..2 {
            let mut small = vec![0u8; 4096];
            let e = img.read(&mut small, (7 * CS + 100) as u64).unwrap_err().to_string();
            assert!(e.contains(&format!("{}..{}", 7 * CS, 8 * CS)), "{e}");
        }
        // A restore's image (the default) keeps nothing it reads whole.
        let plain = open_alone(repo, &snap, 1 << 30);
        let _ = plain.read(&mut big, 2 * MIB as u64);
        assert_eq!(plain.cached_bytes(), 0);
    }
}

/// Whole reads fill only the room the cache has: they never evict, so the chunks small
/// reads brought in stay, and the cache stays within its bound (16 MiB here, the
/// minimum, for 40 MiB of chunks read whole; whole reads fill at most half of it).
#[test]
fn whole_reads_never_push_out_what_small_reads_cached() {
    let (store, repo) = new_repo(false);
    let data = disk(40 * MIB, 6);
    let snap = backup(&repo, "d", &data, None);
    let img = open_alone(repo.clone(), &snap, crate::MIN_CACHE_BYTES);
    img.keep_whole_reads();
    // Small reads of the last few data chunks first (the whole reads reach them last).
    let small: Vec<usize> = data_chunks(&img).into_iter().rev().take(8).collect();
    for &c in &small {
        let mut b = vec![0u8; 4096];
        img.read(&mut b, (c * CS) as u64).unwrap();
    }
    let mut big = vec![0u8; MIB];
    for at in (0..data.len()).step_by(MIB) {
        img.read(&mut big, at as u64).unwrap();
        assert!(big[..] == data[at..at + MIB]);
        assert!(img.cached_bytes() <= crate::MIN_CACHE_BYTES, "{} bytes cached", img.cached_bytes());
    }
    assert!(img.cached_bytes() > (8 * CS) as u64, "whole reads filled the room there was");
    for &c in &small {
        let (pack, at) = where_is(&repo, &snap, c);
        store.tamper(&pack, |v| v[at as usize] ^= 0x40);
        let mut b = vec![0u8; 4096];
        let o = c * CS + 4096;
        img.read(&mut b, o as u64).unwrap();
        assert!(b[..] == data[o..o + 4096], "chunk {c}, read small first, was evicted");
    }
}

/// One served snapshot read through in large reads (an nbdcopy of vm1) keeps chunks
/// only up to half the budget it shares: another snapshot's small reads (vm2 booting)
/// still keep their working set, more than the minimum each image is sure of.
#[test]
fn whole_reads_of_one_snapshot_leave_room_for_another_s_small_reads() {
    let (_store, repo) = new_repo(false);
    let (a_data, b_data) = (disk(64 * MIB, 31), disk(28 * MIB, 32));
    let (a_snap, b_snap) = (backup(&repo, "a", &a_data, None), backup(&repo, "b", &b_data, None));
    let budget = 48 * MIB as u64;
    let shared: &'static AtomicU64 = Box::leak(Box::new(AtomicU64::new(0)));
    let a = SnapshotImage::open_sharing(repo.clone(), &a_snap, budget, shared).unwrap();
    let b = SnapshotImage::open_sharing(repo, &b_snap, budget, shared).unwrap();
    a.keep_whole_reads();
    b.keep_whole_reads();
    let mut big = vec![0u8; MIB];
    for at in (0..a_data.len()).step_by(MIB) {
        a.read(&mut big, at as u64).unwrap();
    }
    assert!(a.cached_bytes() <= budget / 2, "{} bytes kept from whole reads", a.cached_bytes());
    assert!(a.cached_bytes() > budget / 4, "{} bytes kept from whole reads", a.cached_bytes());
    let working = (data_chunks(&b).len() * CS) as u64;
    assert!(working > crate::MIN_CACHE_BYTES);
    let mut small = vec![0u8; 4096];
    for c in data_chunks(&b) {
        let o = c * CS + 100;
        b.read(&mut small, o as u64).unwrap();
        assert!(small[..] == b_data[o..o + 4096]);
    }
    assert_eq!(b.cached_bytes(), working, "the second snapshot's small reads were pushed out");
    assert_eq!(shared.load(Ordering::Relaxed), a.cached_bytes() + b.cached_bytes());
    drop((a, b));
    assert_eq!(shared.load(Ordering::Relaxed), 0);
}

/// A small read whose chunks are cached (or zero) is answered as it comes, even while
/// every thread of the pool waits on the store: it costs no hand-off to another thread.
#[test]
fn cached_reads_are_answered_while_the_pool_waits() {
    let (store, repo) = new_repo(false);
    let data = disk(8 * MIB, 21);
    let snap = backup(&repo, "d", &data, None);
    // Ranged reads wait until one more than the pool's threads are in at once: never,
    // so each waits 5 s (opening the image and the first read too).
    let threads = crate::reader::pool_threads(false);
    let gate = Arc::new(Gate::new(store, threads + 1, false));
    let repo = Arc::new(Repository::open(gate.clone(), &|| unreachable!()).unwrap());
    let img = SnapshotImage::open(repo, &snap).unwrap();
    // Chunk 1 read in part: cached (its read waits out the gate).
    let at = CS + 4096;
    let mut buf = vec![0u8; 4096];
    img.read(&mut buf, at as u64).unwrap();
    // Every pool thread stuck in the store, on chunks not cached.
    let mut stuck = img.io_queue().unwrap();
    let mut c = 2;
    for _ in 0..threads {
        while c % 5 == 0 {
            c += 1;
        }
        stuck.submit_read(vec![0; 4096], (c * CS) as u64);
        c += 1;
    }
    // The end of the connection's run of requests: the pool's threads start them.
    stuck.submitted();
    let inside = || *gate.inside.lock().unwrap();
    let t = Instant::now();
    while inside() < threads && t.elapsed() < Duration::from_secs(4) {
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(inside(), threads, "the pool's threads did not all reach the store");
    // A cached read and a zero chunk's read on another connection.
    let mut q = img.io_queue().unwrap();
    q.submit_read(vec![0; 4096], at as u64 + 512);
    q.submit_read(vec![1; 4096], 100);
    // The pool's threads are held for 5 s: a read handed to them is not done in 2.
    let t = Instant::now();
    while !q.oldest_done() && t.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(q.oldest_done(), "a cached read waited for the pool");
    let (buf, r) = q.complete().unwrap();
    r.unwrap();
    assert!(buf[..] == data[at + 512..at + 512 + 4096]);
    let (buf, r) = q.complete().unwrap();
    r.unwrap();
    assert!(buf.iter().all(|&b| b == 0), "chunk 0 is zero");
    while let Some((_, r)) = stuck.complete() {
        r.unwrap();
    }
}

/// A miss of a full cache decodes its chunk into the buffer of the chunk its shard last
/// evicted (the decoded chunk takes no new buffer, so no fresh pages to fault in): the chunk evicted first lends its
/// buffer to the next miss of its shard, and the bytes read through it are right; a
/// damaged chunk decoded into a lent buffer still fails and is not cached.
#[test]
fn a_miss_of_a_full_cache_decodes_into_an_evicted_chunk_s_buffer() {
    let (store, repo) = new_repo(false);
    let data = disk(24 * MIB, 14);
    let snap = backup(&repo, "d", &data, None);
    // The minimum budget: 16 MiB, 16 chunks a shard (of 16); chunks 0, 16, 32... share one.
    let img = open_alone(repo.clone(), &snap, 0);
    let shard: Vec<usize> = data_chunks(&img).into_iter().filter(|c| c % 16 == 0).collect();
    assert!(shard.len() >= 19, "{} data chunks in shard 0", shard.len());
    let read = |c: usize| {
        let mut b = vec![0u8; 4096];
        let o = c * CS + 3000;
        let r = img.read(&mut b, o as u64);
        if r.is_ok() {
            assert!(b[..] == data[o..o + 4096], "chunk {c}");
        }
        r
    };
    for &c in &shard[..16] {
        read(c).unwrap();
    }
    let first = img.cached_at(shard[0] as u64).expect("chunk cached");
    assert_eq!(img.spare_at(0), None, "no chunk evicted yet");
    // The 17th evicts the first (the least recently used), whose buffer the shard keeps.
    read(shard[16]).unwrap();
    assert_eq!(img.cached_at(shard[0] as u64), None);
    assert_eq!(img.spare_at(0), Some(first), "the evicted chunk's buffer was not kept");
    // The 18th is decoded into it, and evicts the second, whose buffer is the next spare.
    // (Were the spare dropped instead, its memory could come back for the new chunk: the
    // allocation here takes it, so that only the reuse puts the chunk at `first`.)
    let other = vec![1u8; CS];
    read(shard[17]).unwrap();
    assert_ne!(other.as_ptr() as usize, first);
    assert_eq!(img.cached_at(shard[17] as u64), Some(first), "the evicted chunk's buffer was not reused");
    // A damaged chunk decoded into a lent buffer (shard[1]'s, evicted by shard[17]) fails
    // its check each time, and is never cached.
    let (pack, at) = where_is(&repo, &snap, shard[18]);
    store.tamper(&pack, |v| v[at as usize] ^= 1);
    for _ in 0..2 {
        let e = read(shard[18]).unwrap_err().to_string();
        assert!(e.contains(&format!("{}..", shard[18] * CS)), "{e}");
        assert_eq!(img.cached_at(shard[18] as u64), None);
    }
    assert!(img.cached_bytes() <= crate::MIN_CACHE_BYTES);
}

/// Misses queued deeper than the pool's threads (a connection's run of requests while
/// the threads are busy) are read a few at a time by one thread, their chunks checked
/// together (SHA-256 side by side): each read gets its own bytes, and a damaged chunk
/// among them (decoded well, its digest wrong) fails its own read alone and is not
/// cached. A queue no deeper than the threads is still read one a thread (the tests of
/// reads side by side above).
#[test]
fn misses_queued_deeper_than_the_pool_are_checked_together_each_its_own() {
    for encrypt in [false, true] {
        queued_misses_checked_together(encrypt);
    }
}

fn queued_misses_checked_together(encrypt: bool) {
    let (store, repo) = new_repo(encrypt);
    let data = disk(16 * MIB, 23);
    let snap = backup(&repo, "d", &data, None);
    let img = open_alone(repo.clone(), &snap, 64 * MIB as u64);
    let chunks = data_chunks(&img);
    // Random data (chunk number 2 mod 5) is stored raw: in a plain repository a flipped
    // byte decodes, and only its digest tells (in an encrypted one, its tag).
    let bad = chunks.iter().copied().filter(|c| c % 5 == 2).nth(4).unwrap();
    let (pack, at) = where_is(&repo, &snap, bad);
    store.tamper(&pack, |v| v[at as usize] ^= 1);
    let mut q = img.io_queue().unwrap();
    for &c in &chunks {
        q.submit_read(vec![0; 4096], (c * CS + 1000) as u64);
    }
    q.submitted();
    for &c in &chunks {
        let (buf, r) = q.complete().unwrap();
        if c == bad {
            let e = r.unwrap_err().to_string();
            assert!(e.contains(&format!("{}..", c * CS)), "{e}");
            assert_eq!(img.cached_at(c as u64), None, "a damaged chunk was cached");
        } else {
            r.unwrap();
            assert!(buf[..] == data[c * CS + 1000..c * CS + 5096], "chunk {c}");
        }
    }
    assert!(q.complete().is_none());
    let (group, largest) = (ferry_hash::sha256_group(), img.largest_batch());
    if group > 1 {
        assert!(
            largest > 1,
            "{} misses queued to {} threads were checked one at a time",
            chunks.len(),
            img.read_threads()
        );
    }
    // Read again: each from the cache now, the damaged one failing again.
    for &c in &chunks {
        let mut b = vec![0u8; 4096];
        let r = img.read(&mut b, (c * CS + 1000) as u64);
        assert_eq!(r.is_ok(), c != bad, "chunk {c}");
    }
}

/// The read pool is sized by the store: one thread per core (at least 4, for a cold disk's
/// depth) for a store on this machine (a directory, memory); at least 8 for an object
/// store, whose reads wait on the network.
#[test]
fn the_read_pool_is_sized_by_the_store() {
    let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
    assert_eq!(crate::reader::pool_threads(true), cores.clamp(4, 32));
    assert_eq!(crate::reader::pool_threads(false), cores.clamp(crate::repo::FETCH_THREADS, 32));
    // A memory store and a directory (not on a network file system) are local.
    let (store, repo) = new_repo(false);
    assert!(store.local());
    let snap = backup(&repo, "d", &disk(MIB, 3), None);
    assert_eq!(SnapshotImage::open(repo, &snap).unwrap().read_threads(), cores.clamp(4, 32));
    // A directory is local unless it is on a network file system (told by its magic
    // number: store::dir's tests), which TMPDIR may be: its pool follows what it says.
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(crate::store::DirStore::create(&dir.path().join("r")).unwrap());
    let local = store.local();
    let repo = Arc::new(Repository::init(store, &super::init_opts(false)).unwrap());
    let snap = backup(&repo, "d", &disk(MIB, 3), None);
    let threads = SnapshotImage::open(repo, &snap).unwrap().read_threads();
    assert_eq!(threads, crate::reader::pool_threads(local));
    // An S3 store (opening one sends no request) and a store of unknown kind are not.
    let cfg = ferry_s3::S3Config::with_endpoint("http://127.0.0.1:9", "key", "secret", "us-east-1");
    let s3 = crate::store::S3Store::open("s3://bucket/repo", &cfg, &Default::default()).unwrap();
    assert!(!s3.local());
    let (store, repo) = new_repo(false);
    let snap = backup(&repo, "d", &disk(MIB, 3), None);
    let gate = Arc::new(Gate::new(store, 1, false));
    assert!(!gate.local());
    let repo = Arc::new(Repository::open(gate, &|| unreachable!()).unwrap());
    let threads = SnapshotImage::open(repo, &snap).unwrap().read_threads();
    assert!(threads >= crate::repo::FETCH_THREADS, "{threads} threads for a store of unknown kind");
}

/// The misses of one connection run side by side on a local store's pool too (one
/// thread a core, at least 4): every thread of it is in the store at once. Were they run
/// one at a time, each would wait out the store's gate (5 s). While all but one are held
/// in the store, a hit of a chunk in the same cache shard as one of them is answered at
/// once: no shard's lock is held across a miss's read.
#[test]
fn misses_run_side_by_side_on_a_local_store_s_pool() {
    let (store, repo) = new_repo(false);
    let data = disk(8 * MIB, 22);
    let snap = backup(&repo, "d", &data, None);
    let threads = crate::reader::pool_threads(true);
    // Open while the gate stands open; then ranged reads wait until `threads` are in.
    let gate = Arc::new(Gate::new(store, threads, true));
    gate.met.store(true, Ordering::SeqCst);
    let repo = Arc::new(Repository::open(gate.clone(), &|| unreachable!()).unwrap());
    let img = SnapshotImage::open(repo, &snap).unwrap();
    assert_eq!(img.read_threads(), threads);
    // One small read of each of `threads` data chunks (every fifth chunk is zero).
    let chunks: Vec<usize> = (0..data.len() / CS).filter(|c| c % 5 != 0).take(threads).collect();
    // A chunk in the cache shard of the first (16 shards, by chunk number), cached now.
    let hit = (chunks[0] + 16..data.len() / CS).step_by(16).find(|c| c % 5 != 0 && !chunks.contains(c)).unwrap();
    let mut b = vec![0u8; 4096];
    img.read(&mut b, (hit * CS) as u64).unwrap();
    gate.met.store(false, Ordering::SeqCst);
    let mut q = img.io_queue().unwrap();
    let t = Instant::now();
    for &c in &chunks[..threads - 1] {
        q.submit_read(vec![0; 4096], (c * CS + 512) as u64);
    }
    q.submitted();
    while *gate.inside.lock().unwrap() < threads - 1 {
        assert!(t.elapsed() < Duration::from_secs(2), "the misses did not reach the store");
        std::thread::sleep(Duration::from_millis(2));
    }
    let held = Instant::now();
    img.read(&mut b, (hit * CS + 100) as u64).unwrap();
    assert!(b[..] == data[hit * CS + 100..hit * CS + 4196]);
    assert!(held.elapsed() < Duration::from_secs(2), "a hit waited for a miss of its shard: {:?}", held.elapsed());
    q.submit_read(vec![0; 4096], (chunks[threads - 1] * CS + 512) as u64);
    for &c in &chunks {
        let (buf, r) = q.complete().unwrap();
        r.unwrap();
        assert!(buf[..] == data[c * CS + 512..c * CS + 512 + 4096], "chunk {c}");
    }
    assert!(t.elapsed() < Duration::from_secs(4), "the misses ran one at a time: {:?}", t.elapsed());
    assert!(gate.met.load(Ordering::SeqCst));
}

/// `FERRY_REPO_READ_THREADS` sets the read pool's threads: 1 to 64; anything else is
/// refused with the range, and unset or empty leaves the pool sized by the store.
#[test]
fn the_read_threads_are_set_from_1_to_64() {
    let from = crate::reader::read_threads_from;
    assert_eq!(from(None).unwrap(), None);
    assert_eq!(from(Some("")).unwrap(), None);
    assert_eq!(from(Some("1")).unwrap(), Some(1));
    assert_eq!(from(Some(" 64 ")).unwrap(), Some(64));
    for bad in ["0", "65", "-1", "4k", "many", "99999999999999999999999"] {
        let e = from(Some(bad)).unwrap_err().to_string();
        assert!(e.contains("FERRY_REPO_READ_THREADS") && e.contains("from 1 to 64"), "{bad}: {e}");
    }
}
