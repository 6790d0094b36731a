"""`Pool`: one allocator, the agents it names, and the write protocol.

Retries follow the API's contract (allocator.proto): Commit, Free, Claim and
SyncTxg are safe to repeat; a failed data write gives its allocation back
(Abort) and starts again with a new one, since nothing references it yet; a
lease that ended (LEASE_EXPIRED) means the same; an allocator that restarted
before the block's txg synced (ALLOCATOR_RESTARTED) gets the block's extents
re-asserted with Claim while its claim window is open, each extent answered
on its own (the data is on the agents already); after the window, or when
an extent is refused, the block is written again, and what the first
Commit may have made durable before the generation ended is given back
(claimed, then freed). Allocations of a generation that ended are never
aborted by id: in the new one their ids may name someone else's.
"""

from __future__ import annotations

import dataclasses
import socket
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Dict, Iterable, List, Optional, Sequence

import grpc
from grpc_status import rpc_status
from google.rpc import error_details_pb2

from aliquot.v1 import agent_pb2_grpc, allocator_pb2, allocator_pb2_grpc

from . import protocol
from .protocol import (  # noqa: F401 (the package's names since before protocol.py)
    Block,
    ErrorReason,
    all_claimed,
    claim_window_open,
    claimed_extents,
)

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


def _transient(err: grpc.RpcError) -> bool:
    """`err` is worth repeating a safe call for: UNAVAILABLE, or the call's
    own deadline, which the server may answer first, as CANCELLED "Timeout
    expired" (tonic enforces the grpc-timeout the client sent), before the
    client's DEADLINE_EXCEEDED."""
    code = err.code()
    return code in _TRANSIENT or (
        code == grpc.StatusCode.CANCELLED and err.details() == "Timeout expired"
    )


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


def _target(url: str) -> str:
    """`https://host:port` -> `host:port` (what grpc channels take)."""
    return url.split("://", 1)[-1].rstrip("/")


def allocator_targets(allocator) -> List[str]:
    """The allocators' host:port from one address, several separated by
    commas, or a list."""
    urls = allocator.split(",") if isinstance(allocator, str) else list(allocator)
    return [_target(u.strip()) for u in urls if u.strip()]


