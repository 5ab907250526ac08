//! `--rate`: a limit on the copy's data rate over all its connections together.
//!
//! Every read of data from the source reserves its bytes on one shared clock: a
//! reservation starts when the previous one ends (or now, if that is later) and lasts
//! `bytes / rate`; the reader sleeps until its reservation starts. Holes and ranges the
//! source reports as zeroes are never read and cost nothing.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Least and most `--rate`, in bytes per second.
pub const MIN_RATE: u64 = 1024;
pub const MAX_RATE: u64 = 1 << 40;

/// A rate shared by every reader that takes from it (also `ferry repo copy --rate`).
#[derive(Debug)]
pub struct RateLimit {
    per_sec: u64,
    /// When the last reservation ends.
    next: Mutex<Option<Instant>>,
}

impl RateLimit {
    pub fn new(per_sec: u64) -> RateLimit {
        RateLimit { per_sec: per_sec.max(1), next: Mutex::new(None) }
    }

    /// The time `bytes` take at the rate.
    fn span(&self, bytes: u64) -> Duration {
        Duration::from_secs_f64(bytes as f64 / self.per_sec as f64)
    }

    /// Reserves `bytes` and returns when their turn starts.
    fn reserve(&self, bytes: u64, now: Instant) -> Instant {
        let mut next = self.next.lock().unwrap_or_else(|e| e.into_inner());
        let start = next.map_or(now, |n| n.max(now));
        *next = Some(start + self.span(bytes));
        start
    }

    /// Waits for `bytes`' turn, or until `stop()` says to give up.
    pub fn take(&self, bytes: u64, stop: impl Fn() -> bool) {
        let now = Instant::now();
        let start = self.reserve(bytes, now);
        if start > now {
            super::nap(start - now, stop);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_follow_each_other_at_the_rate() {
        let r = RateLimit::new(1 << 20);
        let t0 = Instant::now();
        assert_eq!(r.reserve(1 << 20, t0), t0, "the first goes at once");
        assert_eq!(r.reserve(1 << 19, t0), t0 + Duration::from_secs(1));
        assert_eq!(r.reserve(1, t0), t0 + Duration::from_millis(1500));
        // After a pause nothing is owed and nothing saved up.
        let later = t0 + Duration::from_secs(10);
        assert_eq!(r.reserve(1 << 20, later), later);
    }
}
