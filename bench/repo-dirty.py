#!/usr/bin/env python3
"""One day's changes for bench/repo.sh and bench/repo-s3.sh.

    python3 bench/repo-dirty.py URI COUNT SEED [RAW]

COUNT 4 KiB writes of random bytes at distinct random 64 KiB granules (seeded) of the NBD
export URI (qemu-nbd on the qcow2 image, whose persistent bitmaps record them). With RAW,
the same bytes are written at the same offsets of that raw file too, so that it stays the
image's raw twin (what restic and borg back up) without a conversion.
"""
import os
import random
import sys

import nbd

uri, count, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
raw = os.open(sys.argv[4], os.O_WRONLY) if len(sys.argv) > 4 else None
h = nbd.NBD()
h.connect_uri(uri)
g = 65536
granules = h.get_size() // g
rnd = random.Random(seed)
offs = [o * g for o in sorted(rnd.sample(range(granules), count))]
for o in offs:
    while h.aio_in_flight() >= 64:
        h.poll(-1)
    data, at = rnd.randbytes(4096), o + rnd.randrange(16) * 4096
    h.aio_pwrite(data, at)
    if raw is not None:
        os.pwrite(raw, data, at)
while h.aio_in_flight() > 0:
    h.poll(-1)
h.flush()
h.shutdown()
if raw is not None:
    os.fsync(raw)
    os.close(raw)
