//! The `aliquot.v1` gRPC API shared by every Aliquot service.
//!
//! When you change the API: add fields, never renumber or reuse them; say the
//! unit of every number in its comment; keep `common.proto` for types more
//! than one service uses; bump to `aliquot.v2` only for a breaking change.

pub mod v1 {
    #![allow(clippy::all)]
    tonic::include_proto!("aliquot.v1");
}

/// The encoded descriptor set, for gRPC reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("aliquot_descriptor");

pub mod error;
pub mod reflection;
