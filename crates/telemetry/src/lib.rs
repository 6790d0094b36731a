//! tracing + OpenTelemetry setup and gRPC trace-context propagation shared by every Aliquot binary.
