//! `google.rpc.ErrorInfo` on Aliquot errors: every service builds its
//! `tonic::Status` here and every client reads the reason back here, so the
//! domain and the reason strings (`ErrorReason` names) are spelled once.

use std::collections::HashMap;

use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use crate::v1::ErrorReason;

/// The ErrorInfo domain of every Aliquot error.
pub const DOMAIN: &str = "aliquot.v1";

/// A status with an ErrorInfo detail: `reason` is the ErrorReason's name.
pub fn status(
    code: Code,
    reason: ErrorReason,
    message: impl Into<String>,
    metadata: impl IntoIterator<Item = (String, String)>,
) -> Status {
    let details = ErrorDetails::with_error_info(
        reason.as_str_name(),
        DOMAIN,
        metadata.into_iter().collect::<HashMap<_, _>>(),
    );
    Status::with_error_details(code, message, details)
}

/// The reason of an Aliquot status, if it carries our ErrorInfo.
pub fn reason(status: &Status) -> Option<ErrorReason> {
    let info = status.get_details_error_info()?;
    if info.domain != DOMAIN {
        return None;
    }
    ErrorReason::from_str_name(&info.reason)
}

/// One metadata value of an Aliquot status's ErrorInfo.
pub fn metadata(status: &Status, key: &str) -> Option<String> {
    status.get_details_error_info()?.metadata.get(key).cloned()
}

/// The ErrorInfo (reason, metadata) of a status as a stream reply's error.
pub fn stream_error(status: &Status) -> crate::v1::StreamError {
    let info = status.get_details_error_info();
    crate::v1::StreamError {
        code: status.code() as i32,
        message: status.message().to_string(),
        reason: info.as_ref().map(|i| i.reason.clone()).unwrap_or_default(),
        metadata: info.map(|i| i.metadata).unwrap_or_default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reason_and_metadata_survive_the_round_trip_through_status_details() {
        let s = status(
            Code::Aborted,
            ErrorReason::AllocatorRestarted,
            "txg 6 never synced",
            [("last_synced_txg".to_string(), "5".to_string())],
        );
        // What a client sees: the status rebuilt from its wire form.
        let wire = Status::from_header_map(s.into_http::<()>().headers()).unwrap();
        assert_eq!(reason(&wire), Some(ErrorReason::AllocatorRestarted));
        assert_eq!(metadata(&wire, "last_synced_txg").as_deref(), Some("5"));
        assert_eq!(ErrorReason::LeaseExpired.as_str_name(), "LEASE_EXPIRED");
        let e = stream_error(&wire);
        assert_eq!(e.reason, "ALLOCATOR_RESTARTED");
        assert_eq!(e.code, Code::Aborted as i32);
    }
}
