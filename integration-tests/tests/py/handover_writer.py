"""A writer for the handover leak test: the Python client (`Pool`) writes
one block (`block`: write_block) or a batch of 8 (`batch`: write_blocks)
whose first Commit takes effect and synced, but whose answer is lost with
the allocator: the script signals COMMITTED_FILE, waits for the test to
restart the allocator (a new generation, its claim window closed) and to
signal RESTARTED_FILE, then repeats the call, as the client does after a
broken connection. A batch refused so is written again. Prints one JSON
line: the acknowledged blocks' extents and how many read back wrong.

usage: handover_writer.py block|batch ALLOCATOR COMMITTED_FILE RESTARTED_FILE
"""

import json
import os
import sys
import time

from aliquot_client import Pool

mode, allocator, committed_file, restarted_file = sys.argv[1:5]
SIZE = 64 << 10

pool = Pool(allocator, allocator_wait=60.0)
real_call = pool._call
first = {"done": False}


def call(c):
    r = real_call(c)
    if c.method == "Commit" and not first["done"]:
        first["done"] = True
        open(committed_file, "w").close()
        while not os.path.exists(restarted_file):
            time.sleep(0.05)
        return real_call(c)
    return r


pool._call = call


def data(i):
    return i.to_bytes(8, "little") * (SIZE // 8)


if mode == "block":
    blocks = [(0, pool.write_block(data(0)))]
else:
    payload = [data(i) for i in range(8)]
    try:
        got = pool.write_blocks(payload)
    except Exception as e:
        print(f"batch refused, written again: {e}", file=sys.stderr)
        got = pool.write_blocks(payload)
    blocks = list(enumerate(got))
wrong = sum(1 for i, b in blocks if pool.read_block(b) != data(i))
pool.close()
print(
    json.dumps(
        {
            "extents": [[e.vdev, e.offset, e.size] for _, b in blocks for e in b.extents],
            "wrong": wrong,
        }
    )
)
