# The generator disk of bench/repo-scale.sh served by nbdkit, computed on the fly: no disk used.
#
#   nbdkit -U SOCK python bench/repo-scale-nbdkit.py granules=G unique=U [rest=zero] [seed=S bitmap=MAP]
#
# The same bytes as `repo-scale-gen.py FILE G U [S MAP]` writes (see its description): granule
# i < U holds its own 8-byte number at its start, every other granule "FERRYSAM", the rest zero.
# With seed= and bitmap=, the granules whose bit is set in MAP (written beforehand by
# `repo-scale-gen.py --bitmap-only MAP G S`, the same seeded draw) hold the day-2 number
# instead. With rest=zero the granules from U on are zero (holes) instead of "FERRYSAM", so a
# large disk costs a full backup only its U unique granules (day 2's changes still land
# anywhere). Block status reports the first 4 KiB of each granule as data and the rest as a
# zero hole, as a file system reports the generator file (one block a granule), so a reader
# that follows extents reads 4 KiB a granule. Read-only.
import io
import struct

import nbdkit

API_VERSION = 2
GRANULE = 64 << 10
DATA = 4096
SAME = b"FERRYSAM"

granules = None
unique = 0
seed = None
bitmap_path = None
rest_zero = False
bits = b""
zeros = memoryview(bytes(0))


def config(key, value):
    global granules, unique, seed, bitmap_path, rest_zero
    if key == "granules":
        granules = int(value)
    elif key == "unique":
        unique = int(value)
    elif key == "seed":
        seed = int(value)
    elif key == "bitmap":
        bitmap_path = value
    elif key == "rest" and value in ("same", "zero"):
        rest_zero = value == "zero"
    else:
        raise RuntimeError("unknown parameter %s (granules, unique, rest=same|zero, seed, bitmap)" % key)


def config_complete():
    global bits
    if granules is None or granules <= 0:
        raise RuntimeError("granules=N is required")
    if not 0 <= unique <= granules:
        raise RuntimeError("unique must be at most granules")
    if (seed is None) != (bitmap_path is None):
        raise RuntimeError("seed= and bitmap= go together")
    if bitmap_path is not None:
        with io.open(bitmap_path, "rb") as f:
            bits = f.read()
        if len(bits) != (granules + 7) // 8:
            raise RuntimeError("bitmap %s is not %d bytes" % (bitmap_path, (granules + 7) // 8))


def thread_model():
    return nbdkit.THREAD_MODEL_PARALLEL


def open(readonly):
    return 1


def get_size(h):
    return granules * GRANULE


def can_write(h):
    return False


def can_extents(h):
    return True


def can_cache(h):
    return nbdkit.CACHE_EMULATE


def can_multi_conn(h):
    return True


def tag(i):
    if changed(i):
        return struct.pack(">Q", (1 << 62) | (seed << 40) | i)
    if i < unique:
        return struct.pack(">Q", (1 << 63) | (i + 1))
    return None if rest_zero else SAME


def changed(i):
    return bits and bits[i >> 3] & (1 << (i & 7))


def pread(h, buf, offset, flags):
    global zeros
    n = len(buf)
    if len(zeros) < n:
        zeros = memoryview(bytes(n))
    buf[:] = zeros[:n]
    first = offset // GRANULE
    last = (offset + n - 1) // GRANULE
    for i in range(first, last + 1):
        start = i * GRANULE
        if start + 8 <= offset or start >= offset + n:
            continue
        t = tag(i)
        if t is None:
            continue
        lo = max(start, offset)
        hi = min(start + 8, offset + n)
        buf[lo - offset:hi - offset] = t[lo - start:hi - start]


def extents(h, count, offset, flags):
    out = []
    end = min(offset + count, granules * GRANULE)
    i = offset // GRANULE
    # at most 4096 granules an answer: the client asks again from where it ends
    while i * GRANULE < end and len(out) < 8192:
        start = i * GRANULE
        if rest_zero and i >= unique and not changed(i):
            # a zero granule: one hole up to the next granule that holds data
            j = i + 1
            if not bits:
                j = max(j, -(-end // GRANULE))
            while j * GRANULE < end and j >= unique and not changed(j):
                j += 1
            out.append((max(start, offset), j * GRANULE - max(start, offset),
                        nbdkit.EXTENT_HOLE | nbdkit.EXTENT_ZERO))
            i = j
            continue
        if offset < start + DATA:
            out.append((max(start, offset), start + DATA - max(start, offset), 0))
        out.append((max(start + DATA, offset), start + GRANULE - max(start + DATA, offset),
                    nbdkit.EXTENT_HOLE | nbdkit.EXTENT_ZERO))
        i += 1
    return out
