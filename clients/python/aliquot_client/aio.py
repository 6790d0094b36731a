"""asyncio API (`grpc.aio`): `AsyncPool`, the write protocol of `Pool` for
code that runs an event loop. Many blocks can be in flight at once from one
task group (`asyncio.gather`). It retries what `Pool` retries on the
allocator (UNAVAILABLE / DEADLINE_EXCEEDED on Commit and SyncTxg, within
`allocator_wait`); a failed data write aborts its allocation and raises
`AliquotError` (write the block again). As `Pool`, a block whose data is
written when the allocator restarts is claimed in the new generation
instead of committed (its Commit answers ALLOCATOR_RESTARTED), but only
while that generation's claim window is open; after it, or when an extent
is refused (its space was given out), the block is written again.
"""

from __future__ import annotations

import asyncio
import time
from typing import Dict, List, Optional, Sequence

import grpc

from aliquot.v1 import agent_pb2, agent_pb2_grpc, allocator_pb2, allocator_pb2_grpc

from .pool import (
    _OPTIONS,
    _TRANSIENT,
    AliquotError,
    Block,
    ErrorReason,
    Tls,
    Txg,
    _target,
    all_claimed,
    claim_window_open,
    claimed_extents,
)

# Writes of one block before its last failure is raised (each allocates anew).
_ATTEMPTS = 3


