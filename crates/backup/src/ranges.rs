//! Range arithmetic of a backup: change maps merged, widened to whole chunks, and what a
//! resumed backup still has to read.

/// A digest of a change map's ranges, so that a resume with another map is refused.
pub(crate) fn ranges_digest(ranges: &[(u64, u64)]) -> String {
    let mut bytes = Vec::with_capacity(ranges.len() * 16);
    for (o, l) in ranges {
        bytes.extend_from_slice(&o.to_le_bytes());
        bytes.extend_from_slice(&l.to_le_bytes());
    }
    let mut d = [0u8; 32];
    ferry_hash::Algorithm::Sha256.digest_into(&bytes, &mut d);
    ferry_hash::hex(&d)
}

/// `ranges` (sorted, disjoint) widened to whole chunks of `chunk` bytes, inside `size`:
/// the writer then gets whole chunks, never parts it would keep until the commit.
pub(crate) fn widen(ranges: &[(u64, u64)], chunk: u64, size: u64) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
    for &(o, l) in ranges {
        let start = o / chunk * chunk;
        let end = o.saturating_add(l).div_ceil(chunk).saturating_mul(chunk).min(size);
        if end <= start {
            continue;
        }
        match out.last_mut() {
            Some(last) if last.0 + last.1 >= start => last.1 = last.1.max(end - last.0),
            _ => out.push((start, end - start)),
        }
    }
    out
}

/// `ranges` in any order, overlapping or not, as sorted disjoint ranges.
pub(crate) fn merge(mut ranges: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    ranges.retain(|r| r.1 > 0);
    ranges.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
    for (o, l) in ranges {
        match out.last_mut() {
            Some(last) if o <= last.0 + last.1 => last.1 = last.1.max(o + l - last.0),
            _ => out.push((o, l)),
        }
    }
    out
}

/// `ranges` (sorted, disjoint) without `done` (sorted, disjoint).
pub(crate) fn subtract(ranges: &[(u64, u64)], done: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut d = 0;
    for &(start, len) in ranges {
        let end = start + len;
        let mut pos = start;
        while d < done.len() && done[d].0 + done[d].1 <= pos {
            d += 1;
        }
        let mut k = d;
        while pos < end {
            match done.get(k) {
                Some(&(ds, dl)) if ds < end => {
                    if ds > pos {
                        out.push((pos, ds - pos));
                    }
                    pos = pos.max(ds + dl);
                    k += 1;
                }
                _ => {
                    out.push((pos, end - pos));
                    pos = end;
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{merge, subtract, widen};

    #[test]
    fn merge_ranges() {
        assert_eq!(merge(vec![(10, 5), (0, 4), (4, 2), (12, 10), (30, 0)]), vec![(0, 6), (10, 12)]);
        assert_eq!(merge(vec![]), vec![]);
    }

    #[test]
    fn widen_to_chunks() {
        let k = 1024;
        assert_eq!(
            widen(&[(4 * k, 4 * k), (60 * k, 8 * k), (200 * k, 1)], 64 * k, 1 << 20),
            [(0, 128 * k), (192 * k, 64 * k)]
        );
        // The short last chunk, and a range past the end.
        assert_eq!(widen(&[(130 * k, 1)], 64 * k, 150 * k), [(128 * k, 22 * k)]);
        assert_eq!(widen(&[(200 * k, 5)], 64 * k, 150 * k), []);
    }

    #[test]
    fn subtract_ranges() {
        assert_eq!(subtract(&[(0, 100)], &[]), vec![(0, 100)]);
        assert_eq!(subtract(&[(0, 100)], &[(0, 100)]), vec![]);
        assert_eq!(subtract(&[(0, 100)], &[(10, 20), (50, 10)]), vec![(0, 10), (30, 20), (60, 40)]);
        assert_eq!(subtract(&[(0, 10), (20, 10), (40, 10)], &[(5, 20), (45, 100)]), vec![(0, 5), (25, 5), (40, 5)]);
        assert_eq!(subtract(&[(100, 10)], &[(0, 50), (200, 5)]), vec![(100, 10)]);
    }
}
