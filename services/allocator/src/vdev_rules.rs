//! What the store accepts for a vdev, checked before anything is persisted
//! (issue 10: one `Register(capacity = 2^63)` used to be stored and then
//! refused by the allocator's own restore, bricking the pool). The rules are
//! those `metaslab::Pool::restore` applies to a stored vdev, so a vdev that
//! passes here always reopens.

use aliquot_proto::v1 as pb;
use metaslab::vdev::{metaslab_count, metaslab_shift};
use metaslab::{Tunables, VdevRole, VdevSpec};

use crate::error::{Error, Result};

/// Longest vdev name (bytes), as the agent's label keeps it.
pub const MAX_NAME: usize = 256;
/// Longest endpoint URL (bytes).
pub const MAX_ENDPOINT: usize = 256;
/// The metaslab shift range restore accepts (24 = SPA_MAXBLOCKSHIFT).
pub const MAX_METASLAB_SHIFT: u8 = 40;
/// Most metaslabs per vdev (as the policy's own limit).
pub const MAX_METASLABS: u64 = 1 << 20;
pub const ASHIFT_RANGE: std::ops::RangeInclusive<u32> = 9..=16;
pub const MAX_CHILDREN: u32 = 255;
/// raidz3 is the most parity OpenZFS has.
pub const MAX_PARITY: u32 = 3;

fn bad(field: &'static str, msg: String) -> Error {
    Error::VdevInvalid { field, msg }
}

/// A vdev name: 1..=256 bytes without control characters (it is shown in
/// status tables and logs as is; an escape sequence would rewrite a terminal).
pub fn check_name(name: &str) -> Result<()> {
    if name.is_empty() || name.len() > MAX_NAME {
        return Err(bad(
            "name",
            format!("vdev name must be 1..={MAX_NAME} bytes, not {}", name.len()),
        ));
    }
    if let Some(c) = name.chars().find(|c| c.is_control()) {
        return Err(bad(
            "name",
            format!("vdev name {name:?} has the control character {c:?}"),
        ));
    }
    Ok(())
}

pub fn check_endpoint(endpoint: &str) -> Result<()> {
    if endpoint.len() > MAX_ENDPOINT
        || endpoint.parse::<tonic::transport::Uri>().is_err()
        || !endpoint.contains("://")
    {
        let shown: String = endpoint.chars().take(80).collect();
        return Err(bad(
            "endpoint",
            format!(
                "endpoint {shown:?} is not a URL such as http://127.0.0.1:7001 of at most {MAX_ENDPOINT} bytes"
            ),
        ));
    }
    Ok(())
}

/// The metaslab shift a vdev of `capacity` gets, if the store can keep it.
pub fn check_capacity(capacity: u64, shift: u8) -> Result<()> {
    let count = metaslab_count(capacity, shift);
    if shift > MAX_METASLAB_SHIFT || count > MAX_METASLABS {
        return Err(bad(
            "capacity",
            format!(
                "capacity {capacity} bytes is beyond what metaslab sizing allows \
                 (metaslab shift {shift}, {count} metaslabs; at most shift {MAX_METASLAB_SHIFT} \
                 and {MAX_METASLABS} metaslabs)"
            ),
        ));
    }
    if count == 0 {
        return Err(bad(
            "capacity",
            format!(
                "capacity {capacity} bytes is smaller than one metaslab ({} bytes)",
                1u64 << shift
            ),
        ));
    }
    Ok(())
}

/// The spec of a registration, or why the store would not keep it.
pub fn spec_of(r: &pb::RegisterRequest, t: &Tunables) -> Result<VdevSpec> {
    if r.device_guid == 0 {
        return Err(bad(
            "device_guid",
            "device_guid must be set (the device's stable identity)".into(),
        ));
    }
    check_endpoint(r.endpoint.trim())?;
    check_name(&r.name)?;
    if !ASHIFT_RANGE.contains(&r.ashift) {
        return Err(bad(
            "ashift",
            format!("ashift {} is outside {ASHIFT_RANGE:?}", r.ashift),
        ));
    }
    let children = r.children.max(1);
    if children > MAX_CHILDREN {
        return Err(bad(
            "children",
            format!("children {children} is above {MAX_CHILDREN}"),
        ));
    }
    if r.parity > MAX_PARITY || r.parity >= children {
        return Err(bad(
            "parity",
            format!(
                "parity {} must be at most {MAX_PARITY} and leave data children of {children}",
                r.parity
            ),
        ));
    }
    if r.backend.len() > 32 {
        return Err(bad("backend", "backend name is above 32 bytes".into()));
    }
    let shift = metaslab_shift(r.capacity, t).max(r.ashift as u8);
    check_capacity(r.capacity, shift)?;
    Ok(VdevSpec {
        capacity: r.capacity,
        ashift: r.ashift as u8,
        children,
        parity: r.parity,
        rotational: r.rotational,
        role: if r.log {
            VdevRole::Log
        } else {
            VdevRole::Normal
        },
        metaslab_shift: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(capacity: u64) -> pb::RegisterRequest {
        pb::RegisterRequest {
            endpoint: "http://127.0.0.1:7001".into(),
            device_guid: 7,
            name: "vdev0".into(),
            capacity,
            ashift: 12,
            children: 1,
            ..Default::default()
        }
    }

    #[test]
    fn out_of_range_registrations_are_refused_naming_the_field() {
        let t = Tunables::default();
        assert!(spec_of(&req(1 << 30), &t).is_ok());
        let field = |r: pb::RegisterRequest| match spec_of(&r, &t) {
            Err(Error::VdevInvalid { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        assert_eq!(field(req(1 << 63)), "capacity");
        assert_eq!(field(req(1 << 20)), "capacity");
        assert_eq!(
            field(pb::RegisterRequest {
                name: "x".repeat(70_000),
                ..req(1 << 30)
            }),
            "name"
        );
        assert_eq!(
            field(pb::RegisterRequest {
                name: "a\u{1b}[2J".into(),
                ..req(1 << 30)
            }),
            "name"
        );
        assert_eq!(
            field(pb::RegisterRequest {
                ashift: 40,
                ..req(1 << 30)
            }),
            "ashift"
        );
        assert_eq!(
            field(pb::RegisterRequest {
                children: 3,
                parity: 3,
                ..req(1 << 30)
            }),
            "parity"
        );
    }

    #[test]
    fn every_accepted_capacity_reopens_with_the_policy_restore() {
        // The point of the rules: what passes here, Pool::restore accepts.
        let t = Tunables::default();
        for cap in [1u64 << 24, 1 << 34, 1 << 45, 1 << 50, 1 << 57] {
            if let Ok(mut spec) = spec_of(&req(cap), &t) {
                spec.metaslab_shift = Some(metaslab_shift(cap, &t).max(12));
                metaslab::Pool::restore(t.clone(), vec![(0, spec)], &[], 0)
                    .unwrap_or_else(|e| panic!("capacity {cap}: {e}"));
            }
        }
    }
}
