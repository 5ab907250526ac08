"""Many requests in flight on one connection (aio_pwrite / aio_pread, 64 at a time),
mixed with flush and zero, all completing with the right data.

usage: aio_inflight.py URI [DEPTH]      (a fresh memory: export of at least 16 MiB)"""

import sys
from nbdtest import *

uri = sys.argv[1]
depth = int(sys.argv[2]) if len(sys.argv) > 2 else 64
h = connect(uri)
bs = 64 * KiB
size = h.get_size()
check(size >= depth * bs * 2, "export too small")

def wait_all(cookies):
    while h.aio_in_flight() > 0:
        h.poll(-1)
    for c in cookies:
        check(h.aio_command_completed(c), f"command {c} not completed")

# Writes: block i at offset i*bs (and a second round into the upper half).
rounds = 0
blocks = {}
cookies = []
for i in range(depth):
    data = rand_bytes(1000 + i, bs)
    blocks[i] = data
    cookies.append(h.aio_pwrite(nbd.Buffer.from_bytearray(bytearray(data)), i * bs))
check(h.aio_in_flight() > 1, "requests should be in flight together")
log(f"in flight after queueing {depth} writes: {h.aio_in_flight()}")
wait_all(cookies)

# Mixed: reads of the first half, writes of the second half, a zero and a flush.
reads = []
cookies = []
for i in range(depth):
    buf = nbd.Buffer(bs)
    reads.append((i, buf))
    cookies.append(h.aio_pread(buf, i * bs))
    data = rand_bytes(5000 + i, bs)
    blocks[depth + i] = data
    cookies.append(h.aio_pwrite(nbd.Buffer.from_bytearray(bytearray(data)), (depth + i) * bs))
cookies.append(h.aio_zero(bs, (2 * depth + 1) * bs))
cookies.append(h.aio_flush())
wait_all(cookies)
for (i, buf) in reads:
    check_eq(buf.to_bytearray(), blocks[i], f"aio read of block {i}")

# Read everything back with many reads in flight, in reverse order.
reads = []
cookies = []
for i in reversed(range(2 * depth)):
    buf = nbd.Buffer(bs)
    reads.append((i, buf))
    cookies.append(h.aio_pread(buf, i * bs))
wait_all(cookies)
for (i, buf) in reads:
    check_eq(buf.to_bytearray(), blocks[i], f"final aio read of block {i}")
h.shutdown()
log("aio_inflight: all checks passed")
