//! Proof that a copy landed: the destination read back and hashed ([`hash_range`]), and,
//! when its digest differs from the source's, the first block where the two differ
//! ([`first_difference`]).
//!
//! Both read an endpoint through the same [`Ops`] interface the copy uses, so they work
//! for every kind of endpoint that can be read (NBD, files, block devices, backends).
//! The read-back pass trusts the destination's allocation map the way `ferry hash` does
//! (a range it reports as reading zeroes is hashed as zeroes, not read), so its digest is
//! the one `ferry hash DST` prints.

use super::endpoint::{Kind, Ops, Read};
use super::{align_extents, CopyError, CopyOptions, Endpoint, Item, Queue, ZERO_CHUNK};
use ferry_hash::BlockHasher;
use ferry_sock::AlignedBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

/// Reads `reqs` into `bufs` and waits until every one has finished.
fn read_all(end: &mut dyn Ops, reqs: &[Read], bufs: &mut [AlignedBuf]) -> Result<(), CopyError> {
    let left = std::cell::Cell::new(reqs.len());
    let short = std::cell::Cell::new(None);
    let mut done = |slot: usize, got: u64| {
        left.set(left.get().saturating_sub(1));
        if let Some(r) = reqs.iter().find(|r| r.slot == slot) {
            if got < r.len as u64 && short.get().is_none() {
                short.set(Some((r.offset, r.len)));
            }
        }
    };
    end.read(reqs, bufs, &mut done)?;
    while left.get() > 0 {
        end.complete(bufs, &mut done)?;
    }
    if let Some((offset, len)) = short.get() {
        return Err(CopyError::request("read", offset, len as u64, "the endpoint ended early"));
    }
    Ok(())
}

/// Opens `e` for reading and checks it holds at least `length` bytes.
fn open_for_reading(e: &Endpoint, length: u64, opts: &CopyOptions) -> Result<Box<dyn Ops>, CopyError> {
    if matches!(e, Endpoint::Stdio | Endpoint::Null) {
        return Err(CopyError::Setup("a stream or null: cannot be read back".into()));
    }
    let end = e.open_source(opts)?;
    match end.size() {
        Some(s) if s >= length => Ok(end),
        Some(s) => {
            Err(CopyError::Setup(format!("{} is {s} bytes, shorter than the {length} bytes copied", end.name())))
        }
        None => Err(CopyError::Setup(format!("{} is a stream and cannot be read back", end.name()))),
    }
}

/// The blkhash of the first `length` bytes of `e`, read with `opts.connections`
/// connections (where the endpoint allows several) of `opts.requests` reads of
/// `opts.request_size` bytes each. The digest is `hasher`'s; the hasher is left fresh.
pub fn hash_range(e: &Endpoint, length: u64, hasher: &BlockHasher, opts: &CopyOptions) -> Result<Vec<u8>, CopyError> {
    let mut first = open_for_reading(e, length, opts)?;
    let bs = hasher.block_size() as u64;
    let caps = first.caps();
    let mut map = match opts.sparse && caps.extents {
        true => first.extents(length)?,
        false => vec![(0, length, Kind::Data)],
    };
    // Keep the map to 0..length (a destination may be larger than the source).
    map.retain(|r| r.0 < length);
    if let Some(last) = map.last_mut() {
        last.1 = last.1.min(length - last.0);
    }
    if map.is_empty() && length > 0 {
        map.push((0, length, Kind::Data));
    }
    let request_size = (opts.request_size.max(1) as u64).div_ceil(bs) * bs;
    let queue = Mutex::new(Queue {
        extents: align_extents(map, bs),
        idx: 0,
        pos: 0,
        request_size,
        zero_chunk: (ZERO_CHUNK / bs * bs).max(request_size),
        streaming: false,
        stream_end: false,
        pending: None,
        high: 0,
    });
    let workers = if caps.parallel { opts.connections.max(1) } else { 1 };
    let mut ends = vec![first];
    for _ in 1..workers {
        let next = ends[0].reopen()?;
        ends.push(next);
    }
    let abort = AtomicBool::new(false);
    let error: Mutex<Option<CopyError>> = Mutex::new(None);
    let rate = opts.rate.map(super::rate::RateLimit::new);
    std::thread::scope(|s| {
        for mut end in ends {
            let (queue, abort, error, rate) = (&queue, &abort, &error, rate.as_ref());
            s.spawn(move || {
                let r = hash_worker(&mut *end, queue, abort, hasher, opts, rate);
                if let Err(e) = r {
                    abort.store(true, Ordering::SeqCst);
                    error.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(e);
                }
                end.close();
            });
        }
    });
    if let Some(e) = error.into_inner().unwrap_or_else(|e| e.into_inner()) {
        // Leave the hasher fresh for the caller.
        let _ = hasher.finish(0);
        return Err(e);
    }
    hasher.finish(length).map_err(CopyError::Setup)
}

