//! What a change map continues (`ferry backup --dirty-bitmap|--extents-from --since ID`).
//!
//! A change map says which ranges changed since some point; the rest of the new snapshot
//! is taken from the base. ferry cannot see what a bitmap it does not own was started or
//! cleared against, so the caller names that snapshot (`--since ID`, the id `ferry backup`
//! printed for it), and a map is applied only when that snapshot is the disk's latest:
//! a stale bitmap (one bitmap feeding two repositories), a rolled-back snapshot list (the
//! newest manifest deleted from the store) or a map meant for another repository is
//! refused instead of making a snapshot that misses changes. Then a sample of the chunks
//! the map calls unchanged is read from the source and compared with the base's digests
//! ([`sample`]): that catches a map or a source of another disk (not one lost change).

use crate::short_id;
use anyhow::{bail, Context, Result};
use ferry_backend::{Backend, Capabilities, ZeroMode};
use ferry_client::copy::{copy, BackendEndpoint, CopyOptions, Endpoint, Progress};
use ferry_repo::SnapshotInfo;
use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::{Arc, Mutex};

/// At most this many unchanged chunks are read to check a map against its base...
pub(crate) const SAMPLE_CHUNKS: u64 = 32;
/// ...and at most this many bytes (4 chunks of 1 MiB, 32 of the default 64 KiB: 2 MiB).
pub(crate) const SAMPLE_BYTES: u64 = 4 << 20;

/// The command line of a change-map backup, for what a refusal tells the user to run.
pub(crate) struct MapCommand<'a> {
    /// `--dirty-bitmap` or `--extents-from`.
    pub flag: &'a str,
    /// Its value (the bitmap's name, the file).
    pub value: &'a str,
    /// The source, as shown (credentials removed).
    pub src: &'a str,
    /// REPO::NAME.
    pub target: &'a str,
    pub name: &'a str,
}

impl MapCommand<'_> {
    /// The backup without the map: it reads everything and needs no base.
    fn full(&self) -> String {
        format!("ferry backup {} {}", sh(self.src), sh(self.target))
    }

    fn with_since(&self, id: &str) -> String {
        format!("ferry backup {} {} --since {id} {} {}", self.flag, sh(self.value), sh(self.src), sh(self.target))
    }

    /// The refusal of a map without `--since`, `latest` the disk's latest snapshot.
    pub(crate) fn needs_since(&self, latest: &SnapshotInfo) -> anyhow::Error {
        anyhow::anyhow!(
            "{flag} needs --since ID, ID the snapshot of {name} that the change map continues (the id `ferry backup` \
             printed for the backup after which the map was started or cleared; `--json` gives it as \"id\"): \
             ferry cannot tell what point a change map starts from, and a map applied to another snapshot stores a disk \
             that misses changes. Run `{with}`, with that snapshot's id ({name}'s latest is {short} of {time}; name \
             it only if the map holds every change since that backup), or, if you do not know, `{full}` (it reads \
             everything and stores only what is new)",
            flag = self.flag,
            name = self.name,
            with = self.with_since("ID"),
            short = short_id(&latest.id),
            time = latest.manifest.time,
            full = self.full(),
        )
    }

    /// Checks that `since` names `latest`, the disk's latest snapshot (the base a map is
    /// applied to). `named` is what `since` resolves to among the disk's snapshots.
    pub(crate) fn check_since(
        &self,
        since: &str,
        latest: &SnapshotInfo,
        named: impl FnOnce() -> ferry_repo::Result<SnapshotInfo>,
    ) -> Result<()> {
        let full = self.full();
        let latest_shown = format!("{} of {}", short_id(&latest.id), latest.manifest.time);
        let since = since.to_ascii_lowercase();
        // The full id (as scripts keep it) needs no second listing.
        if since.len() == latest.id.len() && since == latest.id {
            return Ok(());
        }
        let s = match named() {
            Ok(s) => s,
            // The latest, migrated since the map was started (`ferry repo migrate`): the old
            // id is hidden, and the new manifest names it.
            Err(ferry_repo::Error::NotFound(_)) if migrated_from(latest, &since) => {
                log::info!(
                    "--since {since}: snapshot {since} of {} was migrated to {} (`ferry repo migrate`), its latest: \
                     the change map continues it",
                    self.name,
                    short_id(&latest.id)
                );
                return Ok(());
            }
            Err(ferry_repo::Error::NotFound(why)) => bail!(
                "--since {since}: {why}. The change map continues a snapshot that is not there (forgotten, or \
                 removed from the store), so it cannot be applied to {name}'s latest ({latest_shown}): it would \
                 miss the changes between them. Back up without {flag}: `{full}` (it reads everything and stores \
                 only what is new), then start or clear the map at that backup and give its id next time",
                name = self.name,
                flag = self.flag,
            ),
            Err(e) => return Err(anyhow::Error::new(e).context(format!("--since {since}"))),
        };
        if s.id != latest.id {
            bail!(
                "--since {since}: snapshot {} of {name} ({}) is not its latest, {latest_shown} is: the change map \
                 continues {}, so applied to the latest it would miss what changed between them (a bitmap cleared \
                 after a backup into another repository, or a snapshot list that went back). Back up without {flag}: \
                 `{full}` (it reads everything and stores only what is new), then start or clear the map at that \
                 backup and give its id next time; keep one bitmap per repository",
                short_id(&s.id),
                s.manifest.time,
                short_id(&s.id),
                name = self.name,
                flag = self.flag,
            );
        }
        Ok(())
    }

    /// The refusal of a map whose unchanged chunks differ from the base.
    fn does_not_fit(&self, base: &SnapshotInfo, checked: usize, bad: &[u64]) -> anyhow::Error {
        anyhow::anyhow!(
            "the change map does not fit {target}: of {checked} chunks it calls unchanged since snapshot {short} \
             (read from the source to check), {n} differ from that snapshot (the first at byte {first}). The source \
             is another disk, or the map was not started at that snapshot; nothing was stored. Back up without \
             {flag}: `{full}` (it reads everything and stores only what is new)",
            target = self.target,
            short = short_id(&base.id),
            n = bad.len(),
            first = bad[0],
            flag = self.flag,
            full = self.full(),
        )
    }
}

