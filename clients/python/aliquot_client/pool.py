"""`Pool`: one allocator, the agents it names, and the write protocol.

Retries follow the API's contract (allocator.proto): Commit, Free, Claim and
SyncTxg are safe to repeat; a failed data write gives its allocation back
(Abort) and starts again with a new one, since nothing references it yet; a
lease that ended (LEASE_EXPIRED) means the same; an allocator that restarted
before the block's txg synced (ALLOCATOR_RESTARTED) gets the block's extents
re-asserted with Claim while its claim window is open, each extent answered
on its own (the data is on the agents already); after the window, or when
an extent is refused, the block is written again.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import time
from typing import Dict, List, Optional, Sequence

import grpc
from grpc_status import rpc_status
from google.rpc import error_details_pb2

from aliquot.v1 import agent_pb2, agent_pb2_grpc, allocator_pb2, allocator_pb2_grpc, common_pb2

# A 16 MiB block plus framing, as the servers accept.
MAX_MESSAGE = 17 * 1024 * 1024
_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    # A stopped allocator (SIGSTOP, a partition) keeps the TCP session open:
    # unanswered HTTP/2 pings end it within 3 s, so calls fail over instead of
    # hanging.
    ("grpc.keepalive_time_ms", 1000),
    ("grpc.keepalive_timeout_ms", 2000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
# Codes on which a call that is safe to repeat is repeated.
_TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class ErrorReason:
    """The `reason` names of the google.rpc.ErrorInfo Aliquot errors carry."""

    LEASE_EXPIRED = "LEASE_EXPIRED"
    ALLOCATOR_RESTARTED = "ALLOCATOR_RESTARTED"
    NO_SPACE = "NO_SPACE"
    FRAGMENTED = "FRAGMENTED"
    VDEVS_OFFLINE = "VDEVS_OFFLINE"
    CLAIM_CONFLICT = "CLAIM_CONFLICT"
    UNKNOWN_ALLOCATION = "UNKNOWN_ALLOCATION"
    TXG_WAIT = "TXG_WAIT"
    SHUTTING_DOWN = "SHUTTING_DOWN"
    NOT_OWNER = "NOT_OWNER"
    NOT_LEADER = "NOT_LEADER"


def error_info(err: grpc.RpcError) -> Optional[error_details_pb2.ErrorInfo]:
    """The ErrorInfo in an error's google.rpc.Status details, if any."""
    try:
        status = rpc_status.from_call(err)
    except Exception:  # a malformed trailer is no reason to fail the caller
        return None
    if status is None:
        return None
    for d in status.details:
        if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            d.Unpack(info)
            return info
    return None


def error_reason(err: grpc.RpcError) -> Optional[str]:
    """The machine-readable reason of an Aliquot error (see `ErrorReason`)."""
    info = error_info(err)
    return info.reason if info is not None else None


def claim_window_open(err: "AliquotError") -> bool:
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


def claimed_extents(reply: allocator_pb2.ClaimReply) -> List[allocator_pb2.Extent]:
    return [x.extent for x in reply.results if x.claimed]


def _speaks_tls(target: str) -> bool:
    """Whether the server at `target` (host:port) answers an HTTP/2 preface
    with a TLS alert record, as a TLS server does."""
    host, _, port = target.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=2) as s:
            s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))
            return s.recv(2) == b"\x15\x03"
    except (OSError, ValueError):
        return False


def _advice(err: grpc.RpcError, target: Optional[str], tls: Optional[bool]) -> str:
    """One sentence on the likely cause of a connection failure and what
    to pass instead; empty when the failure is not one of these."""
    if err.code() != grpc.StatusCode.UNAVAILABLE:
        return ""
    details = err.details() or ""
    if "TSI_DATA_CORRUPTED" in details or "CERTIFICATE_REQUIRED" in details:
        return (
            "the server refused the TLS handshake: it wants a client certificate issued by the "
            "pool CA (tls=Tls.in_dir('aliquot-data/certs'), or `aliquotctl certs issue --role "
            "client NAME`)"
        )
    if tls is False and target and _speaks_tls(target):
        return (
            f"{target} speaks TLS and this client plaintext (tls=None): give the pool's "
            "certificates, tls=Tls.in_dir('aliquot-data/certs')"
        )
    if tls and ("WRONG_VERSION_NUMBER" in details or "Handshake failed" in details):
        return (
            "the server does not speak TLS (a pool started with --insecure): tls=None"
        )
    return ""


