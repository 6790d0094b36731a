"""The write protocol once, for `Pool` (blocking) and `AsyncPool` (asyncio).

Each operation is a generator that does no I/O: it yields what to do next
(`Call` one RPC, `Parallel` several operations, `Sleep`) and is sent the
result, or thrown the `AliquotError` the call ended with. `Pool._run` and
`AsyncPool._run` carry the yields out, one with blocking stubs and threads,
the other with `grpc.aio` and tasks; the rules (what is retried, what is
aborted, when a reservation ends) live here only.

A batch (`write_blocks`) is pipelined under the allocator's throttle: at
most `in_flight` blocks are between Allocate and the end of their writes,
and each block tells the allocator (`Written`) as soon as every copy is on
its agent, which ends its throttle reservation then, not at the batch's
Commit. A batch larger than the class's limit so never waits on its own
reservations, and a batch that fails gives back everything it placed.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Generator, Iterable, List, Optional, Sequence

from aliquot.v1 import agent_pb2, allocator_pb2, common_pb2

# The allocator takes at most 4096 extents (or ids) per request.
MAX_IDS = 4096
# Blocks of a batch between Allocate and the end of their writes.
IN_FLIGHT = 8
# Blocks between two looks at the batch's leases.
_LEASE_CHECK = 64


class ErrorReason:
    """The `reason` names of the google.rpc.ErrorInfo Aliquot errors carry:
    every name of the proto's `ErrorReason` enum (allocator.proto), taken
    from the generated stubs, as string attributes
    (`ErrorReason.NOT_LEADER == "NOT_LEADER"`)."""


for _name in allocator_pb2.ErrorReason.keys():
    setattr(ErrorReason, _name, _name)


class Leader:
    """Which of the allocators a client was given it believes leads (one
    address, or several sharing a PostgreSQL store), for both pools: after
    a failed call it moves to the leader a NOT_LEADER names, or, when the
    one it called is unreachable or stands by naming none, to the one after
    that (not after the current one: calls failing at once, one per thread
    or task, would each step on and could end where they began)."""

    def __init__(self, targets: Sequence[str]):
        if not targets:
            raise ValueError("no allocator address given")
        self.targets = list(targets)
        self.index = 0

    @property
    def target(self) -> str:
        return self.targets[self.index]

    def follow(self, called: str, transient: bool, reason: Optional[str], leader: str) -> None:
        """After a call to `called` failed: `transient` (UNAVAILABLE or
        DEADLINE_EXCEEDED), the error's reason (None without an ErrorInfo)
        and the leader it names (its `leader` metadata, as host:port)."""
        if len(self.targets) < 2:
            return
        if reason == ErrorReason.NOT_LEADER and leader in self.targets:
            self.index = self.targets.index(leader)
            return
        if (reason is None or reason == ErrorReason.NOT_LEADER) and transient and self.target == called:
            self.index = (self.index + 1) % len(self.targets)


@dataclasses.dataclass
class Call:
    """One RPC: `method` of the allocator (agent None) or of that agent."""

    what: str
    method: str
    request: Any
    agent: Optional[str] = None
    # Repeated on UNAVAILABLE / DEADLINE_EXCEEDED (within allocator_wait):
    # the call is safe to repeat.
    repeat: bool = False
    # No client deadline (an Allocate may wait in the throttle).
    unbounded: bool = False


@dataclasses.dataclass
class Parallel:
    """Run the operations (generators) at most `limit` at once. The result
    is one entry per operation, in order: its value, or the exception it
    ended with, or None for one never started because `stop_on_error` and
    another had failed."""

    ops: Iterable[Generator]
    limit: int
    stop_on_error: bool = False


def advance(op, value=None, error=None):
    """Resume `op` with its last step's value or error: (True, its result)
    once it is done, else (False, its next step)."""
    try:
        return False, (op.send(value) if error is None else op.throw(error))
    except StopIteration as done:
        return True, done.value


class Schedule:
    """A `Parallel` step's bookkeeping, for the drivers: `start` launches
    operations while fewer than `limit` run (none after a failure with
    `stop_on_error`), `finished` records one (a Future or Task), `results`
    answers in order."""

    def __init__(self, p: Parallel):
        self._p = p
        self._ops = iter(p.ops)
        self._results: dict = {}
        self._failed = False
        self._n = 0
        self.running: dict = {}

    def start(self, launch) -> bool:
        """Launch what may start now (`launch(op)` returns its handle);
        whether anything runs."""
        while len(self.running) < max(1, self._p.limit) and not (self._failed and self._p.stop_on_error):
            op = next(self._ops, None)
            if op is None:
                break
            self.running[launch(op)] = self._n
            self._n += 1
        return bool(self.running)

    def finished(self, handle) -> None:
        i = self.running.pop(handle)
        e = handle.exception()
        self._results[i] = e if e is not None else handle.result()
        self._failed = self._failed or e is not None

    def results(self) -> list:
        for op in self._ops:
            op.close()
            self._results[self._n] = None
            self._n += 1
        return [self._results[i] for i in range(self._n)]


@dataclasses.dataclass
class Sleep:
    seconds: float


@dataclasses.dataclass(frozen=True)
class Block:
    """A committed block: where its copies are and the txg that makes it durable."""

    length: int  # bytes of data (extents are rounded up to each vdev's ashift)
    extents: List[common_pb2.Extent]
    endpoints: List[str]
    txg: int
    generation: int
    synced: bool

    def to_json(self) -> str:
        """The block as JSON, to persist a reference (64-bit integers as
        strings, as the proto3 JSON mapping and `aliquotctl` write them)."""
        import json

        return json.dumps(
            {
                "length": self.length,
                "extents": [
                    {"vdev": e.vdev, "offset": str(e.offset), "size": str(e.size)}
                    for e in self.extents
                ],
                "endpoints": list(self.endpoints),
                "txg": str(self.txg),
                "generation": str(self.generation),
                "synced": self.synced,
            }
        )

    @staticmethod
    def from_json(text: str) -> "Block":
        """A block from `to_json`'s text."""
        import json

        d = json.loads(text)
        return Block(
            length=int(d["length"]),
            extents=[
                common_pb2.Extent(vdev=int(e["vdev"]), offset=int(e["offset"]), size=int(e["size"]))
                for e in d["extents"]
            ],
            endpoints=[str(ep) for ep in d["endpoints"]],
            txg=int(d["txg"]),
            generation=int(d["generation"]),
            synced=bool(d["synced"]),
        )