/// Whether `since` (an id or a prefix of one, lower case) names the manifest `snap` was
/// migrated from.
fn migrated_from(snap: &SnapshotInfo, since: &str) -> bool {
    snap.manifest.migrated_from.as_deref().is_some_and(|old| since.len() >= 4 && old.starts_with(since))
}

/// `s` as one shell word.
fn sh(s: &str) -> String {
    let plain = !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"/._:=@%+,-".contains(&b));
    match plain {
        true => s.to_string(),
        false => format!("'{}'", s.replace('\'', "'\\''")),
    }
}

/// Which chunks to read to check a map: up to `n`, one in each of `n` equal stretches of
/// the disk (from a random chunk of the stretch on, the first that the map calls
/// unchanged and the base holds as data; none where the stretch has no such chunk).
/// `changed` is the map widened to whole chunks (sorted, disjoint, in bytes); `entry`
/// gives the base's entry of each of the `chunks` chunks.
fn pick(
    (entry, chunks): (&dyn Fn(u64) -> ferry_repo::format::Digest, u64),
    changed: &[(u64, u64)],
    cs: u64,
    n: u64,
    seed: u64,
) -> Vec<u64> {
    let mut rng = seed | 1;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let clean = |ci: u64| {
        let at = ci * cs;
        // The first changed range that ends after the chunk starts.
        let i = changed.partition_point(|&(o, l)| o + l <= at);
        changed.get(i).is_none_or(|&(o, _)| o >= at + cs)
    };
    let usable = |ci: u64| entry(ci) != ferry_repo::format::ZERO && clean(ci);
    let n = n.min(chunks);
    let mut out = Vec::new();
    for s in 0..n {
        let (lo, hi) = (chunks * s / n, chunks * (s + 1) / n);
        if hi <= lo {
            continue;
        }
        let start = lo + next() % (hi - lo);
        if let Some(ci) = (start..hi).chain(lo..start).find(|&ci| usable(ci)) {
            out.push(ci);
        }
    }
    out
}

/// A random seed (the process's hash keys come from the system's random source).
fn seed() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(std::process::id() as u64);
    h.finish()
}

/// Reads a sample of the chunks that `changed` (the map, widened to whole chunks) leaves
/// alone from `src` and compares each with the digest `writer` holds for it (the base's:
/// call this before the copy writes anything). A chunk that differs refuses the map.
/// Costs at most [`SAMPLE_CHUNKS`] chunk reads and [`SAMPLE_BYTES`] bytes.
pub(crate) fn sample(
    cmd: &MapCommand<'_>,
    writer: &ferry_repo::SnapshotWriter,
    base: &SnapshotInfo,
    src: &Endpoint,
    changed: &[(u64, u64)],
    opts: &CopyOptions,
) -> Result<()> {
    let chunk_size = base.manifest.chunk_size as u64;
    let size = writer.size();
    let n = SAMPLE_CHUNKS.min((SAMPLE_BYTES / chunk_size).max(1));
    let want: Vec<(u64, ferry_repo::format::Digest)> = writer.with_entries(|e, chunks| {
        pick((e, chunks), changed, chunk_size, n, seed()).into_iter().map(|ci| (ci, e(ci))).collect()
    })?;
    if want.is_empty() {
        log::debug!("{} holds no data the change map leaves alone: nothing to compare it with", base.id);
        return Ok(());
    }
    let bufs = want
        .iter()
        .map(|&(ci, _)| {
            let at = ci * chunk_size;
            (at, vec![0u8; chunk_size.min(size - at) as usize])
        })
        .collect();
    let sink = Arc::new(Sample { size, bufs: Mutex::new(bufs) });
    let ranges: Vec<(u64, u64)> = want
        .iter()
        .map(|&(ci, _)| {
            let at = ci * chunk_size;
            (at, chunk_size.min(size - at))
        })
        .collect();
    let o = CopyOptions {
        connections: 1,
        ranges: Some(Arc::new(ranges)),
        select_context: None,
        journal: None,
        hash: None,
        rate: None,
        ..opts.clone()
    };
    let dst = Endpoint::Backend(BackendEndpoint::new("the sample".into(), sink.clone()));
    copy(src, &dst, &o, &Progress::default())
        .with_context(|| format!("reading a sample of the unchanged chunks of {} to check the change map", cmd.src))?;
    let bufs = sink.bufs.lock().unwrap_or_else(|e| e.into_inner());
    let mut bad = Vec::new();
    for (ci, digest) in &want {
        let at = ci * chunk_size;
        let data = &bufs[&at];
        let mut d = [0u8; 32];
        ferry_hash::Algorithm::Sha256.digest_into(data, &mut d);
        if d != *digest {
            bad.push(at);
        }
    }
    log::debug!(
        "checked the change map against snapshot {}: {} of {} unchanged chunks read from the source differ",
        short_id(&base.id),
        bad.len(),
        want.len()
    );
    if !bad.is_empty() {
        return Err(cmd.does_not_fit(base, want.len(), &bad));
    }
    Ok(())
}

