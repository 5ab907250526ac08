"""Helpers shared by the libnbd test scripts (run with /usr/bin/python3, which has
Debian's python3-libnbd). Each script exits 0 only if every check passed; a failed
check raises AssertionError with a message, which makes the interpreter exit 1."""

import errno
import os
import random
import sys

try:
    import nbd
except ImportError:
    sys.stderr.write("cannot import nbd: install the Debian package python3-libnbd "
                     "and run this script with /usr/bin/python3\n")
    sys.exit(2)

MiB = 1024 * 1024
KiB = 1024


def log(*a):
    print(*a, flush=True)


def check(cond, msg):
    if not cond:
        raise AssertionError(msg)


def check_eq(got, want, what):
    if got != want:
        if isinstance(got, (bytes, bytearray)) and isinstance(want, (bytes, bytearray)):
            if len(got) != len(want):
                raise AssertionError(f"{what}: length {len(got)} != {len(want)}")
            i = next(i for i in range(len(got)) if got[i] != want[i])
            raise AssertionError(f"{what}: first difference at byte {i}: "
                                 f"got {bytes(got[i:i+16]).hex()} want {bytes(want[i:i+16]).hex()}")
        raise AssertionError(f"{what}: got {got!r}, want {want!r}")


def connect(uri, meta=True, structured=True, opt_mode=False, strict=None, export=None):
    h = nbd.NBD()
    if meta:
        h.add_meta_context(nbd.CONTEXT_BASE_ALLOCATION)
    h.set_request_structured_replies(structured)
    if opt_mode:
        h.set_opt_mode(True)
    if strict is not None:
        h.set_strict_mode(strict)
    if export is not None:
        h.set_export_name(export)
    h.connect_uri(uri)
    return h


def expect_error(what, want_errno, fn, *args, **kw):
    """Calls fn, which must raise nbd.Error with errno want_errno."""
    try:
        fn(*args, **kw)
    except nbd.Error as e:
        # e.errnum is the number (e.errno is its symbolic name, e.g. 'EINVAL').
        check(e.errnum == want_errno,
              f"{what}: expected errno {errno.errorcode.get(want_errno)} ({want_errno}), "
              f"got {e.errno} ({e.errnum}): {e.string}")
        log(f"ok: {what} -> {e.errno}")
        return e
    raise AssertionError(f"{what}: succeeded but should fail with {errno.errorcode.get(want_errno)}")


def rand_bytes(seed, n):
    return random.Random(seed).randbytes(n)


def extents(h, count, offset, flags=0):
    """base:allocation extents for [offset, offset+count) as (offset, length, flags),
    issuing block status calls until the range is covered."""
    out = []
    pos = offset
    end = offset + count
    while pos < end:
        got = []

        def cb(metacontext, off, entries, err):
            if metacontext == nbd.CONTEXT_BASE_ALLOCATION:
                check(off == pos, f"block status callback offset {off} != request {pos}")
                got.append(list(entries))
            return 0

        h.block_status(end - pos, pos, cb, flags)
        check(len(got) == 1, f"expected one base:allocation reply, got {len(got)}")
        e = got[0]
        check(len(e) >= 2 and len(e) % 2 == 0, f"bad extent list {e}")
        for i in range(0, len(e), 2):
            length, fl = e[i], e[i + 1]
            check(length > 0, f"zero-length extent in {e}")
            take = min(length, end - pos)
            out.append((pos, take, fl))
            pos += take
            if pos >= end:
                break
    return merge(out)


def merge(ext):
    out = []
    for (o, l, f) in ext:
        if out and out[-1][2] == f and out[-1][0] + out[-1][1] == o:
            out[-1] = (out[-1][0], out[-1][1] + l, f)
        else:
            out.append((o, l, f))
    return out


def flags_at(ext, pos):
    for (o, l, f) in ext:
        if o <= pos < o + l:
            return f
    raise AssertionError(f"no extent covers {pos}: {ext}")