class AsyncPool:
    """An asyncio client of one Aliquot allocator.

    >>> async with AsyncPool("127.0.0.1:7000", tls=Tls.in_dir("aliquot-data/certs")) as pool:
    ...     blocks = await asyncio.gather(*(pool.write_block(b"x" * 4096) for _ in range(8)))
    """

    def __init__(self, allocator: str, tls: Optional[Tls] = None, timeout: float = 10.0,
                 allocator_wait: float = 60.0):
        self.tls = tls
        self.timeout = timeout
        self.allocator_wait = allocator_wait
        self._creds = tls.credentials() if tls is not None else None
        self._target = _target(allocator)
        self._channels: List[grpc.aio.Channel] = []
        self.allocator = allocator_pb2_grpc.AllocatorStub(self._channel(self._target, "allocator.aliquot"))
        self._agents: Dict[str, agent_pb2_grpc.VdevAgentStub] = {}

    def _channel(self, target: str, server_name: str) -> grpc.aio.Channel:
        if self._creds is None:
            ch = grpc.aio.insecure_channel(target, options=_OPTIONS)
        else:
            opts = _OPTIONS + [("grpc.ssl_target_name_override", server_name)]
            ch = grpc.aio.secure_channel(target, self._creds, options=opts)
        self._channels.append(ch)
        return ch

    def agent(self, endpoint: str) -> agent_pb2_grpc.VdevAgentStub:
        t = _target(endpoint)
        if t not in self._agents:
            self._agents[t] = agent_pb2_grpc.VdevAgentStub(self._channel(t, "agent.aliquot"))
        return self._agents[t]

    async def close(self) -> None:
        for ch in self._channels:
            await ch.close()

    async def __aenter__(self) -> "AsyncPool":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _error(self, what: str, err: grpc.RpcError) -> AliquotError:
        return AliquotError(what, err, target=self._target, tls=self.tls is not None)

    async def _repeat(self, what: str, method: str, req):
        deadline = time.monotonic() + self.allocator_wait
        attempt = 0
        while True:
            try:
                return await getattr(self.allocator, method)(req, timeout=self.timeout)
            except grpc.aio.AioRpcError as e:
                if e.code() in _TRANSIENT and time.monotonic() < deadline:
                    await asyncio.sleep(min(0.1 * 2**attempt, 1.0))
                    attempt += 1
                    continue
                raise self._error(what, e) from e

    async def get_pool(self) -> allocator_pb2.PoolStatus:
        return await self._repeat("get pool", "GetPool", allocator_pb2.GetPoolRequest())

    async def free(self, blocks: Sequence[Block]) -> Txg:
        """Free blocks' extents, as `Pool.free`: the txg the frees belong to
        (an int that also carries the allocator generation it belongs to)."""
        extents = [e for b in blocks for e in b.extents]
        # The allocator takes at most 4096 extents per Free.
        txg, generation = 0, 0
        for i in range(0, len(extents), 4096):
            r = await self._repeat(
                "free", "Free", allocator_pb2.FreeRequest(extents=extents[i : i + 4096])
            )
            txg, generation = max(txg, r.txg), r.generation
        return Txg(txg, generation)

    async def sync_txg(self, txg: int = 0, generation: int = 0) -> int:
        """Wait until `txg` (0: the open one) has synced, as `Pool.sync_txg`
        (a `Txg` from `free` carries its generation); the synced txg."""
        if not generation:
            generation = getattr(txg, "generation", 0)
        r = await self._repeat(
            "sync txg",
            "SyncTxg",
            allocator_pb2.SyncTxgRequest(txg=int(txg), generation=generation),
        )
        return r.synced_txg

    async def write_block(self, data: bytes, copies: int = 1, durable: bool = True) -> Block:
        """Allocate, write each copy, flush those agents, commit (with
        `durable`, once its txg has synced)."""
        if not 0 < len(data) <= 16 << 20:
            raise ValueError(f"a block is 1 B ..= 16 MiB, not {len(data)} bytes")
        last_error: Optional[AliquotError] = None
        for _ in range(_ATTEMPTS):
            block, last_error = await self._write_once(data, copies, durable)
            if block is not None:
                return block
        assert last_error is not None
        raise last_error

    async def _write_once(self, data: bytes, copies: int, durable: bool):
        """One attempt: (the block, None), or (None, why) when the allocator
        changed generation and the block must be written anew."""
        req = allocator_pb2.AllocateRequest(
            size=len(data), copies=copies, **{"class": allocator_pb2.ALLOCATION_CLASS_DATA}
        )
        try:
            # No deadline: a DATA allocation may wait in the throttle.
            r = await self.allocator.Allocate(req)
        except grpc.aio.AioRpcError as e:
            raise self._error("allocate", e) from e
        try:
            await asyncio.gather(*(
                self.agent(ep).Write(
                    agent_pb2.WriteRequest(offset=ext.offset, data=data + bytes(ext.size - len(data)), token=tok),
                    timeout=self.timeout,
                )
                for ext, ep, tok in zip(r.extents, r.endpoints, r.tokens or [b""] * len(r.extents))
            ))
            await asyncio.gather(*(
                self.agent(ep).Flush(agent_pb2.FlushRequest(), timeout=self.timeout)
                for ep in sorted(set(r.endpoints))
            ))
        except grpc.aio.AioRpcError as e:
            try:
                await self.allocator.Abort(
                    allocator_pb2.AbortRequest(allocation_ids=[r.allocation_id]), timeout=self.timeout
                )
            except grpc.aio.AioRpcError:
                pass
            raise self._error("write", e) from e
        return await self._commit_or_claim(r, len(data), durable)

    async def _commit_or_claim(self, r: allocator_pb2.AllocateReply, length: int, durable: bool):
        """Commit `r`, whose data is written and flushed. After an allocator
        restart the new generation does not know the allocation
        (ALLOCATOR_RESTARTED): inside its claim window, claim the extents
        instead (with `durable`, wait until the claim's txg has synced);
        after it, or when an extent is refused, give back what was claimed
        and answer (None, why): the block is written anew."""
        try:
            c = await self._repeat(
                "commit",
                "Commit",
                allocator_pb2.CommitRequest(
                    allocation_ids=[r.allocation_id], wait_synced=durable, generation=r.generation
                ),
            )
            txg, generation, synced = c.txg, c.generation, c.synced
        except AliquotError as e:
            if e.reason != ErrorReason.ALLOCATOR_RESTARTED:
                raise
            if not claim_window_open(e):
                return None, e
            try:
                cl = await self._repeat(
                    "claim", "Claim", allocator_pb2.ClaimRequest(extents=r.extents, per_extent=True)
                )
            except AliquotError as ce:
                # An allocator answering all or nothing refused.
                if ce.reason != ErrorReason.CLAIM_CONFLICT:
                    raise
                return None, ce
            if not all_claimed(cl):
                claimed = claimed_extents(cl)
                if claimed:
                    try:
                        await self._repeat("free", "Free", allocator_pb2.FreeRequest(extents=claimed))
                    except AliquotError:
                        pass  # at worst their space stays allocated
                return None, e
            txg, generation, synced = cl.txg, cl.generation, False
            if durable:
                await self._repeat(
                    "sync txg",
                    "SyncTxg",
                    allocator_pb2.SyncTxgRequest(txg=txg, generation=generation),
                )
                synced = True
        block = Block(
            length=length,
            extents=list(r.extents),
            endpoints=list(r.endpoints),
            txg=txg,
            generation=generation,
            synced=synced,
        )
        return block, None

    async def read_block(self, block: Block, copy: int = 0) -> bytes:
        ext, ep = block.extents[copy], block.endpoints[copy]
        tokens = (
            await self._repeat(
                "read tokens", "ReadTokens", allocator_pb2.ReadTokensRequest(extents=[ext])
            )
        ).tokens
        try:
            r = await self.agent(ep).Read(
                agent_pb2.ReadRequest(offset=ext.offset, size=ext.size, token=tokens[0] if tokens else b""),
                timeout=self.timeout,
            )
        except grpc.aio.AioRpcError as e:
            raise self._error("read", e) from e
        return r.data[: block.length]
