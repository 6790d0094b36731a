//! The allocator service: the pool's space maps and throttle behind gRPC.