def follow(leader: protocol.Leader, called: str, err: grpc.RpcError) -> None:
    """Move `leader` after the call to allocator `called` failed with `err`
    (a blocking or an asyncio call's error)."""
    info = error_info(err)
    leader.follow(
        called,
        _transient(err),
        info.reason if info is not None else None,
        _target(info.metadata.get("leader", "")) if info is not None else "",
    )


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
        self._leader = protocol.Leader(allocator_targets(allocator))
        self._allocators = {}
        for t in self._leader.targets:
            ch = self._channel(t, "allocator.aliquot")
            self._allocators[t] = (ch, allocator_pb2_grpc.AllocatorStub(ch))
        self._agents: Dict[str, agent_pb2_grpc.VdevAgentStub] = {}
        self._channels = [ch for ch, _ in self._allocators.values()]

    @property
    def allocator(self) -> allocator_pb2_grpc.AllocatorStub:
        """The stub of the allocator believed to lead."""
        return self._allocators[self._leader.target][1]

    @property
    def allocator_channel(self) -> grpc.Channel:
        """The channel to the allocator believed to lead (for reflection or
        stubs of your own)."""
        return self._allocators[self._leader.target][0]

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
            target=target or self._leader.target,
            tls=self.tls is not None,
        )

    # ---- carrying out protocol.py's operations -------------------------------

    def _run(self, op):
        """Carry out a protocol operation (a generator of protocol.py) with
        blocking calls; its result."""
        done, x = protocol.advance(op)
        while not done:
            try:
                value, error = self._do(x), None
            except Exception as e:
                value, error = None, e
            done, x = protocol.advance(op, value, error)
        return x

    def _do(self, step):
        if isinstance(step, protocol.Call):
            return self._call(step)
        if isinstance(step, protocol.Parallel):
            return self._parallel(step)
        if isinstance(step, protocol.Sleep):
            time.sleep(step.seconds)
            return None
        raise TypeError(f"unknown protocol step {step!r}")

    def _call(self, c: protocol.Call):
        timeout = None if c.unbounded else self.timeout
        if c.agent is not None:
            try:
                return getattr(self.agent(c.agent), c.method)(c.request, timeout=timeout)
            except grpc.RpcError as e:
                raise self._error(c.what, e, target=_target(c.agent)) from e
        deadline = time.monotonic() + self.allocator_wait
        attempt = 0
        while True:
            target = self._leader.target
            try:
                return getattr(self._allocators[target][1], c.method)(c.request, timeout=timeout)
            except grpc.RpcError as e:
                follow(self._leader, target, e)
                if c.repeat and _transient(e) and time.monotonic() < deadline:
                    # Away, restarting or taken over: wait (allocator_wait).
                    time.sleep(min(0.1 * 2**attempt, 1.0))
                    attempt += 1
                    continue
                raise self._error(c.what, e) from e

    def _parallel(self, p: protocol.Parallel) -> list:
        s = protocol.Schedule(p)

        def inline(op) -> Future:
            # One at a time: no thread to hand it to.
            f: Future = Future()
            try:
                f.set_result(self._run(op))
            except Exception as e:
                f.set_exception(e)
            return f

        if p.limit <= 1:
            while s.start(inline):
                for f in list(s.running):
                    s.finished(f)
            return s.results()
        with ThreadPoolExecutor(max_workers=p.limit) as ex:
            while s.start(lambda op: ex.submit(self._run, op)):
                done, _ = wait(s.running, return_when=FIRST_COMPLETED)
                for f in done:
                    s.finished(f)
        return s.results()

    # ---- the API ---------------------------------------------------------------

    def _repeat(self, what: str, method: str, req):
        """Call `method` of the allocator believed to lead, repeated on a
        transient failure with backoff (a retry after NOT_LEADER goes to
        the leader)."""
        return self._call(protocol.Call(what, method, req, repeat=True))

    def sync_txg(self, txg: int = 0, generation: int = 0) -> int:
        """Wait until `txg` (0: the open one) has synced; the synced txg.

        A txg other than 0 needs the allocator generation it was seen in
        (the allocator refuses it without one: after a restart the same
        number may name another generation's txg). A `Txg` returned by
        `free` carries its own."""
        if not generation:
            generation = getattr(txg, "generation", 0)
        return self._run(protocol.sync_txg(txg, generation))

    def free(self, blocks: Sequence[Block]) -> "Txg":
        """Free blocks' extents; the txg the frees belong to (an int that
        also carries the allocator generation it belongs to)."""
        return Txg(*self._run(protocol.free([e for b in blocks for e in b.extents])))

    def get_pool(self) -> allocator_pb2.PoolStatus:
        return self._repeat("get pool", "GetPool", allocator_pb2.GetPoolRequest())

    def write_block(
        self,
        data: bytes,
        copies: int = 1,
        log: bool = False,
        durable: bool = True,
        affinity_key: Optional[int] = None,
    ) -> Block:
        """Write one block (1 B ..= 16 MiB) as `copies` copies on distinct
        vdevs and commit it; with `durable`, return once its txg has synced.
        `affinity_key`: blocks that give one key keep one of the allocator's
        allocators (its rotor and active metaslabs), as OpenZFS keeps an
        object's blocks together; unset, the allocators take turns.
        """
        return self._run(protocol.write_block(data, copies, log, durable, self.attempts, affinity_key))

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
        self,
        blocks: Iterable[bytes],
        copies: int = 1,
        durable: bool = True,
        in_flight: int = protocol.IN_FLIGHT,
        affinity_key: Optional[int] = None,
    ) -> List[Block]:
        """Write many blocks with one Commit (one txg) and, with `durable`,
        one sync. At most `in_flight` blocks are allocated and written at
        once, each reported written as soon as its copies are on their
        agents (its throttle reservation ends then: a batch larger than the
        throttle's limit never waits on itself); then every agent written
        is flushed once and all are committed together. A failure (a write,
        the commit, or `blocks` raising) aborts every allocation of the
        batch and raises: nothing of it is committed or stays reserved;
        retry the batch."""
        return self._run(
            protocol.write_blocks(blocks, copies, durable, self.attempts, in_flight, affinity_key)
        )

    def read_block(self, block: Block, copy: Optional[int] = None) -> bytes:
        """Read a block back: copy `copy`, or the first copy that answers."""
        return self._run(protocol.read_block(block, copy))
