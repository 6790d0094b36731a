"""asyncio API (`grpc.aio`): `AsyncPool`, the write protocol of `Pool` for
code that runs an event loop. Both carry out the one protocol of
`protocol.py` (what is retried, aborted, claimed, when a reservation ends);
this module only runs its steps with `grpc.aio` and tasks. Many blocks can
be in flight at once from one task group (`asyncio.gather`), and
`write_blocks` pipelines a batch as `Pool.write_blocks` does.
"""

from __future__ import annotations

import asyncio
import time
from typing import Dict, Iterable, List, Optional, Sequence

import grpc

from aliquot.v1 import agent_pb2_grpc, allocator_pb2, allocator_pb2_grpc

from . import protocol
from .pool import (
    _OPTIONS,
    _transient,
    AliquotError,
    Block,
    Tls,
    Txg,
    _target,
    allocator_targets,
    follow,
)


class AsyncPool:
    """An asyncio client of one Aliquot pool.

    >>> async with AsyncPool("127.0.0.1:7000", tls=Tls.in_dir("aliquot-data/certs")) as pool:
    ...     blocks = await asyncio.gather(*(pool.write_block(b"x" * 4096) for _ in range(8)))
    """

    def __init__(self, allocator, tls: Optional[Tls] = None, timeout: float = 10.0,
                 allocator_wait: float = 60.0, attempts: int = 5):
        """`allocator`: its address, or several (a list, or one string
        separated by commas) of allocators sharing a PostgreSQL store: calls
        go to the one that leads, following NOT_LEADER after a takeover, as
        `Pool`'s do."""
        self.tls = tls
        self.attempts = attempts
        self.timeout = timeout
        self.allocator_wait = allocator_wait
        self._creds = tls.credentials() if tls is not None else None
        self._channels: List[grpc.aio.Channel] = []
        self._leader = protocol.Leader(allocator_targets(allocator))
        self._allocators: Dict[str, allocator_pb2_grpc.AllocatorStub] = {
            t: allocator_pb2_grpc.AllocatorStub(self._channel(t, "allocator.aliquot"))
            for t in self._leader.targets
        }
        self._agents: Dict[str, agent_pb2_grpc.VdevAgentStub] = {}

    @property
    def allocator(self) -> allocator_pb2_grpc.AllocatorStub:
        """The stub of the allocator believed to lead."""
        return self._allocators[self._leader.target]

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

    def _error(self, what: str, err: grpc.RpcError, target: Optional[str] = None) -> AliquotError:
        return AliquotError(what, err, target=target or self._leader.target, tls=self.tls is not None)

    # ---- carrying out protocol.py's operations -------------------------------

    async def _run(self, op):
        """Carry out a protocol operation (a generator of protocol.py) with
        `grpc.aio` calls; its result."""
        done, x = protocol.advance(op)
        while not done:
            try:
                value, error = await self._do(x), None
            except Exception as e:
                value, error = None, e
            done, x = protocol.advance(op, value, error)
        return x

    async def _do(self, step):
        if isinstance(step, protocol.Call):
            return await self._call(step)
        if isinstance(step, protocol.Parallel):
            return await self._parallel(step)
        if isinstance(step, protocol.Sleep):
            await asyncio.sleep(step.seconds)
            return None
        raise TypeError(f"unknown protocol step {step!r}")

    async def _call(self, c: protocol.Call):
        timeout = None if c.unbounded else self.timeout
        if c.agent is not None:
            try:
                return await getattr(self.agent(c.agent), c.method)(c.request, timeout=timeout)
            except grpc.aio.AioRpcError as e:
                raise self._error(c.what, e, target=_target(c.agent)) from e
        deadline = time.monotonic() + self.allocator_wait
        attempt = 0
        while True:
            target = self._leader.target
            try:
                return await getattr(self._allocators[target], c.method)(c.request, timeout=timeout)
            except grpc.aio.AioRpcError as e:
                follow(self._leader, target, e)
                if c.repeat and _transient(e) and time.monotonic() < deadline:
                    await asyncio.sleep(min(0.1 * 2**attempt, 1.0))
                    attempt += 1
                    continue
                raise self._error(c.what, e) from e

    async def _parallel(self, p: protocol.Parallel) -> list:
        s = protocol.Schedule(p)
        while s.start(lambda op: asyncio.ensure_future(self._run(op))):
            done, _ = await asyncio.wait(s.running, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                s.finished(t)
        return s.results()

    # ---- the API ---------------------------------------------------------------

    async def _repeat(self, what: str, method: str, req):
        return await self._call(protocol.Call(what, method, req, repeat=True))

    async def get_pool(self) -> allocator_pb2.PoolStatus:
        return await self._repeat("get pool", "GetPool", allocator_pb2.GetPoolRequest())

    async def free(self, blocks: Sequence[Block]) -> Txg:
        """Free blocks' extents, as `Pool.free`: the txg the frees belong to
        (an int that also carries the allocator generation it belongs to)."""
        return Txg(*(await self._run(protocol.free([e for b in blocks for e in b.extents]))))

    async def sync_txg(self, txg: int = 0, generation: int = 0) -> int:
        """Wait until `txg` (0: the open one) has synced, as `Pool.sync_txg`
        (a `Txg` from `free` carries its generation); the synced txg."""
        if not generation:
            generation = getattr(txg, "generation", 0)
        return await self._run(protocol.sync_txg(txg, generation))

    async def write_block(self, data: bytes, copies: int = 1, durable: bool = True,
                          log: bool = False, affinity_key: Optional[int] = None) -> Block:
        """Allocate, write each copy, flush those agents, commit (with
        `durable`, once its txg has synced), as `Pool.write_block`."""
        return await self._run(
            protocol.write_block(data, copies, log, durable, self.attempts, affinity_key)
        )

    async def write_blocks(self, blocks: Iterable[bytes], copies: int = 1, durable: bool = True,
                           in_flight: int = protocol.IN_FLIGHT,
                           affinity_key: Optional[int] = None) -> List[Block]:
        """A pipelined batch with one Commit, as `Pool.write_blocks`."""
        return await self._run(
            protocol.write_blocks(blocks, copies, durable, self.attempts, in_flight, affinity_key)
        )

    async def _commit_or_claim(self, r: allocator_pb2.AllocateReply, length: int, durable: bool):
        """Commit `r`, whose data is written and flushed, or claim it after
        an allocator restart: (the block, None), or (None, why)."""
        return await self._run(protocol.commit_or_claim(r, length, durable))

    async def read_block(self, block: Block, copy: Optional[int] = None) -> bytes:
        """Read a block back: copy `copy`, or the first copy that answers."""
        return await self._run(protocol.read_block(block, copy))