def claim_window_open(err) -> bool:
    """Whether an ALLOCATOR_RESTARTED error says the new generation's claim
    window is still open (a Claim may still take back what was written)."""
    try:
        return int(err.metadata.get("claim_window_remaining_ms", "0")) > 0
    except ValueError:
        return False


def all_claimed(reply: allocator_pb2.ClaimReply) -> bool:
    """Every extent of a per-extent Claim was claimed (an allocator that
    answers all or nothing sends no results when it claimed them all)."""
    return all(x.claimed for x in reply.results)


def claimed_extents(reply: allocator_pb2.ClaimReply) -> List[common_pb2.Extent]:
    return [x.extent for x in reply.results if x.claimed]


def check_size(data: bytes) -> None:
    if not 0 < len(data) <= 16 << 20:
        raise ValueError(f"a block is 1 B ..= 16 MiB, not {len(data)} bytes")


# ---- single calls ------------------------------------------------------------


def sync_txg(txg: int = 0, generation: int = 0):
    """Wait until `txg` (0: the open one) has synced; the synced txg."""
    r = yield Call(
        "sync txg",
        "SyncTxg",
        allocator_pb2.SyncTxgRequest(txg=int(txg), generation=generation),
        repeat=True,
    )
    return r.synced_txg


def free(extents: Sequence[common_pb2.Extent]):
    """Free extents, MAX_IDS a request; (txg, generation) of the last."""
    txg, generation = 0, 0
    for i in range(0, len(extents), MAX_IDS):
        r = yield Call(
            "free", "Free", allocator_pb2.FreeRequest(extents=extents[i : i + MAX_IDS]), repeat=True
        )
        txg, generation = max(txg, r.txg), r.generation
    return txg, generation


def abort(ids: Sequence[int]):
    """Give allocations back, ignoring failures (their leases take back
    what this cannot). An Abort is all or nothing: when one id of a batch is
    not in flight any more (its lease ended), the others are aborted one by
    one rather than left reserved until their own leases end."""
    ids = list(ids)
    for i in range(0, len(ids), MAX_IDS):
        part = ids[i : i + MAX_IDS]
        try:
            yield Call("abort", "Abort", allocator_pb2.AbortRequest(allocation_ids=part))
        except Exception:
            if len(part) > 1:
                for one in part:
                    try:
                        yield Call("abort", "Abort", allocator_pb2.AbortRequest(allocation_ids=[one]))
                    except Exception:
                        pass


