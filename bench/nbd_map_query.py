#!/usr/bin/python3
"""Reads a whole dirty-bitmap map with libnbd's block_status and prints only a summary.

    nbd_map_query.py URI [CONTEXT]   (CONTEXT: qemu:dirty-bitmap:b0 by default)

The server-side half of an extent query: the same requests nbdinfo --map sends (the rest
of the disk, at most 4 GiB - 1 MiB each, one after another), without formatting 200,000
lines, so what is timed is mostly the server's answers. Prints `extents=N dirty=D
dirty_bytes=B requests=R seconds=S`, S from connecting to the
end of the map (Python's start and imports, about 40 ms, not counted).
"""
import sys
import time

import nbd

uri = sys.argv[1]
ctx = sys.argv[2] if len(sys.argv) > 2 else "qemu:dirty-bitmap:b0"
t0 = time.monotonic()
h = nbd.NBD()
h.add_meta_context(ctx)
h.connect_uri(uri)
if not h.can_meta_context(ctx):
    sys.exit(f"{uri} does not offer {ctx}")
size = h.get_size()
stats = {"extents": 0, "dirty": 0, "dirty_bytes": 0, "requests": 0}
got = [0]


def cb(meta, offset, entries, err):
    if meta != ctx:
        return 0
    done = 0
    for i in range(0, len(entries), 2):
        length, flags = entries[i], entries[i + 1]
        stats["extents"] += 1
        if flags & 1:
            stats["dirty"] += 1
            stats["dirty_bytes"] += length
        done += length
    got[0] = done
    return 0


offset = 0
while offset < size:
    got[0] = 0
    h.block_status(min(size - offset, (1 << 32) - (1 << 20)), offset, cb)
    stats["requests"] += 1
    if got[0] == 0:
        sys.exit(f"no progress at {offset}")
    offset += got[0]
h.shutdown()
stats["seconds"] = f"{time.monotonic() - t0:.4f}"
print(" ".join(f"{k}={v}" for k, v in stats.items()))
