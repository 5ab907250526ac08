//! `pattern:SIZE`: read-only, each 8-byte word holds its own offset, big-endian
//! (the same bytes as nbdkit's pattern plugin), so copies can be checked without
//! storing the data.

use crate::*;

pub struct PatternBackend {
    size: u64,
}

impl PatternBackend {
    pub fn new(size: u64) -> Self {
        PatternBackend { size }
    }

    /// The byte at `pos` of a pattern disk.
    pub fn byte_at(pos: u64) -> u8 {
        (pos & !7).to_be_bytes()[(pos & 7) as usize]
    }
}

/// Fills `buf` with the pattern of the bytes at `offset..`.
pub fn fill_pattern(buf: &mut [u8], offset: u64) {
    let mut pos = offset;
    let mut rest = &mut buf[..];
    // Unaligned head, byte by byte.
    while !pos.is_multiple_of(8) && !rest.is_empty() {
        rest[0] = PatternBackend::byte_at(pos);
        rest = &mut rest[1..];
        pos += 1;
    }
    let mut words = rest.chunks_exact_mut(8);
    for w in &mut words {
        w.copy_from_slice(&pos.to_be_bytes());
        pos += 8;
    }
    for b in words.into_remainder() {
        *b = PatternBackend::byte_at(pos);
        pos += 1;
    }
}

impl Backend for PatternBackend {
    fn describe(&self) -> String {
        format!("pattern:{}", self.size)
    }
    fn size(&self) -> u64 {
        self.size
    }
    fn caps(&self) -> Capabilities {
        Capabilities { read_only: true, flush: true, multi_conn: true, cache: true, ..Default::default() }
    }
    fn read(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        fill_pattern(buf, offset);
        Ok(())
    }
    fn flush(&self) -> Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_definition_at_any_alignment() {
        let mut a = vec![0u8; 100];
        for off in [0u64, 1, 7, 8, 13, 4096] {
            fill_pattern(&mut a, off);
            for (i, b) in a.iter().enumerate() {
                let p = off + i as u64;
                assert_eq!(*b, (p / 8 * 8).to_be_bytes()[(p % 8) as usize]);
            }
        }
        fill_pattern(&mut a[..16], 8);
        assert_eq!(&a[..16], &[0, 0, 0, 0, 0, 0, 0, 8, 0, 0, 0, 0, 0, 0, 0, 16]);
    }
}