def abort_replies(replies: Sequence[Optional[allocator_pb2.AllocateReply]]):
    """Give back allocations of the generation serving now. Those of a
    generation that ended are not aborted: they ended with it, and in the
    new generation their ids may name someone else's allocations."""
    live = [r for r in replies if r is not None]
    if not live:
        return
    try:
        st = yield Call("get pool", "GetPool", allocator_pb2.GetPoolRequest(), repeat=True)
    except Exception:
        return  # their leases take them back
    yield from abort([r.allocation_id for r in live if r.generation == st.generation])


def give_back(extents: Sequence[common_pb2.Extent], allocation_ids: Sequence[int] = ()):
    """Free what a Commit of a generation that ended may have committed
    (its answer was lost with it, or came back ALLOCATOR_RESTARTED): if
    that txg synced, the extents are allocated to nobody else's block and
    would stay so for ever. Each is claimed (the new generation refuses
    anything given out since: another's block, in flight or committed, or
    written last by another allocation) and what was claimed is freed; free
    space claimed is so freed again. `allocation_ids`, parallel to
    `extents`, names the allocation that gave each (empty: unknown, checked
    by identity only)."""
    extents = list(extents)
    ids = list(allocation_ids)
    for i in range(0, len(extents), MAX_IDS):
        part = extents[i : i + MAX_IDS]
        try:
            cl = yield Call(
                "claim", "Claim",
                allocator_pb2.ClaimRequest(
                    extents=part, per_extent=True, allocation_ids=ids[i : i + MAX_IDS]
                ),
                repeat=True,
            )
        except Exception:
            continue  # refused whole (all or nothing): none of it is ours
        # An allocator answering all or nothing sends no results when it
        # claimed everything.
        got = claimed_extents(cl) if len(cl.results) else part
        if got:
            try:
                yield from free(got)
            except Exception:
                pass  # at worst their space stays allocated


def allocate(size: int, copies: int, log: bool, attempts: int, affinity_key: Optional[int] = None,
             lease_ms: int = 0):
    """Allocate one block; a TXG_WAIT (log space comes back at a sync) is
    waited out up to `attempts` times."""
    req = allocator_pb2.AllocateRequest(
        size=size,
        copies=copies,
        lease_ms=lease_ms,
        **{"class": allocator_pb2.ALLOCATION_CLASS_LOG if log else allocator_pb2.ALLOCATION_CLASS_DATA},
    )
    if affinity_key is not None:
        req.affinity_key = affinity_key
    waits = 0
    while True:
        try:
            # No client deadline: a DATA allocation may wait in the throttle,
            # which is the point of it.
            return (yield Call("allocate", "Allocate", req, repeat=True, unbounded=True))
        except Exception as e:
            if getattr(e, "reason", None) == ErrorReason.TXG_WAIT and waits + 1 < attempts:
                waits += 1
                until = int(e.metadata.get("until", "0"))
                st = yield Call("get pool", "GetPool", allocator_pb2.GetPoolRequest(), repeat=True)
                yield from sync_txg(until, st.generation)
                continue
            raise


def write_copies(r: allocator_pb2.AllocateReply, data: bytes, flush: bool):
    """Write every copy (at once) and, with `flush`, flush those agents."""
    tokens = list(r.tokens) or [b""] * len(r.extents)
    # Extents are rounded up to the vdev's ashift: pad.
    writes = [
        _agent_call("write", ep, "Write", agent_pb2.WriteRequest(
            offset=ext.offset, data=data + bytes(ext.size - len(data)), token=tok))
        for ext, ep, tok in zip(r.extents, r.endpoints, tokens)
    ]
    _raise_first((yield Parallel(writes, len(writes))))
    if flush:
        yield from flush_agents(set(r.endpoints))


def flush_agents(endpoints: Iterable[str]):
    eps = sorted(set(endpoints))
    flushes = [_agent_call("flush", ep, "Flush", agent_pb2.FlushRequest()) for ep in eps]
    _raise_first((yield Parallel(flushes, max(1, len(flushes)))))


def _agent_call(what: str, ep: str, method: str, req):
    return (yield Call(what, method, req, agent=ep))


def _raise_first(results: List[Any]) -> None:
    for x in results:
        if isinstance(x, BaseException):
            raise x


# ---- one block ---------------------------------------------------------------


def write_block(data: bytes, copies: int, log: bool, durable: bool, attempts: int,
                affinity_key: Optional[int] = None):
    """Allocate, write each copy, flush those agents, commit (with
    `durable`, once its txg has synced). A failed write gives its
    allocation back and starts again with a new one; so does a lease that
    ended, or a restarted allocator whose claim window is closed."""
    check_size(data)
    last_error: Optional[Exception] = None
    for _ in range(attempts):
        r = yield from allocate(len(data), copies, log, attempts, affinity_key)
        try:
            yield from write_copies(r, data, flush=True)
        except Exception as e:
            # Nothing references the allocation yet: give it back (the
            # lease takes it back if this fails too) and start again.
            last_error = e
            yield from abort_replies([r])
            continue
        block, why = yield from commit_or_claim(r, len(data), durable)
        if block is not None:
            return block
        last_error = why
    assert last_error is not None
    raise last_error


