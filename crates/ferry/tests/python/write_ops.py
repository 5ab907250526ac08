"""WRITE (with FUA), WRITE_ZEROES (plain, NO_HOLE, FAST_ZERO, FUA), TRIM (with FUA),
FLUSH and CACHE on a writable memory export, each checked by reading back.

usage: write_ops.py URI      (a fresh memory: export of 16 MiB)"""

import sys
from nbdtest import *

uri = sys.argv[1]
h = connect(uri)
size = h.get_size()
check_eq(size, 16 * MiB, "export size")
check(not h.is_read_only(), "memory export is writable")
for name in ["can_flush", "can_fua", "can_trim", "can_zero", "can_fast_zero", "can_cache",
             "can_multi_conn", "can_df"]:
    check(getattr(h, name)(), f"{name}() must be true for a memory export")
    log(f"ok: {name}")

model = bytearray(size)


def write(data, off, flags=0):
    h.pwrite(data, off, flags)
    model[off:off + len(data)] = data


def zero(count, off, flags=0):
    h.zero(count, off, flags)
    model[off:off + count] = bytes(count)


def verify(what):
    got = h.pread(size, 0) if size <= 32 * MiB else None
    check_eq(got, bytes(model), what)
    log(f"ok: {what}")


write(rand_bytes(10, 4 * MiB), 0, nbd.CMD_FLAG_FUA)
verify("FUA write")
zero(64 * KiB, 128 * KiB)
verify("write zeroes")
zero(100 * KiB, 1 * MiB + 7, nbd.CMD_FLAG_NO_HOLE)
verify("write zeroes NO_HOLE, unaligned")
zero(1 * MiB, 2 * MiB, nbd.CMD_FLAG_FAST_ZERO)
verify("write zeroes FAST_ZERO")
zero(4096, 3 * MiB + 4096, nbd.CMD_FLAG_FUA | nbd.CMD_FLAG_NO_HOLE)
verify("write zeroes FUA|NO_HOLE")
zero(1, 3 * MiB + 100)
verify("write zeroes of one byte")

# Trim: a memory export forgets the data, which then reads as zeroes.
h.trim(512 * KiB, 256 * KiB)
model[256 * KiB:768 * KiB] = bytes(512 * KiB)
verify("trim")
h.trim(64 * KiB, 3 * MiB + 512 * KiB, nbd.CMD_FLAG_FUA)
model[3 * MiB + 512 * KiB:3 * MiB + 576 * KiB] = bytes(64 * KiB)
verify("trim with FUA")

# Small unaligned writes across the 32 KiB chunk boundaries of a memory disk.
write(b"\x11\x22\x33", 32 * KiB - 1)
write(rand_bytes(11, 70001), 8 * MiB - 12345)
write(b"\xff", size - 1)
verify("unaligned writes")

h.flush()
h.flush(0)
h.cache(1 * MiB, 0)
h.cache(size, 0)
log("ok: flush, cache")

# A second connection sees everything after flush.
h2 = connect(uri)
check_eq(h2.pread(size, 0), bytes(model), "contents seen by a second connection")
h2.shutdown()

# Zero the whole disk in one request (larger than the 32 MiB payload limit is fine
# for zero: it carries no payload) -- here the disk is 16 MiB.
zero(size, 0)
verify("zero whole disk")
h.shutdown()
log("write_ops: all checks passed")
