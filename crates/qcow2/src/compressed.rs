//! Compressed clusters: raw deflate (qemu's default, "zlib") and zstd. A compressed
//! cluster always decompresses to exactly one cluster; trailing bytes (the padding to a
//! 512-byte sector) are ignored.

use crate::header::Compression;
use std::io::Read;

/// Largest zstd window accepted: a cluster is at most 2 MiB, so a frame needing more is
/// hostile (and would make the decoder reserve that much memory).
const MAX_ZSTD_WINDOW: u64 = 8 << 20;

/// Decompresses `input` into all of `out` (one cluster).
pub fn decompress(kind: Compression, input: &[u8], out: &mut [u8]) -> Result<(), String> {
    match kind {
        Compression::Zlib => {
            let mut d = flate2::Decompress::new(false);
            match d.decompress(input, out, flate2::FlushDecompress::Finish) {
                Ok(_) if d.total_out() == out.len() as u64 => Ok(()),
                Ok(_) => Err(format!("deflate data gave {} bytes, not a cluster of {}", d.total_out(), out.len())),
                Err(e) => Err(format!("deflate data is invalid: {e}")),
            }
        }
        Compression::Zstd => {
            let window = zstd_window(input).ok_or("zstd data has no valid frame header")?;
            if window > MAX_ZSTD_WINDOW {
                return Err(format!("zstd frame asks for a {window}-byte window"));
            }
            let mut dec =
                ruzstd::decoding::StreamingDecoder::new(input).map_err(|e| format!("zstd data is invalid: {e}"))?;
            dec.read_exact(out).map_err(|e| format!("zstd data does not fill a cluster: {e}"))
        }
    }
}

/// The window a zstd frame needs (RFC 8878 3.1.1.1), from its header.
fn zstd_window(b: &[u8]) -> Option<u64> {
    if b.len() < 6 || b[..4] != [0x28, 0xb5, 0x2f, 0xfd] {
        return None;
    }
    let fhd = b[4];
    let single_segment = fhd & 0x20 != 0;
    if !single_segment {
        let wd = b[5];
        let exp = u64::from(wd >> 3);
        let base = 1u64 << (10 + exp);
        return Some(base + (base / 8) * u64::from(wd & 7));
    }
    // Single segment: the window is the frame content size.
    let dict_bytes = [0usize, 1, 2, 4][usize::from(fhd & 3)];
    let fcs_bytes = [1usize, 2, 4, 8][usize::from(fhd >> 6)];
    let at = 5 + dict_bytes;
    let f = b.get(at..at + fcs_bytes)?;
    let mut v = 0u64;
    for (i, &x) in f.iter().enumerate() {
        v |= u64::from(x) << (8 * i);
    }
    if fcs_bytes == 2 {
        v += 256;
    }
    Some(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deflate_roundtrip_and_garbage() {
        let data: Vec<u8> = (0..65536u32).map(|i| (i % 251) as u8).collect();
        let mut c = flate2::Compress::new(flate2::Compression::default(), false);
        let mut comp = vec![0u8; 70000];
        c.compress(&data, &mut comp, flate2::FlushCompress::Finish).unwrap();
        comp.truncate(c.total_out() as usize);
        comp.extend_from_slice(&[0xaa; 300]); // sector padding
        let mut out = vec![0u8; 65536];
        decompress(Compression::Zlib, &comp, &mut out).unwrap();
        assert_eq!(out, data);
        assert!(decompress(Compression::Zlib, &[0xff; 100], &mut out).is_err());
        assert!(decompress(Compression::Zstd, &[0xff; 100], &mut out).is_err());
        // A frame asking for a huge window is refused before decoding.
        assert!(decompress(Compression::Zstd, &[0x28, 0xb5, 0x2f, 0xfd, 0x00, 0xf8, 0, 0], &mut out)
            .unwrap_err()
            .contains("window"));
    }
}
