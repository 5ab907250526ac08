//! SIGINT and SIGTERM during `copy` and `hash`: the first one sets
//! a flag the copy engine checks between batches, so the command ends through its normal
//! failure path (an S3 upload aborted, or kept and named under `--resume`; a journal
//! kept); a second one exits at once. `serve` handles its signals itself; `bench` leaves
//! nothing behind and keeps the default (killed at once).

use anyhow::{Context, Result};
use signal_hook::consts::{SIGINT, SIGTERM};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

struct Flags {
    /// Set by the first SIGINT or SIGTERM.
    stop: Arc<AtomicBool>,
    /// The number of the last signal received.
    signal: Arc<AtomicUsize>,
}

static FLAGS: OnceLock<Flags> = OnceLock::new();

/// Installs the handlers (once) and returns the flag a copy checks
/// ([`ferry_client::copy::CopyOptions::cancel`]).
pub fn install() -> Result<Arc<AtomicBool>> {
    if let Some(f) = FLAGS.get() {
        return Ok(f.stop.clone());
    }
    let flags = Flags { stop: Arc::new(AtomicBool::new(false)), signal: Arc::new(AtomicUsize::new(0)) };
    for sig in [SIGINT, SIGTERM] {
        // The second signal finds the flag set and exits, as a shell expects (128 + N);
        // the first only sets it (registered after, so it runs after the check).
        signal_hook::flag::register_conditional_shutdown(sig, 128 + sig, flags.stop.clone())
            .context("installing signal handlers")?;
        signal_hook::flag::register_usize(sig, flags.signal.clone(), sig as usize)
            .context("installing signal handlers")?;
        signal_hook::flag::register(sig, flags.stop.clone()).context("installing signal handlers")?;
    }
    let stop = flags.stop.clone();
    let _ = FLAGS.set(flags);
    Ok(stop)
}

/// The signal that interrupted the command, if one did.
pub fn received() -> Option<i32> {
    let f = FLAGS.get()?;
    if !f.stop.load(Ordering::SeqCst) {
        return None;
    }
    match f.signal.load(Ordering::SeqCst) as i32 {
        0 => None,
        s => Some(s),
    }
}

/// A signal's name as `kill -l` spells it, with the SIG prefix.
pub fn name(sig: i32) -> String {
    match sig {
        SIGINT => "SIGINT".into(),
        SIGTERM => "SIGTERM".into(),
        s => format!("signal {s}"),
    }
}
