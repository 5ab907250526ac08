"""NBD_CMD_BLOCK_STATUS with base:allocation on a sparse export, with and without
REQ_ONE, after writes, zeroes and trims.

usage: block_status.py URI      (a fresh memory: export of 64 MiB)"""

import sys
from nbdtest import *

uri = sys.argv[1]
HZ = nbd.STATE_HOLE | nbd.STATE_ZERO
h = connect(uri)
check(h.can_meta_context(nbd.CONTEXT_BASE_ALLOCATION), "base:allocation must be negotiated")
size = h.get_size()
check_eq(size, 64 * MiB, "export size")

ext = extents(h, size, 0)
log("fresh:", ext)
check_eq(ext, [(0, size, HZ)], "a fresh sparse export is one hole")

h.pwrite(rand_bytes(3, 1 * MiB), 4 * MiB)
h.pwrite(rand_bytes(4, 3 * MiB), 10 * MiB)
ext = extents(h, size, 0)
log("after writes:", ext)
check_eq(ext, [(0, 4 * MiB, HZ), (4 * MiB, 1 * MiB, 0), (5 * MiB, 5 * MiB, HZ),
               (10 * MiB, 3 * MiB, 0), (13 * MiB, size - 13 * MiB, HZ)],
         "extents after writing [4M,5M) and [10M,13M)")

# A query starting in the middle of an extent.
ext = extents(h, 2 * MiB, 4 * MiB + 512 * KiB)
check_eq(ext, [(4 * MiB + 512 * KiB, 512 * KiB, 0), (5 * MiB, 1536 * KiB, HZ)],
         "extents of [4.5M, 6.5M)")

# REQ_ONE: exactly one extent, not longer than asked.
for (off, count, want_flags, max_len) in [(0, size, HZ, 4 * MiB), (4 * MiB, 8 * MiB, 0, 1 * MiB),
                                          (10 * MiB + 4096, 4096, 0, 4096), (20 * MiB, 1 * MiB, HZ, 1 * MiB)]:
    got = []

    def cb(metacontext, o, entries, err):
        got.append(list(entries))
        return 0

    h.block_status(count, off, cb, nbd.CMD_FLAG_REQ_ONE)
    check(len(got) == 1, "one base:allocation reply")
    e = got[0]
    check(len(e) == 2, f"REQ_ONE must give exactly one extent, got {e} for {off}+{count}")
    check(0 < e[0] <= max_len, f"REQ_ONE extent length {e[0]} must be in (0, {max_len}] for {off}+{count}")
    check_eq(e[1], want_flags, f"REQ_ONE flags at {off}")
    log(f"ok: REQ_ONE at {off}: {e}")

# Write zeroes over part of the data: reads as zero, reported with STATE_ZERO.
h.zero(1 * MiB, 10 * MiB)
ext = extents(h, 3 * MiB, 10 * MiB)
log("after zero:", ext)
check(flags_at(ext, 10 * MiB) & nbd.STATE_ZERO, "zeroed range must report STATE_ZERO")
check(flags_at(ext, 11 * MiB) == 0, "data after the zeroed range is still data")
check_eq(h.pread(1 * MiB, 10 * MiB), bytes(1 * MiB), "zeroed range reads zero")

# Trim: the range becomes a hole (memory disks free trimmed memory).
h.trim(1 * MiB, 12 * MiB)
ext = extents(h, 3 * MiB, 10 * MiB)
log("after trim:", ext)
check_eq(flags_at(ext, 12 * MiB), HZ, "trimmed range of a memory disk is a hole")
check_eq(h.pread(1 * MiB, 12 * MiB), bytes(1 * MiB), "trimmed range reads zero")

# Data written as zero bytes reads back as zero, whatever it reports.
h.pwrite(bytes(64 * KiB), 30 * MiB)
check_eq(h.pread(64 * KiB, 30 * MiB), bytes(64 * KiB), "written zeroes read back")

# Block status at the very end and past the end.
ext = extents(h, 4096, size - 4096)
check_eq(ext, [(size - 4096, 4096, HZ)], "last block")
h.set_strict_mode(0)
expect_error("block status past the end", errno.EINVAL,
             h.block_status, 4096, size, lambda *a: 0)
check_eq(extents(h, 1 * MiB, 4 * MiB), [(4 * MiB, 1 * MiB, 0)], "connection still usable")
h.shutdown()
log("block_status: all checks passed")
