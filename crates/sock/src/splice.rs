//! Received payloads written to a file without passing through user space: the socket's
//! pages move into a pipe and from the pipe into the file with splice(2), so the only
//! copy left is the kernel's into the file's page cache (a read and a pwrite make two).

use crate::Stream;
use rustix::pipe::{fcntl_getpipe_size, fcntl_setpipe_size, pipe_with, splice, PipeFlags, SpliceFlags};
use std::io::{self, Read};
use std::os::fd::{BorrowedFd, OwnedFd};

/// Pipe capacity asked for: one splice moves up to this much. 1 MiB is the default
/// `fs.pipe-max-size`; a smaller limit is accepted as it is.
const PIPE_SIZE: usize = 1 << 20;

/// The pipe a connection splices its payloads through. It is empty between calls.
#[derive(Debug)]
pub struct SplicePipe {
    read: OwnedFd,
    write: OwnedFd,
    capacity: usize,
}

impl SplicePipe {
    pub fn new() -> io::Result<SplicePipe> {
        let (read, write) = pipe_with(PipeFlags::CLOEXEC)?;
        let capacity = match fcntl_setpipe_size(&write, PIPE_SIZE) {
            Ok(n) => n,
            Err(_) => fcntl_getpipe_size(&write)?,
        };
        Ok(SplicePipe { read, write, capacity })
    }
}

/// How a spliced payload ended, when the socket itself did not fail.
#[derive(Debug)]
pub enum Spliced {
    /// Every byte is in the file.
    Written,
    /// The file refused a splice (a write error, or splice unsupported there). The first
    /// `written` bytes are in the file; the rest of the payload has been received into
    /// the caller's buffer (`fallback[..len - written]`), so the connection stays in step
    /// and the caller can write them the ordinary way, which reports any real error.
    Refused { written: usize, error: io::Error },
}

impl Stream {
    /// Receives the next `len` bytes of the stream into `file` at `offset`. An error is a
    /// socket error (the connection is lost); the file's errors are in [`Spliced`].
    /// `fallback` must hold at least `len` bytes.
    pub fn splice_to_file(
        &mut self,
        pipe: &mut SplicePipe,
        file: BorrowedFd<'_>,
        offset: u64,
        len: usize,
        fallback: &mut [u8],
    ) -> io::Result<Spliced> {
        assert!(fallback.len() >= len, "fallback buffer shorter than the payload");
        let mut done = 0;
        while done < len {
            let got = loop {
                match splice(&*self, None, &pipe.write, None, (len - done).min(pipe.capacity), SpliceFlags::MOVE) {
                    Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                    Ok(n) => break n,
                    Err(rustix::io::Errno::INTR) => {}
                    Err(e) => return Err(e.into()),
                }
            };
            self.stats.splices += 1;
            self.stats.splice_bytes += got as u64;
            // Empty the pipe into the file.
            let mut in_pipe = got;
            let mut at = offset + done as u64;
            while in_pipe > 0 {
                match splice(&pipe.read, None, file, Some(&mut at), in_pipe, SpliceFlags::MOVE) {
                    Ok(0) => {
                        let error = io::Error::new(io::ErrorKind::WriteZero, "the file took no bytes");
                        return self.refuse(pipe, done + got - in_pipe, in_pipe, len, fallback, error);
                    }
                    Ok(n) => in_pipe -= n,
                    Err(rustix::io::Errno::INTR) => {}
                    Err(e) => return self.refuse(pipe, done + got - in_pipe, in_pipe, len, fallback, e.into()),
                }
            }
            done += got;
        }
        Ok(Spliced::Written)
    }

    /// After the file refused a splice: `written` bytes are in the file and `in_pipe`
    /// more in the pipe. Moves those and the payload still in the socket into `fallback`.
    fn refuse(
        &mut self,
        pipe: &mut SplicePipe,
        written: usize,
        in_pipe: usize,
        len: usize,
        fallback: &mut [u8],
        error: io::Error,
    ) -> io::Result<Spliced> {
        let mut got = 0;
        while got < in_pipe {
            match rustix::io::read(&pipe.read, &mut fallback[got..in_pipe]) {
                Ok(0) => return Err(io::Error::other("spliced bytes vanished from the pipe")),
                Ok(n) => got += n,
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
        self.read_exact(&mut fallback[in_pipe..len - written])?;
        Ok(Spliced::Refused { written, error })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsFd;
    use std::os::unix::fs::FileExt;

    fn pair() -> (Stream, Stream) {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        (Stream::from(a), Stream::from(b))
    }

    #[test]
    fn payload_lands_in_the_file_at_its_offset() {
        let (mut tx, mut rx) = pair();
        let data: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 + i / 4096) as u8).collect();
        let sender = {
            let data = data.clone();
            std::thread::spawn(move || tx.write_all(&data).unwrap())
        };
        let f = tempfile();
        let mut pipe = SplicePipe::new().unwrap();
        let mut fb = vec![0u8; data.len()];
        let r = rx.splice_to_file(&mut pipe, f.as_fd(), 4096, data.len(), &mut fb).unwrap();
        assert!(matches!(r, Spliced::Written));
        sender.join().unwrap();
        let mut back = vec![0u8; data.len()];
        f.read_exact_at(&mut back, 4096).unwrap();
        assert!(back == data);
        assert_eq!(rx.stats.splice_bytes, data.len() as u64);
    }

    #[test]
    fn a_refusing_file_leaves_the_payload_in_the_fallback_and_the_stream_in_step() {
        let (mut tx, mut rx) = pair();
        let data: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        tx.write_all(&data).unwrap();
        tx.write_all(b"next").unwrap();
        // A file opened read-only refuses every write.
        let path = tempfile_path();
        let f = std::fs::File::open(&path).unwrap();
        let mut pipe = SplicePipe::new().unwrap();
        let mut fb = vec![0u8; data.len()];
        match rx.splice_to_file(&mut pipe, f.as_fd(), 0, data.len(), &mut fb).unwrap() {
            Spliced::Refused { written, .. } => assert!(fb[..data.len() - written] == data[written..]),
            Spliced::Written => panic!("a read-only file took a write"),
        }
        let mut next = [0u8; 4];
        rx.read_exact(&mut next).unwrap();
        assert_eq!(&next, b"next");
        let _ = std::fs::remove_file(path);
    }

    fn tempfile_path() -> std::path::PathBuf {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let p = std::env::temp_dir().join(format!("ferry-splice-{}-{n}", std::process::id()));
        std::fs::write(&p, b"").unwrap();
        p
    }

    fn tempfile() -> std::fs::File {
        let p = tempfile_path();
        let f = std::fs::OpenOptions::new().read(true).write(true).open(&p).unwrap();
        let _ = std::fs::remove_file(p);
        f
    }
}
