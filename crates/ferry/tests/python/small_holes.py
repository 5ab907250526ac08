"""Small structured reads of a qcow2 export: zero and unallocated clusters come back as
OFFSET_HOLE chunks whatever the read's size, data as OFFSET_DATA.

usage: small_holes.py URI   (a qcow2 image: 0x61 in [0, 64K), a zero cluster at 64K,
                             0x62 in [1M, 1M+64K), the rest of its 4 MiB unallocated)"""

import sys
from nbdtest import *

h = connect(sys.argv[1])
check(h.get_structured_replies_negotiated(), "structured replies must be negotiated")


def chunks(count, offset):
    got = []

    def cb(subbuf, off, status, err):
        check(err.value == 0, f"chunk callback saw error {err.value}")
        got.append((off, len(subbuf), status, bytes(subbuf)))
        return 0

    h.pread_structured(count, offset, cb)
    return sorted(got)


for size in (512, 4096, 16 * KiB):
    for (offset, status, fill) in [(0, nbd.READ_DATA, 0x61), (64 * KiB, nbd.READ_HOLE, 0),
                                   (1 * MiB, nbd.READ_DATA, 0x62), (2 * MiB, nbd.READ_HOLE, 0)]:
        at = offset + 512 if size < 4096 else offset
        got = chunks(size, at)
        check(len(got) == 1, f"{size} bytes at {at}: {len(got)} chunks")
        (off, n, st, data) = got[0]
        check((off, n) == (at, size), f"{size} bytes at {at}: a chunk of {n} at {off}")
        check(st == status, f"{size} bytes at {at}: chunk status {st}, want {status}")
        check(data == bytes([fill]) * size, f"{size} bytes at {at}: wrong bytes")
h.shutdown()
log("small_holes: all checks passed")
