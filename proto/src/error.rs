//! The one error vocabulary of every Aliquot service: the `ErrorReason`
//! enum declared in allocator.proto, one ErrorInfo domain, and the one way
//! a refusal becomes a `tonic::Status`. Each service's error type maps each
//! of its errors to a [`Refusal`] in one match (code, reason, values,
//! whether to retry), as linkerd2-proxy builds every synthetic response
//! from one value; clients read the same fields back with [`reason`],
//! [`metadata`] and [`retry_after`].
//!
//! A status carries a `google.rpc.ErrorInfo` (reason, domain, metadata) and,
//! when the same call repeated later may get past it, a
//! `google.rpc.RetryInfo` with how long to wait first. An error inside
//! `AllocateStream` carries the same `google.rpc.Status` in
//! `StreamError.status` ([`stream_error`], [`from_stream_error`]).

use std::collections::HashMap;
use std::time::Duration;

use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use crate::v1::{ErrorReason, StreamError};

/// The ErrorInfo domain of every reason, of every service.
pub const DOMAIN: &str = "aliquot.v1";

/// Bytes of a message, and of one ErrorInfo value, sent back: errors echo
/// input (a tunable's name, an endpoint), and an echo of a megabyte would
/// overflow the response's metadata limit and hide the real error.
pub const MESSAGE_MAX: usize = 2048;
pub const METADATA_MAX: usize = 256;

/// What a service answers for one error: everything but the message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub code: Code,
    pub reason: ErrorReason,
    /// The values involved (ErrorInfo metadata), in the order given.
    pub metadata: Vec<(&'static str, String)>,
    /// Some: the same call, repeated after this long, may succeed
    /// (RetryInfo). None: repeating it as it is fails again.
    pub retry: Option<Duration>,
}

impl Refusal {
    pub fn new(code: Code, reason: ErrorReason) -> Refusal {
        Refusal {
            code,
            reason,
            metadata: Vec::new(),
            retry: None,
        }
    }

    /// One ErrorInfo metadata value.
    pub fn with(mut self, key: &'static str, value: impl ToString) -> Refusal {
        self.metadata.push((key, value.to_string()));
        self
    }

    /// Repeating the same call after `delay` may succeed.
    pub fn retry_after(mut self, delay: Duration) -> Refusal {
        self.retry = Some(delay);
        self
    }

    /// The status: `message` (clipped) with ErrorInfo and, if retryable,
    /// RetryInfo.
    pub fn status(self, message: impl Into<String>) -> Status {
        let metadata: HashMap<String, String> = self
            .metadata
            .into_iter()
            .map(|(k, v)| (k.to_string(), clip(v, METADATA_MAX)))
            .collect();
        let mut details =
            ErrorDetails::with_error_info(self.reason.as_str_name(), DOMAIN, metadata);
        if let Some(d) = self.retry {
            details.set_retry_info(Some(d));
        }
        Status::with_error_details(self.code, clip(message.into(), MESSAGE_MAX), details)
    }
}

/// The reason of an Aliquot status: its ErrorInfo's, when of our domain and
/// declared in the proto.
pub fn reason(s: &Status) -> Option<ErrorReason> {
    let info = s.get_details_error_info()?;
    if info.domain != DOMAIN {
        return None;
    }
    ErrorReason::from_str_name(&info.reason)
}

/// The ErrorInfo metadata of a status (empty without one).
pub fn metadata(s: &Status) -> HashMap<String, String> {
    s.get_details_error_info()
        .map(|i| i.metadata)
        .unwrap_or_default()
}

/// How long to wait before repeating the call, if the status says the
/// same call may then succeed (its RetryInfo).
pub fn retry_after(s: &Status) -> Option<Duration> {
    let r = s.get_details_retry_info()?;
    Some(r.retry_delay.unwrap_or_default())
}

/// A status as an `AllocateStream` reply carries it: the encoded
/// `google.rpc.Status` with the same details as the unary call's.
pub fn stream_error(s: &Status) -> StreamError {
    StreamError {
        code: s.code() as i32,
        message: s.message().to_string(),
        reason: reason(s).map_or_else(String::new, |r| r.as_str_name().to_string()),
        status: s.details().to_vec(),
    }
}

/// The status a `StreamError` carries, as the unary call would have
/// answered it.
pub fn from_stream_error(e: StreamError) -> Status {
    Status::with_details(Code::from_i32(e.code), e.message, e.status.into())
}

/// `s` cut to at most `max` bytes (at a character boundary), marked.
pub fn clip(mut s: String, max: usize) -> String {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    let dropped = s.len() - end;
    s.truncate(end);
    s.push_str(&format!("… ({dropped} more bytes)"));
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_reads_back_from_its_status_and_its_stream_error() {
        let s = Refusal::new(Code::Unavailable, ErrorReason::NotLeader)
            .with("leader", "http://b:7000")
            .retry_after(Duration::from_millis(250))
            .status("standby");
        for s in [s.clone(), from_stream_error(stream_error(&s))] {
            assert_eq!(s.code(), Code::Unavailable);
            assert_eq!(s.message(), "standby");
            assert_eq!(reason(&s), Some(ErrorReason::NotLeader));
            assert_eq!(metadata(&s)["leader"], "http://b:7000");
            assert_eq!(retry_after(&s), Some(Duration::from_millis(250)));
        }
        let plain = Refusal::new(Code::Aborted, ErrorReason::LeaseExpired).status("m");
        assert_eq!(retry_after(&plain), None);
    }

    #[test]
    fn a_reason_of_another_domain_is_not_ours() {
        let s = Status::with_error_details(
            Code::Unavailable,
            "x",
            ErrorDetails::with_error_info("NOT_LEADER", "example.com", HashMap::new()),
        );
        assert_eq!(reason(&s), None);
    }

    #[test]
    fn echoed_input_is_clipped() {
        let long = "é".repeat(5000);
        let c = clip(long.clone(), MESSAGE_MAX);
        assert!(c.len() < MESSAGE_MAX + 40, "{}", c.len());
        assert!(c.ends_with("more bytes)"));
        assert_eq!(clip("short".into(), 10), "short");
        let s = Refusal::new(Code::InvalidArgument, ErrorReason::InvalidArgument)
            .with("name", &long)
            .status(long);
        assert!(s.message().len() < MESSAGE_MAX + 40);
        assert!(metadata(&s)["name"].len() < METADATA_MAX + 40);
    }
}