/// Where the sample's chunks land: one buffer per chunk, by offset, zero until written.
struct Sample {
    size: u64,
    bufs: Mutex<HashMap<u64, Vec<u8>>>,
}

impl Backend for Sample {
    fn describe(&self) -> String {
        "the sample of unchanged chunks".into()
    }
    fn size(&self) -> u64 {
        self.size
    }
    /// Written, never read; zeroes need no writing (the buffers start as zeroes).
    fn caps(&self) -> Capabilities {
        Capabilities { zero: true, ..Capabilities::default() }
    }
    fn read(&self, buf: &mut [u8], offset: u64) -> ferry_backend::Result<()> {
        Err(ferry_backend::Error::new(ferry_backend::ErrorKind::NotSupported, "read", offset, buf.len() as u64))
    }
    /// Copies what falls in the sampled chunks (the copy asks for nothing else).
    fn write(&self, buf: &[u8], offset: u64, _fua: bool) -> ferry_backend::Result<()> {
        let end = offset + buf.len() as u64;
        for (at, b) in self.bufs.lock().unwrap_or_else(|e| e.into_inner()).iter_mut() {
            let (s, e) = (offset.max(*at), end.min(at + b.len() as u64));
            if s < e {
                b[(s - at) as usize..(e - at) as usize]
                    .copy_from_slice(&buf[(s - offset) as usize..(e - offset) as usize]);
            }
        }
        Ok(())
    }
    fn flush(&self) -> ferry_backend::Result<()> {
        Ok(())
    }
    fn zero(&self, _offset: u64, _length: u64, _mode: ZeroMode, _fua: bool) -> ferry_backend::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::sh;
    use ferry_repo::format::{Digest, ZERO};

    fn pick(e: &[Digest], changed: &[(u64, u64)], cs: u64, n: u64, seed: u64) -> Vec<u64> {
        super::pick((&|ci| e[ci as usize], e.len() as u64), changed, cs, n, seed)
    }

    #[test]
    fn the_sample_is_spread_unchanged_and_data() {
        let cs = 64 * 1024;
        let mut e = vec![[7u8; 32]; 1000];
        // Zero chunks and changed chunks are never picked.
        for ci in (0..1000).step_by(3) {
            e[ci] = ZERO;
        }
        let changed = [(100 * cs, 200 * cs), (700 * cs, cs)];
        for seed in 1..50 {
            let p = pick(&e, &changed, cs, 32, seed);
            // One in each stretch that has a usable chunk (those inside 100..300 have none).
            assert!(p.len() >= 25, "{p:?}");
            let stretch = |ci: u64| (0..32).find(|s| ci < 1000 * (s + 1) / 32).unwrap();
            for (i, ci) in p.iter().enumerate() {
                assert!(e[*ci as usize] != ZERO && !(100..300).contains(ci) && *ci != 700, "{ci}");
                assert!(i == 0 || stretch(p[i - 1]) < stretch(*ci), "{p:?}");
            }
        }
        assert_eq!(pick(&e, &[], cs, 32, 9).len(), 32, "one in each stretch");
        // Different seeds pick different chunks.
        assert_ne!(pick(&e, &changed, cs, 32, 1), pick(&e, &changed, cs, 32, 2));
        // Nothing usable: nothing picked; fewer chunks than asked: each at most once.
        assert!(pick(&[ZERO; 10], &[], cs, 32, 5).is_empty());
        assert!(pick(&e[..5], &[(0, 5 * cs)], cs, 32, 5).is_empty());
        assert_eq!(pick(&[[1u8; 32]; 3], &[], cs, 32, 5), [0, 1, 2]);
    }

    #[test]
    fn commands_are_shell_words() {
        assert_eq!(sh("/backup::vm1"), "/backup::vm1");
        assert_eq!(sh("nbd+unix:///?socket=/run/a.sock"), "'nbd+unix:///?socket=/run/a.sock'");
        assert_eq!(sh("it's"), "'it'\\''s'");
        assert_eq!(sh(""), "''");
    }
}