class AliquotError(Exception):
    """A call failed for good (after any retries), with the server's reason
    and, for a connection that failed, `advice`: the likely cause and what
    to pass instead (a TLS/plaintext mismatch, a missing certificate)."""

    def __init__(
        self,
        what: str,
        err: grpc.RpcError,
        target: Optional[str] = None,
        tls: Optional[bool] = None,
    ):
        self.code = err.code()
        self.reason = error_reason(err)
        info = error_info(err)
        # The ErrorInfo's values (e.g. claim_window_remaining_ms).
        self.metadata: Dict[str, str] = dict(info.metadata) if info is not None else {}
        self.details = err.details()
        self.advice = _advice(err, target, tls)
        if self.advice:
            super().__init__(f"{what}: {self.advice} ({self.code.name}: {self.details})")
        else:
            super().__init__(f"{what}: {self.details} ({self.code.name}, reason {self.reason})")


class Txg(int):
    """A txg number with the allocator generation it was seen in."""

    generation: int

    def __new__(cls, txg: int, generation: int) -> "Txg":
        t = super().__new__(cls, txg)
        t.generation = generation
        return t


@dataclasses.dataclass(frozen=True)
class Tls:
    """The pool CA and this client's certificate (PEM files), as
    `aliquotctl up` writes them to aliquot-data/certs or `aliquotctl certs
    issue --role client NAME` issues them."""

    ca: str
    cert: str
    key: str

    @staticmethod
    def in_dir(certs_dir: str, role: str = "admin", name: str = "operator") -> "Tls":
        d = certs_dir.rstrip("/") + "/"
        return Tls(d + "ca.pem", d + f"{role}-{name}.pem", d + f"{role}-{name}.key")

    def credentials(self) -> grpc.ChannelCredentials:
        def read(p):
            with open(p, "rb") as f:
                return f.read()

        return grpc.ssl_channel_credentials(
            root_certificates=read(self.ca),
            private_key=read(self.key),
            certificate_chain=read(self.cert),
        )


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


def _target(url: str) -> str:
    """`https://host:port` -> `host:port` (what grpc channels take)."""
    return url.split("://", 1)[-1].rstrip("/")


