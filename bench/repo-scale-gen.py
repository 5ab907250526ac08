#!/usr/bin/env python3
"""The generator disk of bench/repo-scale.sh: a sparse raw file of 64 KiB granules.

    repo-scale-gen.py FILE GRANULES UNIQUE [SEED BITMAP]
    repo-scale-gen.py --bitmap-only BITMAP GRANULES SEED

FILE is made GRANULES * 64 KiB long. Granule i < UNIQUE holds its own number (8 bytes,
big-endian, top bit set) at its start, so it is a chunk no other granule repeats; every
other granule holds the same 8 bytes ("FERRYSAM"): one chunk, stored once. The rest of
each granule is zero (a hole where the file system allows), so a chunk compresses to a
few bytes and a 64 GiB disk takes about 4 GiB of the file system (one block a granule).
Every granule is written on each call: the file's contents depend only on the arguments.

With SEED and BITMAP, 2% of the granules, drawn at random (seeded), are then changed to
a number of their own (another chunk nobody else has), as a day of scattered writes, and
BITMAP is written with one bit per granule (least significant bit first) marking them:
the change list `ferry backup --extents-from bitmap:65536:BITMAP` takes.

--bitmap-only writes only BITMAP, the same seeded draw: the day-2 map of the same disk
served on the fly by bench/repo-scale-nbdkit.py (an nbdkit plugin, given the map).
"""
import os
import random
import struct
import sys

GRANULE = 64 << 10


def day2(granules, seed):
    """The granules day 2 changes (2%, a seeded draw) and their bitmap."""
    changed = random.Random(seed).sample(range(granules), granules * 2 // 100)
    bits = bytearray((granules + 7) // 8)
    for i in changed:
        bits[i // 8] |= 1 << (i % 8)
    return changed, bits


def main():
    if len(sys.argv) == 5 and sys.argv[1] == "--bitmap-only":
        with open(sys.argv[2], "wb") as f:
            f.write(day2(int(sys.argv[3]), int(sys.argv[4]))[1])
        return
    if len(sys.argv) not in (4, 6):
        sys.exit(__doc__)
    path, granules, unique = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    if not 0 <= unique <= granules:
        sys.exit("UNIQUE must be at most GRANULES")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.ftruncate(fd, granules * GRANULE)
        same = b"FERRYSAM"
        for i in range(granules):
            tag = struct.pack(">Q", (1 << 63) | (i + 1)) if i < unique else same
            os.pwrite(fd, tag, i * GRANULE)
        if len(sys.argv) == 6:
            seed, bitmap = int(sys.argv[4]), sys.argv[5]
            changed, bits = day2(granules, seed)
            for i in changed:
                os.pwrite(fd, struct.pack(">Q", (1 << 62) | (seed << 40) | i), i * GRANULE)
            with open(bitmap, "wb") as f:
                f.write(bits)
        os.fsync(fd)
    finally:
        os.close(fd)


if __name__ == "__main__":
    main()
