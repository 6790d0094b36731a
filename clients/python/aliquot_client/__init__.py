"""Aliquot's Python client.

`Pool` connects to an Aliquot allocator (mutual TLS with the pool's
certificates, or plaintext for a pool started with --insecure) and writes
blocks the way the durability contract asks: Allocate -> write each copy to
the agent the allocator chose (with its write token) -> Flush those agents ->
Commit, retrying the calls that are safe to retry. The generated stubs are
importable as `aliquot.v1.allocator_pb2` & co. for everything else.
`AsyncPool` is the same write protocol on `grpc.aio`.
"""

from .pool import Block, ErrorReason, AliquotError, Pool, Tls, Txg, error_reason
from .aio import AsyncPool

__all__ = ["AsyncPool", "Block", "ErrorReason", "AliquotError", "Pool", "Tls", "Txg", "error_reason"]
