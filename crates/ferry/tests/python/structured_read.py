"""Structured reads (NBD_OPT_STRUCTURED_REPLY): untouched ranges of a sparse export
come back as OFFSET_HOLE chunks, written data as OFFSET_DATA, DF gives one chunk.

usage: structured_read.py URI      (a fresh memory: export of at least 64 MiB)
Set FERRY_EXPECT_HOLES=0 to allow a server that never sends hole chunks."""

import os
import sys
from nbdtest import *

uri = sys.argv[1]
expect_holes = os.environ.get("FERRY_EXPECT_HOLES", "1") != "0"
h = connect(uri)
check(h.get_structured_replies_negotiated(), "structured replies must be negotiated")
check(h.can_df(), "DF must be advertised with structured replies")
size = h.get_size()
check(size >= 64 * MiB, f"export too small: {size}")

expected = bytearray(4 * MiB)
d1 = rand_bytes(1, 64 * KiB)
h.pwrite(d1, 1 * MiB)
expected[1 * MiB:1 * MiB + len(d1)] = d1
d2 = rand_bytes(2, 100)
h.pwrite(d2, 3 * MiB + 5)
expected[3 * MiB + 5:3 * MiB + 105] = d2


def read_chunks(count, offset, flags=0):
    chunks = []

    def cb(subbuf, off, status, err):
        check(err.value == 0, f"chunk callback saw error {err.value}")
        check(status in (nbd.READ_DATA, nbd.READ_HOLE), f"unexpected chunk status {status}")
        check(len(subbuf) > 0, "empty chunk")
        if status == nbd.READ_HOLE:
            check(bytes(subbuf) == bytes(len(subbuf)), "hole chunk buffer is not zero")
        chunks.append((off, len(subbuf), status, bytes(subbuf)))
        return 0

    h.pread_structured(count, offset, cb, flags)
    chunks.sort()
    pos = offset
    buf = bytearray()
    for (off, n, status, data) in chunks:
        check(off == pos, f"chunks overlap or leave a gap at {pos}: {[(c[0], c[1], c[2]) for c in chunks]}")
        buf += data
        pos += n
    check(pos == offset + count, f"chunks cover up to {pos}, not {offset + count}")
    return chunks, bytes(buf)


chunks, buf = read_chunks(4 * MiB, 0)
check_eq(buf, bytes(expected), "structured read of [0, 4M)")
holes = [c for c in chunks if c[2] == nbd.READ_HOLE]
data = [c for c in chunks if c[2] == nbd.READ_DATA]
log(f"[0,4M): {len(data)} data chunks, {len(holes)} hole chunks")
check(len(data) >= 1, "written data must come back in OFFSET_DATA chunks")
if expect_holes:
    check(len(holes) >= 1, "untouched ranges must come back as OFFSET_HOLE chunks")
    # Nothing was written to [0, 1M): all of it is hole.
    for (off, n, status, _) in chunks:
        if off < 1 * MiB:
            check(status == nbd.READ_HOLE,
                  f"chunk {off}+{n} in the untouched first MiB is not a hole")
    hole_bytes = sum(c[1] for c in holes)
    check(hole_bytes >= 2 * MiB, f"only {hole_bytes} bytes of [0,4M) came back as holes")

# An entirely untouched range: holes only.
chunks, buf = read_chunks(8 * MiB, 16 * MiB)
check_eq(buf, bytes(8 * MiB), "untouched range reads as zero")
nholes = sum(1 for c in chunks if c[2] == nbd.READ_HOLE)
log(f"[16M,24M): {len(chunks)} chunks, {nholes} holes")
if expect_holes:
    check(nholes == len(chunks), "an untouched range must be all OFFSET_HOLE chunks")

# DF: exactly one chunk, even for a range mixing data and holes.
chunks, buf = read_chunks(2 * MiB, 0, nbd.CMD_FLAG_DF)
check_eq(buf, bytes(expected[:2 * MiB]), "DF read of [0, 2M)")
check(len(chunks) == 1, f"DF read must not be fragmented, got {len(chunks)} chunks")
check(chunks[0][2] == nbd.READ_DATA, "a DF read mixing data and holes must be one OFFSET_DATA chunk")

# The largest read the server must accept (32 MiB).
chunks, buf = read_chunks(32 * MiB, 32 * MiB)
check_eq(buf, bytes(32 * MiB), "32 MiB read of untouched range")

# Plain pread agrees.
check_eq(h.pread(4 * MiB, 0), bytes(expected), "pread of [0, 4M)")
# Unaligned structured read straddling data and hole.
chunks, buf = read_chunks(1000, 1 * MiB + 64 * KiB - 500)
check_eq(buf, bytes(expected[1 * MiB + 64 * KiB - 500:1 * MiB + 64 * KiB + 500]), "unaligned read")
h.shutdown()
log("structured_read: all checks passed")