def commit_or_claim(r: allocator_pb2.AllocateReply, length: int, durable: bool):
    """Commit `r`, whose data is written and flushed: (the block, None), or
    (None, why) when it must be written anew. After an allocator restart
    the new generation does not know the allocation (ALLOCATOR_RESTARTED):
    inside its claim window the extents are claimed instead, each answered
    on its own; unless all are ours again, what was claimed is given back."""
    try:
        c = yield Call(
            "commit",
            "Commit",
            allocator_pb2.CommitRequest(
                allocation_ids=[r.allocation_id], wait_synced=durable, generation=r.generation
            ),
            repeat=True,
        )
        return _block(r, length, c.txg, c.generation, c.synced), None
    except Exception as e:
        reason = getattr(e, "reason", None)
        if reason == ErrorReason.LEASE_EXPIRED:
            return None, e
        if reason != ErrorReason.ALLOCATOR_RESTARTED:
            raise
        if not claim_window_open(e):
            # Too late to keep the block (its space may have been written
            # over meanwhile); if the Commit took effect before the
            # generation ended, its extents must not stay allocated.
            yield from give_back(r.extents, [r.allocation_id] * len(r.extents))
            return None, e
        restarted = e
    cl = yield from claim(r.extents, [r.allocation_id] * len(r.extents))
    if cl is None or not all_claimed(cl):
        return None, restarted
    synced = False
    if durable:
        yield from sync_txg(cl.txg, cl.generation)
        synced = True
    return _block(r, length, cl.txg, cl.generation, synced), None


def claim(extents: Sequence[common_pb2.Extent], allocation_ids: Sequence[int] = ()):
    """Claim extents one answer each; None when refused (all or nothing),
    and what was claimed of a partial answer is freed again.
    `allocation_ids`, parallel to `extents`, names the allocation that gave
    each: the allocator then refuses the claim of a writer whose extent was
    given to and written by another (empty: unknown, checked by identity
    only, unsafe when writers share one identity). Blocks are claimed here
    only right after their own allocation's Commit, never once claimed into
    a later generation, so the id is always the one to name (the rule is
    stated with ClaimRequest.allocation_ids in allocator.proto)."""
    try:
        cl = yield Call(
            "claim", "Claim",
            allocator_pb2.ClaimRequest(
                extents=extents, per_extent=True, allocation_ids=list(allocation_ids)
            ),
            repeat=True,
        )
    except Exception as ce:
        # An allocator answering all or nothing refused.
        if getattr(ce, "reason", None) != ErrorReason.CLAIM_CONFLICT:
            raise
        return None
    if not all_claimed(cl):
        got = claimed_extents(cl)
        if got:
            try:
                yield from free(got)
            except Exception:
                pass  # at worst their space stays allocated
    return cl


def _block(r, length: int, txg: int, generation: int, synced: bool) -> Block:
    return Block(
        length=length,
        extents=list(r.extents),
        endpoints=list(r.endpoints),
        txg=txg,
        generation=generation,
        synced=synced,
    )


# ---- batches -----------------------------------------------------------------


class _Placed:
    """A batch's block between Allocate and Commit."""

    def __init__(self):
        self.reply: Optional[allocator_pb2.AllocateReply] = None
        self.written = False


def _put(data: bytes, copies: int, attempts: int, placed: _Placed, affinity_key: Optional[int]):
    """One block of a batch: allocate, write its copies, report it written
    (its throttle reservation ends now). A failed write aborts it."""
    check_size(data)
    r = yield from allocate(len(data), copies, False, attempts, affinity_key)
    placed.reply = r
    try:
        yield from write_copies(r, data, flush=False)
    except Exception:
        placed.reply = None
        yield from abort_replies([r])
        raise
    placed.written = True
    yield Call(
        "written",
        "Written",
        allocator_pb2.WrittenRequest(allocation_ids=[r.allocation_id], generation=r.generation),
        repeat=True,
    )


