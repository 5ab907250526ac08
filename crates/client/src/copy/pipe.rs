//! Streams: stdin, a FIFO or a pipe as a source; stdout, a FIFO or a character device
//! (`/dev/null`, a tape, a serial line) as a destination. One worker, strictly in order:
//! no size known in advance from a source (the copy ends at end of file), no sizing,
//! truncating or seeking of a destination, and zeroes written as data (a stream has no
//! holes).

use super::endpoint::{write_each, Caps, Data, Done, Ops, Read, Write};
use super::CopyError;
use ferry_sock::AlignedBuf;
use std::io::{self, Read as _, Write as _};

/// A stream the copy reads from.
pub(crate) struct StreamIn {
    input: Box<dyn io::Read + Send>,
    name: String,
}

/// A stream the copy writes to.
pub(crate) struct StreamOut {
    output: Box<dyn io::Write + Send>,
    name: String,
}

pub(crate) fn stdin() -> StreamIn {
    StreamIn { input: Box::new(io::stdin()), name: "stdin".into() }
}

pub(crate) fn stdout() -> StreamOut {
    StreamOut { output: Box::new(io::stdout()), name: "stdout".into() }
}

/// A FIFO (or another stream a path names) opened as a source.
pub(crate) fn reader(input: std::fs::File, name: String) -> StreamIn {
    StreamIn { input: Box::new(input), name }
}

/// A FIFO or character device opened as a destination.
pub(crate) fn writer(output: std::fs::File, name: String) -> StreamOut {
    StreamOut { output: Box::new(output), name }
}

fn only_once(name: &str) -> CopyError {
    CopyError::Setup(format!("{name} is a stream: it cannot be opened twice"))
}

fn wrong_way(name: &str, op: &str) -> CopyError {
    CopyError::Setup(format!("{name} cannot be {op}"))
}

impl Ops for StreamIn {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn size(&self) -> Option<u64> {
        None
    }

    fn caps(&self) -> Caps {
        Caps { in_order: true, read_only: true, ..Caps::default() }
    }

    fn reopen(&self) -> Result<Box<dyn Ops>, CopyError> {
        Err(only_once(&self.name))
    }

    /// Fills each buffer in turn; a short read is the end of the input (and later reads of
    /// the batch get nothing).
    fn read(&mut self, reqs: &[Read], bufs: &mut [AlignedBuf], done: &mut Done<'_>) -> Result<(), CopyError> {
        for r in reqs {
            let buf = &mut bufs[r.slot][..r.len];
            let mut got = 0;
            while got < r.len {
                match self.input.read(&mut buf[got..]) {
                    Ok(0) => break,
                    Ok(n) => got += n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(CopyError::Local { what: "reading", path: self.name.clone(), source: e }),
                }
            }
            done(r.slot, got as u64);
        }
        Ok(())
    }

    fn write(&mut self, _: &[Write<'_>], _: &mut Done<'_>) -> Result<(), CopyError> {
        Err(wrong_way(&self.name, "written"))
    }

    fn flush(&mut self) -> Result<(), CopyError> {
        Ok(())
    }
}

impl Ops for StreamOut {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn size(&self) -> Option<u64> {
        None
    }

    fn caps(&self) -> Caps {
        Caps { in_order: true, ..Caps::default() }
    }

    fn reopen(&self) -> Result<Box<dyn Ops>, CopyError> {
        Err(only_once(&self.name))
    }

    fn read(&mut self, _: &[Read], _: &mut [AlignedBuf], _: &mut Done<'_>) -> Result<(), CopyError> {
        Err(wrong_way(&self.name, "read"))
    }

    fn write(&mut self, reqs: &[Write<'_>], done: &mut Done<'_>) -> Result<(), CopyError> {
        write_each(reqs, done, |w| match w.data {
            Data::Bytes(b) => self.output.write_all(b),
            _ => Err(io::Error::other("a stream takes bytes only")),
        })
    }

    fn flush(&mut self) -> Result<(), CopyError> {
        self.output.flush().map_err(|e| CopyError::Local { what: "cannot flush", path: self.name.clone(), source: e })
    }

    fn close(mut self: Box<Self>) {
        let _ = self.output.flush();
    }
}
