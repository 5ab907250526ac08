//! Lists of changed ranges from files, for `ferry copy --extents-from`:
//!
//! - the JSON of `nbdinfo --map=qemu:dirty-bitmap:NAME --json` (or `ferry info` with the
//!   same arguments): rows `{offset, length, type, description}`; a row is changed when
//!   bit 0 of its type (`NBD_STATE_DIRTY`) is set. Rows whose description says they are
//!   of another context (`data`, `hole`, `local`, ...) are refused: bit 0 means something
//!   else there.
//! - the JSON of `qemu-img map --output=json`: rows `{start, length, depth, present, ...}`;
//!   a row is changed when it is present at depth 0, i.e. what an overlay itself holds.
//! - `bitmap:GRANULARITY:FILE`: a raw bitmap, bit i (least significant bit of each byte
//!   first) set when granule i (of GRANULARITY bytes) changed, as VMware CBT or XCP-ng
//!   CBT tools give them.
//!
//! Rows must be in order and must not overlap; the ranges are checked against the
//! source's size when the copy starts ([`super::check_ranges`]). Files are bounded
//! before they are read.

use super::contexts::MAX_SELECTED_RANGES;
use serde::Deserialize;
use std::io::Read;
use std::path::Path;

/// Largest JSON map read (a million rows of nbdinfo's output is about 80 MiB).
pub const MAX_JSON_BYTES: u64 = 256 << 20;
/// Largest raw bitmap read: 2^30 granules (64 TiB at 64 KiB granularity).
pub const MAX_BITMAP_BYTES: u64 = 128 << 20;

#[derive(Deserialize)]
struct Row {
    // nbdinfo
    offset: Option<u64>,
    #[serde(rename = "type")]
    ty: Option<u64>,
    description: Option<String>,
    // qemu-img map
    start: Option<u64>,
    depth: Option<u64>,
    present: Option<bool>,
    // both
    length: u64,
}

fn read_bounded(path: &Path, max: u64) -> Result<Vec<u8>, String> {
    let f = std::fs::File::open(path).map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    let mut v = Vec::new();
    f.take(max + 1).read_to_end(&mut v).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    if v.len() as u64 > max {
        return Err(format!("{} is larger than {max} bytes, more than any map ferry reads", path.display()));
    }
    Ok(v)
}

/// Appends a range, merging it with the previous one when they touch; rows must come
/// in order without overlapping.
fn push(out: &mut Vec<(u64, u64)>, start: u64, len: u64, row: usize) -> Result<(), String> {
    if len == 0 {
        return Ok(());
    }
    let end = start.checked_add(len).ok_or_else(|| format!("row {row}: {len} bytes at {start} overflow"))?;
    match out.last_mut() {
        Some(last) if last.0 + last.1 > start => {
            return Err(format!(
                "row {row} (offset {start}) overlaps or comes before the row before it (which ends at {}): \
                 rows must be sorted and disjoint",
                last.0 + last.1
            ))
        }
        Some(last) if last.0 + last.1 == start => last.1 += len,
        _ => {
            if out.len() >= MAX_SELECTED_RANGES {
                return Err(format!("more than {MAX_SELECTED_RANGES} separate ranges"));
            }
            out.push((start, end - start))
        }
    }
    Ok(())
}

/// Parses `--extents-from`'s argument (a JSON map file, or `bitmap:GRANULARITY:FILE`).
pub fn parse_extents_from(spec: &str) -> Result<Vec<(u64, u64)>, String> {
    if let Some(rest) = spec.strip_prefix("bitmap:") {
        let (g, file) = rest
            .split_once(':')
            .ok_or_else(|| format!("{spec:?}: a raw bitmap is given as bitmap:GRANULARITY:FILE"))?;
        let gran = ferry_backend::parse_size(g).map_err(|e| format!("{spec:?}: granularity: {e}"))?;
        if !(512..=1 << 30).contains(&gran) {
            return Err(format!("{spec:?}: the granularity must be between 512 bytes and 1G"));
        }
        let bits = read_bounded(Path::new(file), MAX_BITMAP_BYTES)?;
        return from_bitmap(&bits, gran);
    }
    let text = read_bounded(Path::new(spec), MAX_JSON_BYTES)?;
    from_json(&text).map_err(|e| format!("{spec}: {e}"))
}