def write_blocks(blocks: Iterable[bytes], copies: int, durable: bool, attempts: int,
                 in_flight: int = IN_FLIGHT, affinity_key: Optional[int] = None, clock=time.time):
    """Write many blocks and commit them with one Commit (one txg) and,
    with `durable`, one sync: at most `in_flight` blocks are being
    allocated and written at once, each reported written as soon as it is;
    then every agent written is flushed once and all are committed
    together. Leases of blocks written early are renewed while the batch
    runs. On any failure (a write, the commit, or `blocks` itself raising)
    every allocation of the batch is aborted and the error raised: nothing
    of it is committed or left reserved; retry the batch."""
    placed: List[_Placed] = []
    # Only the lengths are kept: a block's data is let go once written.
    lengths: List[int] = []
    source = iter(blocks)
    # The Commit was sent: it may have taken effect.
    committing = False
    try:
        while True:
            chunk = []
            for d in source:
                p = _Placed()
                placed.append(p)
                lengths.append(len(d))
                chunk.append(_put(d, copies, attempts, p, affinity_key))
                if len(chunk) == _LEASE_CHECK:
                    break
            if not chunk:
                break
            _raise_first((yield Parallel(chunk, max(1, in_flight), stop_on_error=True)))
            yield from _renew_if_due([p.reply for p in placed], clock)
        if not placed:
            return []
        replies = [p.reply for p in placed]
        if len({r.generation for r in replies}) != 1:
            raise RuntimeError("the allocator restarted during the batch: write it again")
        yield from flush_agents(ep for r in replies for ep in r.endpoints)
        committing = True
        c = yield Call(
            "commit",
            "Commit",
            allocator_pb2.CommitRequest(
                allocation_ids=[r.allocation_id for r in replies],
                wait_synced=durable,
                generation=replies[0].generation,
            ),
            repeat=True,
        )
    except BaseException as e:
        # Everything placed and not committed goes back now, not at its
        # lease's end (a Commit is all or nothing: a failed one committed
        # nothing), except in a generation that ended before the Commit's
        # answer: there it may have committed, and its txg synced.
        replies = [p.reply for p in placed if p.reply is not None]
        if committing and getattr(e, "reason", None) == ErrorReason.ALLOCATOR_RESTARTED:
            yield from give_back(
                [x for r in replies for x in r.extents],
                [r.allocation_id for r in replies for _ in r.extents],
            )
        else:
            yield from abort_replies(replies)
        raise
    return [_block(r, n, c.txg, c.generation, c.synced) for n, r in zip(lengths, replies)]


def _renew_if_due(replies: Sequence[Optional[allocator_pb2.AllocateReply]], clock):
    """Renew the leases of a batch's blocks when the earliest is within
    half its length of ending (a long batch outlives its first leases)."""
    live = [r for r in replies if r is not None]
    if not live:
        return
    now_ms = int(clock() * 1000)
    earliest = min(r.lease_deadline_ms for r in live)
    if earliest - now_ms > 15_000:
        return
    ids = [r.allocation_id for r in live]
    for i in range(0, len(ids), MAX_IDS):
        rr = yield Call(
            "renew lease",
            "RenewLease",
            allocator_pb2.RenewLeaseRequest(allocation_ids=ids[i : i + MAX_IDS]),
            repeat=True,
        )
        for r in live[i : i + MAX_IDS]:
            r.lease_deadline_ms = rr.lease_deadline_ms


def read_block(block: Block, copy: Optional[int] = None):
    """Read a block back: copy `copy`, or the first copy that answers."""
    order = [copy] if copy is not None else list(range(len(block.extents)))
    # Agents with the pool's token key read only what a read token
    # covers; the allocator issues them to the block's owner.
    reply = yield Call(
        "read tokens",
        "ReadTokens",
        allocator_pb2.ReadTokensRequest(extents=[block.extents[i] for i in order]),
        repeat=True,
    )
    tokens = reply.tokens
    endpoints = None
    last: Optional[Exception] = None
    for n, i in enumerate(order):
        ext, ep = block.extents[i], block.endpoints[i]
        token = tokens[n] if n < len(tokens) else b""
        # A block the allocator moved keeping its address: the token is for
        # its new extent, on another vdev's agent.
        if n < len(reply.locations) and reply.locations[n] != ext:
            ext = reply.locations[n]
            if endpoints is None:
                pool = yield Call("get pool", "GetPool", allocator_pb2.GetPoolRequest(), repeat=True)
                endpoints = {v.vdev: v.endpoint for v in pool.vdevs}
            ep = endpoints.get(ext.vdev, ep)
        try:
            r = yield Call(
                "read", "Read", agent_pb2.ReadRequest(offset=ext.offset, size=ext.size, token=token), agent=ep
            )
            return r.data[: block.length]
        except Exception as e:
            last = e
    assert last is not None
    raise last
