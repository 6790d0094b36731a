//! Which failures are worth repeating, and the one loop that repeats them.
//! A call is repeated as it is only when the server marks the refusal
//! retryable (its RetryInfo, per the proto's reason table) or when no
//! server answered at all (a transport failure: the allocator restarting,
//! a takeover under way). The pause is telemetry's jittered backoff, never
//! shorter than the RetryInfo asks, never past the caller's deadline.

use std::future::Future;
use std::time::Duration;

use aliquot_proto::error::{reason, retry_after};
use aliquot_proto::v1::ErrorReason;
use telemetry::backoff::Backoff;
use tokio::time::Instant;

/// Failures of a retry-safe call worth repeating as they are: what the
/// server marks so (RetryInfo), or a transport failure (no reason at all).
pub fn transient(s: &tonic::Status) -> bool {
    let retryable = match reason(s) {
        Some(ErrorReason::VdevsOffline) => false,
        Some(_) => retry_after(s).is_some(),
        None => true,
    };
    retryable
        && matches!(
            s.code(),
            tonic::Code::Unavailable | tonic::Code::DeadlineExceeded
        )
}

/// Failures after which a block is written again with a new allocation:
/// its space was given back, or will be by its lease.
pub fn retry_block(s: &tonic::Status) -> bool {
    matches!(
        reason(s),
        Some(ErrorReason::LeaseExpired | ErrorReason::AllocatorRestarted)
    )
}

/// An agent's answer to a write after which the block is written again
/// with a new allocation: the agent is gone or restarting (transport
/// errors), its device is full (ENOSPC), or it no longer honours the
/// allocation's token (it restarted, or the allocator did).
pub fn rewrite_elsewhere(s: &tonic::Status) -> bool {
    use tonic::Code;
    match s.code() {
        Code::Unavailable | Code::DeadlineExceeded | Code::Unknown | Code::Cancelled => true,
        Code::Aborted | Code::ResourceExhausted => true,
        Code::PermissionDenied => matches!(
            reason(s),
            Some(ErrorReason::WriteTokenBeforeAgentStart | ErrorReason::WriteTokenOldGeneration)
        ),
        _ => false,
    }
}

/// The allocator cannot place anything right now but will (it is down,
/// restarting, or no vdev is allocatable yet): wait, not an attempt.
pub fn allocator_away(s: &tonic::Status) -> bool {
    matches!(
        s.code(),
        tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Unknown
    ) || reason(s) == Some(ErrorReason::VdevsOffline)
}

/// How long and how often [`retry_transient`] repeats a call.
#[derive(Clone, Debug)]
pub struct Retry {
    /// Give up once this much time has passed since the first attempt.
    pub wait: Duration,
    /// The first pause; it doubles up to `max_delay` (jittered).
    pub min_delay: Duration,
    pub max_delay: Duration,
}

impl Retry {
    /// Repeat for up to `wait`, pausing 100 ms doubling to 2 s.
    pub const fn within(wait: Duration) -> Retry {
        Retry {
            wait,
            min_delay: Duration::from_millis(100),
            max_delay: Duration::from_secs(2),
        }
    }

    /// The same, with pauses from `min` doubling to `max`.
    pub const fn delays(self, min: Duration, max: Duration) -> Retry {
        Retry {
            min_delay: min,
            max_delay: max,
            ..self
        }
    }
}

/// `call` until it succeeds, fails for good, or `policy.wait` has passed:
/// repeated only on [`transient`] failures. The last failure is returned.
pub async fn retry_transient<T, F, Fut>(policy: &Retry, call: F) -> Result<T, tonic::Status>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, tonic::Status>>,
{
    retry_transient_seen(policy, |_| {}, call).await
}

/// [`retry_transient`], telling `seen` of each failure that is repeated
/// (e.g. to start looking for an allocator restart).
pub async fn retry_transient_seen<T, F, Fut>(
    policy: &Retry,
    mut seen: impl FnMut(&tonic::Status),
    mut call: F,
) -> Result<T, tonic::Status>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, tonic::Status>>,
{
    let deadline = Instant::now() + policy.wait;
    let mut backoff = Backoff::new(policy.min_delay, policy.max_delay);
    loop {
        match call().await {
            Err(s) if transient(&s) && Instant::now() < deadline => {
                seen(&s);
                let asked = retry_after(&s).unwrap_or_default();
                // Never sleep past the deadline: one last try at it.
                let left = deadline.saturating_duration_since(Instant::now());
                tokio::time::sleep(asked.max(backoff.next_delay()).min(left)).await;
            }
            r => return r,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use aliquot_proto::error::Refusal;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[test]
    fn transient_follows_retry_info_and_transport_failures() {
        assert!(transient(&tonic::Status::unavailable("connection refused")));
        assert!(!transient(&tonic::Status::invalid_argument("bad")));
        let marked = Refusal::new(tonic::Code::Unavailable, ErrorReason::NotLeader)
            .retry_after(Duration::from_millis(5))
            .status("standby");
        assert!(transient(&marked));
        let unmarked =
            Refusal::new(tonic::Code::Unavailable, ErrorReason::NotLeader).status("standby");
        assert!(!transient(&unmarked));
        let offline = Refusal::new(tonic::Code::Unavailable, ErrorReason::VdevsOffline)
            .retry_after(Duration::from_millis(5))
            .status("none");
        assert!(!transient(&offline));
    }

    #[tokio::test]
    async fn retries_transient_failures_until_success_or_deadline() {
        let quick =
            |wait| Retry::within(wait).delays(Duration::from_millis(1), Duration::from_millis(5));
        let n = AtomicU32::new(0);
        let r = retry_transient(&quick(Duration::from_secs(30)), || async {
            if n.fetch_add(1, Ordering::Relaxed) < 3 {
                Err(tonic::Status::unavailable("down"))
            } else {
                Ok(7)
            }
        })
        .await;
        assert_eq!(r.unwrap(), 7);
        assert_eq!(n.load(Ordering::Relaxed), 4);

        // A permanent failure is returned at once.
        let n = AtomicU32::new(0);
        let r: Result<(), _> = retry_transient(&quick(Duration::from_secs(30)), || async {
            n.fetch_add(1, Ordering::Relaxed);
            Err(tonic::Status::invalid_argument("no"))
        })
        .await;
        assert_eq!(r.unwrap_err().code(), tonic::Code::InvalidArgument);
        assert_eq!(n.load(Ordering::Relaxed), 1);

        // A transient one is given up at the deadline.
        let t0 = Instant::now();
        let r: Result<(), _> = retry_transient(&quick(Duration::from_millis(50)), || async {
            Err(tonic::Status::unavailable("down"))
        })
        .await;
        assert_eq!(r.unwrap_err().code(), tonic::Code::Unavailable);
        assert!(t0.elapsed() >= Duration::from_millis(50));
    }
}