class Pool:
    """A client of one Aliquot pool.

    >>> pool = Pool("127.0.0.1:7000", tls=Tls.in_dir("aliquot-data/certs"))
    >>> b = pool.write_block(b"hello" * 1000, copies=2)
    >>> assert pool.read_block(b) == b"hello" * 1000
    """

    def __init__(
        self,
        allocator,
        tls: Optional[Tls] = None,
        timeout: float = 10.0,
        attempts: int = 5,
        allocator_wait: float = 60.0,
    ):
        """`allocator_wait`: how long (seconds) a call keeps retrying an
        allocator that is unreachable, restarting or being taken over (as
        `aliquotctl write --allocator-wait`).

        `allocator`: its address, or several (a list, or one string
        separated by commas) of allocators sharing a PostgreSQL store: calls
        go to the one that leads, following NOT_LEADER after a takeover."""
        self.tls = tls
        self.timeout = timeout
        self.attempts = attempts
        self.allocator_wait = allocator_wait
        self._creds = tls.credentials() if tls is not None else None
        urls = allocator.split(",") if isinstance(allocator, str) else list(allocator)
        targets = [_target(u.strip()) for u in urls if u.strip()]
        if not targets:
            raise ValueError("no allocator address given")
        self._allocators = []
        for t in targets:
            ch = self._channel(t, "allocator.aliquot")
            self._allocators.append((t, ch, allocator_pb2_grpc.AllocatorStub(ch)))
        self._leader = 0
        self._agents: Dict[str, agent_pb2_grpc.VdevAgentStub] = {}
        self._channels = [ch for _, ch, _ in self._allocators]

    @property
    def allocator(self) -> allocator_pb2_grpc.AllocatorStub:
        """The stub of the allocator believed to lead."""
        return self._allocators[self._leader][2]

    @property
    def allocator_channel(self) -> grpc.Channel:
        """The channel to the allocator believed to lead (for reflection or
        stubs of your own)."""
        return self._allocators[self._leader][1]

    def _follow(self, err: grpc.RpcError) -> None:
        """After a failed call: move to the leader a NOT_LEADER names, or
        (another allocator unreachable or standing by) to the next one."""
        if len(self._allocators) < 2:
            return
        info = error_info(err)
        if info is not None and info.reason == ErrorReason.NOT_LEADER:
            leader = _target(info.metadata.get("leader", ""))
            for i, (t, _, _) in enumerate(self._allocators):
                if leader and t == leader:
                    self._leader = i
                    return
        if info is None or info.reason == ErrorReason.NOT_LEADER:
            if err.code() in _TRANSIENT:
                self._leader = (self._leader + 1) % len(self._allocators)

    def _channel(self, target: str, server_name: str) -> grpc.Channel:
        if self._creds is None:
            return grpc.insecure_channel(target, options=_OPTIONS)
        # Certificates name the role (allocator.aliquot, agent.aliquot), not
        # the host, so one CA serves any address.
        opts = _OPTIONS + [("grpc.ssl_target_name_override", server_name)]
        return grpc.secure_channel(target, self._creds, options=opts)

    def agent(self, endpoint: str) -> agent_pb2_grpc.VdevAgentStub:
        t = _target(endpoint)
        if t not in self._agents:
            ch = self._channel(t, "agent.aliquot")
            self._channels.append(ch)
            self._agents[t] = agent_pb2_grpc.VdevAgentStub(ch)
        return self._agents[t]

    def close(self) -> None:
        for ch in self._channels:
            ch.close()

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _error(self, what: str, err: grpc.RpcError, target: Optional[str] = None) -> AliquotError:
        return AliquotError(
            what,
            err,
            target=target or self._allocators[self._leader][0],
            tls=self.tls is not None,
        )

    # ---- calls safe to repeat ------------------------------------------------

    def _repeat(self, what: str, call, *args, **kwargs):
        """`call` again on a transient failure, with backoff. A method name
        (str) is looked up on the allocator believed to lead at each try,
        so a retry after NOT_LEADER goes to the leader."""
        deadline = time.monotonic() + self.allocator_wait
        attempt = 0
        while True:
            try:
                fn = getattr(self.allocator, call) if isinstance(call, str) else call
                return fn(*args, timeout=self.timeout, **kwargs)
            except grpc.RpcError as e:
                self._follow(e)
                if e.code() in _TRANSIENT and time.monotonic() < deadline:
                    time.sleep(min(0.1 * 2**attempt, 1.0))
                    attempt += 1
                    continue
                raise self._error(what, e) from e

    def sync_txg(self, txg: int = 0, generation: int = 0) -> int:
        """Wait until `txg` (0: the open one) has synced; the synced txg.

        A txg other than 0 needs the allocator generation it was seen in
        (the allocator refuses it without one: after a restart the same
        number may name another generation's txg). A `Txg` returned by
        `free` carries its own."""
        if not generation:
            generation = getattr(txg, "generation", 0)
        r = self._repeat(
            "sync txg",
            "SyncTxg",
            allocator_pb2.SyncTxgRequest(txg=int(txg), generation=generation),
        )
        return r.synced_txg

    def free(self, blocks: Sequence[Block]) -> "Txg":
        """Free blocks' extents; the txg the frees belong to (an int that
        also carries the allocator generation it belongs to)."""
        extents = [e for b in blocks for e in b.extents]
        # The allocator takes at most 4096 extents per Free.
        txg, generation = 0, 0
        for i in range(0, len(extents), 4096):
            r = self._repeat(
                "free", "Free", allocator_pb2.FreeRequest(extents=extents[i : i + 4096])
            )
            txg, generation = max(txg, r.txg), r.generation
        return Txg(txg, generation)

    def get_pool(self) -> allocator_pb2.PoolStatus:
        return self._repeat("get pool", "GetPool", allocator_pb2.GetPoolRequest())

    # ---- the write protocol --------------------------------------------------

    def _allocate(self, size: int, copies: int, log: bool) -> allocator_pb2.AllocateReply:
        req = allocator_pb2.AllocateRequest(
            size=size,
            copies=copies,
            **{"class": allocator_pb2.ALLOCATION_CLASS_LOG if log else allocator_pb2.ALLOCATION_CLASS_DATA},
        )
        deadline = time.monotonic() + self.allocator_wait
        waits, away = 0, 0
        while True:
            try:
                # No client deadline: a DATA allocation may wait in the
                # throttle, which is the point of it.
                return self.allocator.Allocate(req)
            except grpc.RpcError as e:
                self._follow(e)
                info = error_info(e)
                reason = info.reason if info else None
                if reason == ErrorReason.TXG_WAIT and waits + 1 < self.attempts:
                    # Log space comes back when txg `until` syncs.
                    waits += 1
                    until = int(info.metadata.get("until", "0"))
                    self.sync_txg(until, self.get_pool().generation)
                    continue
                if e.code() in _TRANSIENT and time.monotonic() < deadline:
                    # Away, restarting or taken over: wait (allocator_wait).
                    time.sleep(min(0.1 * 2**away, 1.0))
                    away += 1
                    continue
                raise self._error("allocate", e) from e
        raise AssertionError("unreachable")

    def write_block(
        self, data: bytes, copies: int = 1, log: bool = False, durable: bool = True
    ) -> Block:
        """Write one block (1 B ..= 16 MiB) as `copies` copies on distinct
        vdevs and commit it; with `durable`, return once its txg has synced.
        """
        if not 0 < len(data) <= 16 << 20:
            raise ValueError(f"a block is 1 B ..= 16 MiB, not {len(data)} bytes")
        last_error: Optional[Exception] = None
        for _ in range(self.attempts):
            r = self._allocate(len(data), copies, log)
            try:
                for ext, ep, tok in zip(r.extents, r.endpoints, r.tokens or [b""] * len(r.extents)):
                    # Extents are rounded up to the vdev's ashift: pad.
                    payload = data + bytes(ext.size - len(data))
                    self.agent(ep).Write(
                        agent_pb2.WriteRequest(offset=ext.offset, data=payload, token=tok),
                        timeout=self.timeout,
                    )
                for ep in sorted(set(r.endpoints)):
                    self.agent(ep).Flush(agent_pb2.FlushRequest(), timeout=self.timeout)
            except grpc.RpcError as e:
                # Nothing references the allocation yet: give it back (the
                # lease takes it back if this fails too) and start again.
                last_error = AliquotError("write", e)
                try:
                    self.allocator.Abort(
                        allocator_pb2.AbortRequest(allocation_ids=[r.allocation_id]),
                        timeout=self.timeout,
                    )
                except grpc.RpcError:
                    pass
                continue
            try:
                c = self._repeat(
                    "commit",
                    "Commit",
                    allocator_pb2.CommitRequest(
                        allocation_ids=[r.allocation_id],
                        wait_synced=durable,
                        generation=r.generation,
                    ),
                )
                txg, generation, synced = c.txg, c.generation, c.synced
            except AliquotError as e:
                if e.reason == ErrorReason.LEASE_EXPIRED:
                    last_error = e
                    continue
                if e.reason != ErrorReason.ALLOCATOR_RESTARTED:
                    raise
                # The allocator changed generation before the commit's txg
                # synced (or before the commit). Only inside the new
                # generation's claim window can the extents be re-asserted:
                # after it their space may hold another block. Each extent
                # is answered on its own; unless all are ours again, give
                # back what was claimed and write the block anew (the data
                # is in hand).
                if claim_window_open(e):
                    try:
                        cl = self._repeat(
                            "claim",
                            "Claim",
                            allocator_pb2.ClaimRequest(extents=r.extents, per_extent=True),
                        )
                    except AliquotError as ce:
                        # An allocator answering all or nothing refused.
                        if ce.reason != ErrorReason.CLAIM_CONFLICT:
                            raise
                        last_error = ce
                        continue
                    if all_claimed(cl):
                        txg, generation, synced = cl.txg, cl.generation, False
                        if durable:
                            self.sync_txg(txg, generation)
                            synced = True
                    else:
                        claimed = claimed_extents(cl)
                        if claimed:
                            try:
                                self._repeat(
                                    "free", "Free", allocator_pb2.FreeRequest(extents=claimed)
                                )
                            except AliquotError:
                                pass  # at worst their space stays allocated
                        last_error = e
                        continue
                else:
                    last_error = e
                    continue
            return Block(
                length=len(data),
                extents=list(r.extents),
                endpoints=list(r.endpoints),
                txg=txg,
                generation=generation,
                synced=synced,
            )
        raise RuntimeError(f"write_block: gave up after {self.attempts} attempts: {last_error}")

    def renew_lease(self, allocation_ids: Sequence[int], lease_ms: int = 0) -> allocator_pb2.RenewLeaseReply:
        """Extend the lease of allocations still in flight (a long write):
        `lease_ms` from now (0: the allocator's default, at most its
        --max-lease). The reply carries the new deadline and, when the pool
        signs writes, fresh write tokens (ids in order, extents in order)."""
        return self._repeat(
            "renew lease",
            "RenewLease",
            allocator_pb2.RenewLeaseRequest(allocation_ids=list(allocation_ids), lease_ms=lease_ms),
        )

    def write_blocks(
        self, blocks: Sequence[bytes], copies: int = 1, durable: bool = True
    ) -> List[Block]:
        """Write many blocks with one Commit (one txg) and, with `durable`,
        one sync: each is allocated and written to its agents, every agent
        written is flushed once, then all are committed together. A failed
        write aborts every allocation of the batch and raises (nothing of
        it is committed); retry the batch."""
        if not blocks:
            return []
        for d in blocks:
            if not 0 < len(d) <= 16 << 20:
                raise ValueError(f"a block is 1 B ..= 16 MiB, not {len(d)} bytes")
        replies = []
        try:
            for d in blocks:
                r = self._allocate(len(d), copies, False)
                replies.append(r)
                for ext, ep, tok in zip(r.extents, r.endpoints, r.tokens or [b""] * len(r.extents)):
                    self.agent(ep).Write(
                        agent_pb2.WriteRequest(offset=ext.offset, data=d + bytes(ext.size - len(d)), token=tok),
                        timeout=self.timeout,
                    )
            for ep in sorted({ep for r in replies for ep in r.endpoints}):
                self.agent(ep).Flush(agent_pb2.FlushRequest(), timeout=self.timeout)
        except grpc.RpcError as e:
            if replies:
                try:
                    self.allocator.Abort(
                        allocator_pb2.AbortRequest(allocation_ids=[r.allocation_id for r in replies]),
                        timeout=self.timeout,
                    )
                except grpc.RpcError:
                    pass
            raise AliquotError("write batch", e) from e
        generations = {r.generation for r in replies}
        if len(generations) != 1:
            raise RuntimeError("the allocator restarted during the batch: write it again")
        c = self._repeat(
            "commit",
            "Commit",
            allocator_pb2.CommitRequest(
                allocation_ids=[r.allocation_id for r in replies],
                wait_synced=durable,
                generation=replies[0].generation,
            ),
        )
        return [
            Block(
                length=len(d),
                extents=list(r.extents),
                endpoints=list(r.endpoints),
                txg=c.txg,
                generation=c.generation,
                synced=c.synced,
            )
            for d, r in zip(blocks, replies)
        ]

    def read_block(self, block: Block, copy: Optional[int] = None) -> bytes:
        """Read a block back: copy `copy`, or the first copy that answers."""
        order = [copy] if copy is not None else list(range(len(block.extents)))
        # Agents with the pool's token key read only what a read token
        # covers; the allocator issues them to the block's owner.
        tokens = self._repeat(
            "read tokens",
            "ReadTokens",
            allocator_pb2.ReadTokensRequest(extents=[block.extents[i] for i in order]),
        ).tokens
        last: Optional[grpc.RpcError] = None
        for n, i in enumerate(order):
            ext, ep = block.extents[i], block.endpoints[i]
            token = tokens[n] if n < len(tokens) else b""
            try:
                r = self.agent(ep).Read(
                    agent_pb2.ReadRequest(offset=ext.offset, size=ext.size, token=token),
                    timeout=self.timeout,
                )
                return r.data[: block.length]
            except grpc.RpcError as e:
                last = e
        raise AliquotError("read", last)
