//! Retries (`--retries`, `--retry-delay`, `--request-timeout`): which failures are worth
//! another attempt, and how long to wait before it.
//!
//! A request that fails with a transient error (an `EIO` or `ESHUTDOWN` reply) is sent
//! again on the same connection. A connection that drops (the server closed it, a socket
//! error, no reply within the request timeout) is opened again (same URI, TLS and
//! export, and it must be the same size) and every request that was in flight on it is
//! sent again. Anything else (`ENOSPC`, `EPERM`, `EINVAL`, a size that changed, an export
//! that is gone, a local file's error) ends the copy at once. The worker in `mod.rs`
//! does the resending; this file only decides.

use super::CopyError;
use crate::conn::Error as ConnError;
use std::time::Duration;

/// The retry settings of a copy. `retries == 0` is the copy without retries: the first
/// error ends it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts after the first, for each request and for each reconnection.
    pub retries: u32,
    /// Wait before the first retry; doubled for each further one (at most [`MAX_DELAY`]).
    pub delay: Duration,
    /// A request in flight this long without any reply drops the connection (which is
    /// then reopened). `None`: wait for ever.
    pub request_timeout: Option<Duration>,
}

/// Default of `--retries`.
pub const DEFAULT_RETRIES: u32 = 5;
/// Default of `--retry-delay`.
pub const DEFAULT_DELAY: Duration = Duration::from_millis(500);
/// Longest wait between two attempts.
pub const MAX_DELAY: Duration = Duration::from_secs(60);
/// Largest `--retries`.
pub const MAX_RETRIES: u32 = 100;
/// Largest `--request-timeout` (an hour).
pub const MAX_TIMEOUT: Duration = Duration::from_secs(3600);

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy { retries: 0, delay: DEFAULT_DELAY, request_timeout: None }
    }
}

impl RetryPolicy {
    /// The wait before attempt `attempt` (1 for the first retry).
    pub fn backoff(&self, attempt: u32) -> Duration {
        let shift = attempt.saturating_sub(1).min(20);
        self.delay.saturating_mul(1 << shift).min(MAX_DELAY)
    }
}

/// What to do about a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Failure {
    /// One request failed with a transient error reply: send it again.
    Request { offset: u64 },
    /// The connection is gone (or hung): reopen it and resend what was in flight.
    Connection,
    /// Never retried.
    Permanent,
}

/// NBD error values that say "try again": EIO and ESHUTDOWN.
fn transient_errno(errno: u32) -> bool {
    matches!(errno, 5 | 108)
}

/// Classifies an error from an end that can be reopened (`reconnects`: NBD). Errors of
/// other ends are permanent.
pub(crate) fn classify(e: &CopyError, reconnects: bool) -> Failure {
    if !reconnects {
        return Failure::Permanent;
    }
    match e {
        CopyError::Remote { errno, offset, .. } if transient_errno(*errno) => Failure::Request { offset: *offset },
        CopyError::Remote { .. } => Failure::Permanent,
        CopyError::Peer { error, .. } => match error {
            ConnError::Closed | ConnError::Io(_) | ConnError::Connect { .. } | ConnError::Tls(_) => Failure::Connection,
            ConnError::Remote(r) if transient_errno(r.errno) => Failure::Connection,
            _ => Failure::Permanent,
        },
        // Sending a batch failed: the socket is gone.
        CopyError::Request { .. } => Failure::Connection,
        // Reopening failed to connect: the server may be back in a moment. A server that
        // answers but refuses the export (it is gone) or breaks the handshake is final.
        CopyError::Connect { source, .. } => match source {
            ConnError::Closed | ConnError::Io(_) | ConnError::Connect { .. } => Failure::Connection,
            _ => Failure::Permanent,
        },
        CopyError::Setup(_) | CopyError::Local { .. } | CopyError::Interrupted => Failure::Permanent,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_and_is_capped() {
        let p = RetryPolicy { retries: 5, delay: Duration::from_millis(100), request_timeout: None };
        assert_eq!(p.backoff(1), Duration::from_millis(100));
        assert_eq!(p.backoff(2), Duration::from_millis(200));
        assert_eq!(p.backoff(4), Duration::from_millis(800));
        assert_eq!(p.backoff(u32::MAX), MAX_DELAY);
    }

    #[test]
    fn transient_and_permanent_errors() {
        let remote = |errno| CopyError::Remote { op: "read", offset: 7, length: 1, errno, message: String::new() };
        assert_eq!(classify(&remote(5), true), Failure::Request { offset: 7 });
        assert_eq!(classify(&remote(108), true), Failure::Request { offset: 7 });
        for errno in [1, 22, 28, 12] {
            assert_eq!(classify(&remote(errno), true), Failure::Permanent, "{errno}");
        }
        assert_eq!(classify(&remote(5), false), Failure::Permanent);
        let peer = CopyError::Peer { what: "source", name: "x".into(), error: ConnError::Closed };
        assert_eq!(classify(&peer, true), Failure::Connection);
        assert_eq!(classify(&CopyError::Setup("size changed".into()), true), Failure::Permanent);
        let refused = ferry_proto::client::ClientError::Refused { export: "x".into(), reason: "unknown".into() };
        let gone = CopyError::Connect { what: "source", source: ConnError::Handshake(refused) };
        assert_eq!(classify(&gone, true), Failure::Permanent, "an export that is gone");
        let down = CopyError::Connect { what: "source", source: ConnError::Closed };
        assert_eq!(classify(&down, true), Failure::Connection, "a server not back yet");
    }
}
