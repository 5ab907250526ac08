//! `null:`: a destination that discards everything, as fast as the source can go.

use super::endpoint::{Caps, Done, Ops, Read, Write};
use super::CopyError;
use ferry_sock::AlignedBuf;

pub(crate) struct Null;

impl Ops for Null {
    fn name(&self) -> String {
        "null:".into()
    }

    fn size(&self) -> Option<u64> {
        None
    }

    fn caps(&self) -> Caps {
        Caps { parallel: true, zero: true, zeroed: true, discards: true, ..Caps::default() }
    }

    fn reopen(&self) -> Result<Box<dyn Ops>, CopyError> {
        Ok(Box::new(Null))
    }

    fn read(&mut self, _: &[Read], _: &mut [AlignedBuf], _: &mut Done<'_>) -> Result<(), CopyError> {
        Err(CopyError::Setup("null: can only be a destination".into()))
    }

    fn write(&mut self, reqs: &[Write<'_>], done: &mut Done<'_>) -> Result<(), CopyError> {
        reqs.iter().for_each(|w| done(w.slot, w.len()));
        Ok(())
    }

    fn flush(&mut self) -> Result<(), CopyError> {
        Ok(())
    }
}