fn hash_worker(
    end: &mut dyn Ops,
    queue: &Mutex<Queue>,
    abort: &AtomicBool,
    hasher: &BlockHasher,
    opts: &CopyOptions,
    rate: Option<&super::rate::RateLimit>,
) -> Result<(), CopyError> {
    let requests = opts.requests.max(1);
    let mut bufs: Vec<AlignedBuf> = (0..requests).map(|_| AlignedBuf::default()).collect();
    loop {
        if abort.load(Ordering::SeqCst) {
            return Ok(());
        }
        if opts.cancelled() {
            return Err(CopyError::Interrupted);
        }
        let mut items: Vec<Item> = Vec::with_capacity(requests);
        {
            let mut q = queue.lock().unwrap_or_else(|e| e.into_inner());
            while items.len() < requests {
                match q.next() {
                    Some(it) => items.push(it),
                    None => break,
                }
            }
        }
        if items.is_empty() {
            return Ok(());
        }
        let mut reqs = Vec::new();
        for (slot, it) in items.iter().enumerate() {
            if it.kind == Kind::Zero {
                hasher.add_zeroes(it.offset, it.len as u64);
            } else {
                if let Some(r) = rate {
                    r.take(it.len as u64, || opts.cancelled());
                }
                bufs[slot].reserve(it.len);
                reqs.push(Read { slot, offset: it.offset, len: it.len });
            }
        }
        read_all(end, &reqs, &mut bufs)?;
        for r in &reqs {
            hasher.add(r.offset, &bufs[r.slot][..r.len]);
        }
    }
}

/// The first `block_size`-byte block (its index) of `0..length` where `a` and `b` hold
/// different bytes, reading both in full; `None` when they are equal.
pub fn first_difference(
    a: &Endpoint,
    b: &Endpoint,
    length: u64,
    block_size: usize,
    opts: &CopyOptions,
) -> Result<Option<u64>, CopyError> {
    let bs = block_size.max(1) as u64;
    let mut ea = open_for_reading(a, length, opts)?;
    let mut eb = open_for_reading(b, length, opts)?;
    let chunk = ((opts.request_size.max(1) as u64).div_ceil(bs) * bs).max(bs);
    let mut ba = vec![AlignedBuf::default()];
    let mut bb = vec![AlignedBuf::default()];
    let mut pos = 0u64;
    let result = loop {
        if pos >= length {
            break Ok(None);
        }
        if opts.cancelled() {
            break Err(CopyError::Interrupted);
        }
        let len = (length - pos).min(chunk) as usize;
        ba[0].reserve(len);
        bb[0].reserve(len);
        let req = [Read { slot: 0, offset: pos, len }];
        if let Err(e) = read_all(&mut *ea, &req, &mut ba).and_then(|_| read_all(&mut *eb, &req, &mut bb)) {
            break Err(e);
        }
        let differs = ba[0][..len].chunks(bs as usize).zip(bb[0][..len].chunks(bs as usize)).position(|(x, y)| x != y);
        if let Some(i) = differs {
            break Ok(Some(pos / bs + i as u64));
        }
        pos += len as u64;
    };
    ea.close();
    eb.close();
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_hash::Algorithm;

    #[test]
    fn read_back_digest_matches_and_first_difference_is_named() {
        let dir = tempfile_dir();
        let (a, b) = (dir.join("a"), dir.join("b"));
        let bs = 4096usize;
        let mut data = vec![0u8; 10 * bs + 123];
        for (i, x) in data.iter_mut().enumerate().skip(3 * bs) {
            *x = (i % 251) as u8;
        }
        std::fs::write(&a, &data).unwrap();
        data[7 * bs + 5] ^= 0xff;
        // b is longer: only the first `len` bytes count.
        let mut longer = data.clone();
        longer.extend_from_slice(&[1, 2, 3]);
        std::fs::write(&b, &longer).unwrap();
        let len = data.len() as u64;
        let opts = CopyOptions { request_size: 3 * bs, connections: 2, requests: 2, ..CopyOptions::default() };
        let (ea, eb) = (Endpoint::File(a.clone()), Endpoint::File(b.clone()));
        let h = BlockHasher::new(Algorithm::Sha256, bs);
        let da = hash_range(&ea, len, &h, &opts).unwrap();
        let db = hash_range(&eb, len, &h, &opts).unwrap();
        assert_ne!(da, db);
        let h2 = BlockHasher::new(Algorithm::Sha256, bs);
        h2.add(0, &std::fs::read(&a).unwrap());
        assert_eq!(h2.finish(len).unwrap(), da, "read-back digest is the blkhash of the bytes");
        assert_eq!(first_difference(&ea, &eb, len, bs, &opts).unwrap(), Some(7));
        assert_eq!(first_difference(&ea, &ea, len, bs, &opts).unwrap(), None);
        assert!(hash_range(&ea, len + 1, &h, &opts).is_err(), "a short endpoint is refused");
        assert!(hash_range(&Endpoint::Null, 1, &h, &opts).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn tempfile_dir() -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("ferry-verify-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}
