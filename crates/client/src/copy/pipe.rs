//! stdin as a source, stdout as a destination: one worker, strictly in order, no size
//! known in advance from stdin (the copy ends at end of file).

use super::endpoint::{write_each, Caps, Data, Done, Ops, Read, Write};
use super::CopyError;
use ferry_sock::AlignedBuf;
use std::io::{self, Read as _, Write as _};

pub(crate) struct Stdin(io::Stdin);
pub(crate) struct Stdout(io::Stdout);

pub(crate) fn stdin() -> Stdin {
    Stdin(io::stdin())
}

pub(crate) fn stdout() -> Stdout {
    Stdout(io::stdout())
}

fn only_once(name: &str) -> CopyError {
    CopyError::Setup(format!("{name} cannot be opened twice"))
}

fn wrong_way(name: &str, op: &str) -> CopyError {
    CopyError::Setup(format!("{name} cannot be {op}"))
}

impl Ops for Stdin {
    fn name(&self) -> String {
        "stdin".into()
    }

    fn size(&self) -> Option<u64> {
        None
    }

    fn caps(&self) -> Caps {
        Caps { in_order: true, read_only: true, ..Caps::default() }
    }

    fn reopen(&self) -> Result<Box<dyn Ops>, CopyError> {
        Err(only_once("stdin"))
    }

    /// Fills each buffer in turn; a short read is the end of the input (and later reads of
    /// the batch get nothing).
    fn read(&mut self, reqs: &[Read], bufs: &mut [AlignedBuf], done: &mut Done<'_>) -> Result<(), CopyError> {
        for r in reqs {
            let buf = &mut bufs[r.slot][..r.len];
            let mut got = 0;
            while got < r.len {
                match self.0.read(&mut buf[got..]) {
                    Ok(0) => break,
                    Ok(n) => got += n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(CopyError::Local { what: "reading", path: "stdin".into(), source: e }),
                }
            }
            done(r.slot, got as u64);
        }
        Ok(())
    }

    fn write(&mut self, _: &[Write<'_>], _: &mut Done<'_>) -> Result<(), CopyError> {
        Err(wrong_way("stdin", "written"))
    }

    fn flush(&mut self) -> Result<(), CopyError> {
        Ok(())
    }
}

impl Ops for Stdout {
    fn name(&self) -> String {
        "stdout".into()
    }

    fn size(&self) -> Option<u64> {
        None
    }

    fn caps(&self) -> Caps {
        Caps { in_order: true, ..Caps::default() }
    }

    fn reopen(&self) -> Result<Box<dyn Ops>, CopyError> {
        Err(only_once("stdout"))
    }

    fn read(&mut self, _: &[Read], _: &mut [AlignedBuf], _: &mut Done<'_>) -> Result<(), CopyError> {
        Err(wrong_way("stdout", "read"))
    }

    fn write(&mut self, reqs: &[Write<'_>], done: &mut Done<'_>) -> Result<(), CopyError> {
        write_each(reqs, done, |w| match w.data {
            Data::Bytes(b) => self.0.write_all(b),
            _ => Err(io::Error::other("stdout takes bytes only")),
        })
    }

    fn flush(&mut self) -> Result<(), CopyError> {
        self.0.flush().map_err(|e| CopyError::Local { what: "cannot flush", path: "stdout".into(), source: e })
    }

    fn close(mut self: Box<Self>) {
        let _ = self.0.flush();
    }
}
