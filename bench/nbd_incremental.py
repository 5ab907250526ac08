#!/usr/bin/python3
"""Incremental backup the way virtnbdbackup does it, with libnbd's Python bindings.

    nbd_incremental.py [--bitmap NAME] [--chunk BYTES] SRC_URI OUT

Connects to SRC_URI asking for the meta contexts base:allocation and (with --bitmap)
qemu:dirty-bitmap:NAME, queries the whole map with NBD_CMD_BLOCK_STATUS, then copies
every extent the bitmap marks dirty into OUT at the same offset: data is read with pread
(in pieces of at most --chunk bytes, 4 MiB by default) and written (synced at the end
only with --flush, as `ferry copy`); ranges that are dirty
but read as zeroes (base:allocation's ZERO bit) are written as zeroes, never as data.
Clean ranges are not touched. Without --bitmap every range counts as dirty (a full copy
of the data, zero ranges skipped: OUT must then start out zero, a new file or overlay).

OUT is an NBD URI (nbd://, nbd+unix://: a qemu-nbd export of a qcow2 overlay whose
backing file is the previous backup, as virtnbdbackup and ovirt-imageio do) or a local raw
file (written in place; created with the source's size if missing).

Prints one line to stdout: "extents=N data_bytes=N zero_bytes=N seconds=S".
This is the reference the ferry tests and bench/backup.sh measure `ferry copy
--dirty-bitmap` against; it uses only the public libnbd API.
"""

import argparse
import os
import sys
import time

import nbd

STATE_DIRTY = 1
STATE_ZERO = 2
MAX_STATUS = 1 << 30  # bytes asked per BLOCK_STATUS request (libnbd limit is 32 bits)
MAX_ZERO = 1 << 30


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bitmap", help="dirty bitmap name (qemu:dirty-bitmap:NAME)")
    p.add_argument("--chunk", type=int, default=4 << 20, help="largest read, bytes")
    p.add_argument("--flush", action="store_true", help="flush/fsync OUT at the end")
    p.add_argument("src")
    p.add_argument("out")
    return p.parse_args()


def is_uri(s):
    return s.startswith("nbd://") or s.startswith("nbd+unix://") or s.startswith("nbds://")


def query_map(h, size, contexts):
    """[(start, end, flags)] per context name, covering [0, size) in lock step."""
    maps = {c: [] for c in contexts}
    off = 0
    while off < size:
        got = {c: [] for c in contexts}

        def cb(ctx, start, entries, err):
            if ctx not in got:
                return 0
            pos = start
            for i in range(0, len(entries) - 1, 2):
                length, flags = entries[i], entries[i + 1]
                if length == 0:
                    continue
                got[ctx].append((pos, pos + length, flags))
                pos += length
            return 0

        h.block_status(min(size - off, MAX_STATUS), off, cb)
        # Advance by what every context covered (each may answer less than asked).
        ends = [got[c][-1][1] if got[c] else off for c in contexts]
        end = min(min(ends), size)
        if end <= off:
            sys.exit("server returned no progress at offset %d" % off)
        for c in contexts:
            for s, e, f in got[c]:
                if s >= end:
                    break
                maps[c].append((s, min(e, end), f))
        off = end
    return maps


def dirty_extents(maps, bitmap_ctx, size):
    """Yield (start, end, is_zero) for dirty ranges, intersected with base:allocation."""
    alloc = maps["base:allocation"]
    dirty = maps[bitmap_ctx] if bitmap_ctx else [(0, size, STATE_DIRTY)]
    i = j = 0
    while i < len(alloc) and j < len(dirty):
        a0, a1, af = alloc[i]
        d0, d1, df = dirty[j]
        s, e = max(a0, d0), min(a1, d1)
        if s < e and df & STATE_DIRTY:
            yield s, e, bool(af & STATE_ZERO)
        if a1 <= d1:
            i += 1
        else:
            j += 1


def main():
    args = parse_args()
    t0 = time.monotonic()
    src = nbd.NBD()
    src.add_meta_context("base:allocation")
    ctx = None
    if args.bitmap:
        ctx = "qemu:dirty-bitmap:" + args.bitmap
        src.add_meta_context(ctx)
    src.connect_uri(args.src)
    for c in ["base:allocation"] + ([ctx] if ctx else []):
        if not src.can_meta_context(c):
            sys.exit("the server does not offer the meta context %s" % c)
    size = src.get_size()

    out_nbd = None
    out_fd = None
    if is_uri(args.out):
        out_nbd = nbd.NBD()
        out_nbd.connect_uri(args.out)
        if out_nbd.get_size() < size:
            sys.exit("destination is smaller than the source")
    else:
        out_fd = os.open(args.out, os.O_WRONLY | os.O_CREAT, 0o644)
        if os.fstat(out_fd).st_size < size:
            os.ftruncate(out_fd, size)

    contexts = ["base:allocation"] + ([ctx] if ctx else [])
    maps = query_map(src, size, contexts)

    n = data = zero = 0
    zbuf = bytes(min(args.chunk, 1 << 20))
    for s, e, is_zero in dirty_extents(maps, ctx, size):
        n += 1
        if is_zero:
            if not ctx:
                continue  # a full copy into a zeroed destination
            zero += e - s
            off = s
            while off < e:
                ln = min(e - off, MAX_ZERO if out_nbd else len(zbuf))
                if out_nbd:
                    out_nbd.zero(ln, off)
                else:
                    os.pwrite(out_fd, zbuf[:ln], off)
                off += ln
            continue
        off = s
        while off < e:
            ln = min(e - off, args.chunk)
            buf = src.pread(ln, off)
            if out_nbd:
                out_nbd.pwrite(buf, off)
            else:
                os.pwrite(out_fd, buf, off)
            data += ln
            off += ln

    if out_nbd:
        if args.flush:
            out_nbd.flush()
        out_nbd.shutdown()
    else:
        if args.flush:
            os.fsync(out_fd)
        os.close(out_fd)
    src.shutdown()
    print("extents=%d data_bytes=%d zero_bytes=%d seconds=%.3f" % (n, data, zero, time.monotonic() - t0))


if __name__ == "__main__":
    main()
