"""Multi-conn consistency: data written and flushed on one connection is seen by
every other connection.

usage: multi_conn.py URI      (a fresh writable export of at least 8 MiB)"""

import sys
from nbdtest import *

uri = sys.argv[1]
hs = [connect(uri) for _ in range(4)]
for i, h in enumerate(hs):
    check(h.can_multi_conn(), f"connection {i}: can_multi_conn() must be true")
for rnd in range(8):
    w = hs[rnd % 4]
    off = rnd * 512 * KiB + rnd * 13
    data = rand_bytes(100 + rnd, 256 * KiB + rnd)
    w.pwrite(data, off)
    w.flush()
    for i, r in enumerate(hs):
        check_eq(r.pread(len(data), off), data, f"round {rnd}: connection {i} after flush on {rnd % 4}")
# FUA write is also visible to the others.
hs[1].pwrite(b"fua!" * 1024, 6 * MiB, nbd.CMD_FLAG_FUA)
check_eq(hs[2].pread(4096, 6 * MiB), b"fua!" * 1024, "FUA write seen by another connection")
for h in hs:
    h.shutdown()
log("multi_conn: all checks passed")
