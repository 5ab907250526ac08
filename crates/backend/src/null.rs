//! `null:SIZE`: writes are discarded, reads return zeroes, everything is a hole.

use crate::*;

pub struct NullBackend {
    size: u64,
}

impl NullBackend {
    pub fn new(size: u64) -> Self {
        NullBackend { size }
    }
}

impl Backend for NullBackend {
    fn describe(&self) -> String {
        format!("null:{}", self.size)
    }
    fn size(&self) -> u64 {
        self.size
    }
    fn caps(&self) -> Capabilities {
        Capabilities::everything()
    }
    fn read(&self, buf: &mut [u8], _offset: u64) -> Result<()> {
        buf.fill(0);
        Ok(())
    }
    fn write(&self, _buf: &[u8], _offset: u64, _fua: bool) -> Result<()> {
        Ok(())
    }
    fn flush(&self) -> Result<()> {
        Ok(())
    }
    fn trim(&self, _offset: u64, _length: u64, _fua: bool) -> Result<()> {
        Ok(())
    }
    fn zero(&self, _offset: u64, _length: u64, _mode: ZeroMode, _fua: bool) -> Result<()> {
        Ok(())
    }
    fn extents(&self, _offset: u64, length: u64, _max: usize, out: &mut Vec<Extent>) -> Result<()> {
        push_extent(out, length, HOLE);
        Ok(())
    }
    fn sparse_read_threshold(&self) -> Option<u64> {
        Some(0)
    }
}
