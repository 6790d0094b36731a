"""A writer for the HA tests: the Python client (`sync`: `Pool` on threads,
`async`: `AsyncPool` on tasks) writes durable blocks through the allocators
given until a stop file appears (each worker at most one block per
`PACE` seconds and the writer at most `MAX_BLOCKS`, so a fast machine cannot
fill the test's small pool), then reads every acknowledged block back
and prints one JSON line: the blocks' extents, how many read back wrong,
the writes that failed, the claims made and refused, and the longest wait
for an acknowledgement.

usage: outage_writer.py sync|async ALLOCATORS STARTED_FILE STOP_FILE
"""

import asyncio
import itertools
import json
import os
import sys
import threading
import time

from aliquot_client import AsyncPool, Pool, protocol

mode, allocators, started_file, stop_file = sys.argv[1:5]
WORKERS = 8
SIZE = 256 << 10
# 8 workers at 4 blocks/s each: 8 MiB/s per writer. The two writers of a
# test share a 480 MiB pool whose slop leaves 352 MiB; MAX_BLOCKS keeps
# both under 280 MiB whatever the machine's speed, and at this pace is
# reached only after ~17 s of writing, well after the outage begins.
PACE = 0.25
MAX_BLOCKS = 560

counts = {"claims": 0, "refused": 0, "window_closed": 0}
lock = threading.Lock()

# Count what the protocol does after an allocator restart (wrapping its
# own functions, which still do the work).
_claim = protocol.claim
_window_open = protocol.claim_window_open


def counting_claim(extents, allocation_ids=()):
    cl = yield from _claim(extents, allocation_ids)
    with lock:
        counts["claims"] += 1
        if cl is None or not protocol.all_claimed(cl):
            counts["refused"] += 1
    return cl


def counting_window_open(err):
    open_ = _window_open(err)
    if not open_:
        with lock:
            counts["window_closed"] += 1
    return open_


protocol.claim = counting_claim
protocol.claim_window_open = counting_window_open


def data(i):
    # Every block its own bytes: one written over another reads back wrong.
    return i.to_bytes(8, "little") * (SIZE // 8)


t0 = time.monotonic()
acked = []  # (i, block)
failures = []
last_ack = [t0]
longest_gap = [0.0]
ids = itertools.count()


def ack(i, b):
    with lock:
        now = time.monotonic()
        longest_gap[0] = max(longest_gap[0], now - last_ack[0])
        last_ack[0] = now
        acked.append((i, b))
        if len(acked) == 1:
            open(started_file, "w").close()


def run_sync():
    pool = Pool(allocators)

    def worker():
        while not os.path.exists(stop_file):
            i = next(ids)
            if i >= MAX_BLOCKS:
                return
            began = time.monotonic()
            try:
                b = pool.write_block(data(i))
            except Exception as e:
                with lock:
                    failures.append(f"block {i}: {e!r}")
                return
            ack(i, b)
            time.sleep(max(0.0, began + PACE - time.monotonic()))

    threads = [threading.Thread(target=worker) for _ in range(WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wrong = sum(1 for i, b in acked if pool.read_block(b) != data(i))
    pool.close()
    return wrong


async def run_async():
    async with AsyncPool(allocators) as pool:

        async def worker():
            while not os.path.exists(stop_file):
                i = next(ids)
                if i >= MAX_BLOCKS:
                    return
                began = time.monotonic()
                try:
                    b = await pool.write_block(data(i))
                except Exception as e:
                    failures.append(f"block {i}: {e!r}")
                    return
                ack(i, b)
                await asyncio.sleep(max(0.0, began + PACE - time.monotonic()))

        await asyncio.gather(*(worker() for _ in range(WORKERS)))
        wrong = 0
        for i, b in acked:
            if await pool.read_block(b) != data(i):
                wrong += 1
        return wrong


wrong = run_sync() if mode == "sync" else asyncio.run(run_async())
print(
    json.dumps(
        {
            "acked": len(acked),
            "wrong": wrong,
            "failures": failures,
            "extents": [[e.vdev, e.offset, e.size] for _, b in acked for e in b.extents],
            "synced": all(b.synced for _, b in acked),
            "longest_wait_s": round(longest_gap[0], 2),
            "run_s": round(time.monotonic() - t0, 2),
            **counts,
        }
    )
)
