//! gRPC server reflection for one binary: v1 (grpcurl) and v1alpha (the
//! Python `grpcio-reflection` and older tools), each listing only the
//! services that binary serves, so a client that discovers the API never
//! calls a service that answers UNIMPLEMENTED.

use tonic_reflection::server::{Builder, Error, v1, v1alpha};

/// gRPC health, served by every binary.
pub const HEALTH: &str = "grpc.health.v1.Health";
const REFLECTION_V1: &str = "grpc.reflection.v1.ServerReflection";
const REFLECTION_V1ALPHA: &str = "grpc.reflection.v1alpha.ServerReflection";

fn builder(services: &[&str]) -> Builder<'static> {
    let mut b = Builder::configure()
        .register_encoded_file_descriptor_set(crate::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        // Both reflection protos, so either service can describe the other.
        .register_encoded_file_descriptor_set(tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_reflection::pb::v1alpha::FILE_DESCRIPTOR_SET)
        .include_reflection_service(false);
    for s in services
        .iter()
        .copied()
        .chain([HEALTH, REFLECTION_V1, REFLECTION_V1ALPHA])
    {
        b = b.with_service_name(s);
    }
    b
}

/// The two reflection services, listing `services` (fully qualified, e.g.
/// `aliquot.v1.Allocator`) plus health and reflection themselves.
#[allow(clippy::type_complexity)]
pub fn services(
    services: &[&str],
) -> Result<
    (
        v1::ServerReflectionServer<impl v1::ServerReflection>,
        v1alpha::ServerReflectionServer<impl v1alpha::ServerReflection>,
    ),
    Error,
> {
    Ok((
        builder(services).build_v1()?,
        builder(services).build_v1alpha()?,
    ))
}