/// Ranges from a raw bitmap of `gran`-byte granules (bit i, LSB first: granule i).
pub fn from_bitmap(bits: &[u8], gran: u64) -> Result<Vec<(u64, u64)>, String> {
    let mut out = Vec::new();
    for (i, &b) in bits.iter().enumerate() {
        if b == 0 {
            continue;
        }
        for bit in 0..8 {
            if b >> bit & 1 == 1 {
                let granule = i as u64 * 8 + bit;
                let start = granule.checked_mul(gran).ok_or("the bitmap goes past 2^64 bytes")?;
                push(&mut out, start, gran, granule as usize)?;
            }
        }
    }
    Ok(out)
}

/// Ranges from nbdinfo's or qemu-img's JSON map.
pub fn from_json(text: &[u8]) -> Result<Vec<(u64, u64)>, String> {
    let rows: Vec<Row> = serde_json::from_slice(text)
        .map_err(|e| format!("not a JSON map of nbdinfo --map --json or qemu-img map --output=json: {e}"))?;
    let mut out = Vec::new();
    for (i, r) in rows.iter().enumerate() {
        // qemu-img's rows have an `offset` too (where the data is in the file).
        match (r.start, r.depth, r.present, r.offset, r.ty) {
            (Some(start), Some(depth), Some(present), _, None) => {
                if depth == 0 && present {
                    push(&mut out, start, r.length, i)?;
                }
            }
            (None, None, None, Some(offset), Some(ty)) => {
                if let Some(d) = r.description.as_deref().filter(|d| !matches!(*d, "dirty" | "clean")) {
                    return Err(format!(
                        "row {i} is {d:?}: this is a map of another context than a dirty bitmap (bit 0 of its \
                         type does not mean changed); use nbdinfo --map=qemu:dirty-bitmap:NAME --json"
                    ));
                }
                if ty & 1 != 0 {
                    push(&mut out, offset, r.length, i)?;
                }
            }
            _ => {
                return Err(format!(
                    "row {i} is neither nbdinfo's {{offset, length, type}} nor qemu-img map's \
                     {{start, length, depth, present}}"
                ))
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nbdinfo_maps() {
        let j = br#"[
{ "offset": 0, "length": 65536, "type": 0, "description": "clean"},
{ "offset": 65536, "length": 65536, "type": 1, "description": "dirty"},
{ "offset": 131072, "length": 4096, "type": 1, "description": "dirty"},
{ "offset": 200000, "length": 10, "type": 1}
]"#;
        assert_eq!(from_json(j).unwrap(), vec![(65536, 69632), (200000, 10)]);
        let e = from_json(br#"[{ "offset": 0, "length": 1, "type": 1, "description": "hole"}]"#).unwrap_err();
        assert!(e.contains("another context"), "{e}");
        let e = from_json(br#"[{ "offset": 10, "length": 1, "type": 1}, { "offset": 5, "length": 1, "type": 1}]"#)
            .unwrap_err();
        assert!(e.contains("sorted and disjoint"), "{e}");
        let e = from_json(br#"[{ "offset": 0, "length": 10, "type": 1}, { "offset": 5, "length": 1, "type": 1}]"#)
            .unwrap_err();
        assert!(e.contains("overlaps"), "{e}");
        assert!(from_json(br#"[{ "length": 1}]"#).unwrap_err().contains("neither"));
        assert!(from_json(b"{}").is_err());
        assert!(from_json(br#"[{ "offset": 18446744073709551615, "length": 2, "type": 1}]"#).is_err());
    }

    #[test]
    fn qemu_img_maps() {
        let j = br#"[{ "start": 0, "length": 1048576, "depth": 1, "present": true, "zero": false, "data": true, "compressed": false, "offset": 327680},
{ "start": 1048576, "length": 1048576, "depth": 0, "present": false, "zero": true, "data": false, "compressed": false},
{ "start": 2097152, "length": 65536, "depth": 0, "present": true, "zero": false, "data": true, "compressed": false, "offset": 327680},
{ "start": 3145728, "length": 65536, "depth": 0, "present": true, "zero": true, "data": false, "compressed": false}]"#;
        assert_eq!(from_json(j).unwrap(), vec![(2097152, 65536), (3145728, 65536)]);
    }

    #[test]
    fn raw_bitmaps() {
        assert_eq!(from_bitmap(&[0b0000_0110, 0, 0b1000_0000], 512).unwrap(), vec![(512, 1024), (23 * 512, 512)]);
        assert_eq!(from_bitmap(&[0xff, 0x01], 4096).unwrap(), vec![(0, 9 * 4096)]);
        assert_eq!(from_bitmap(&[0; 100], 512).unwrap(), vec![]);
        assert!(parse_extents_from("bitmap:64K").is_err());
        assert!(parse_extents_from("bitmap:7:/nonexistent").unwrap_err().contains("granularity"));
    }
}
