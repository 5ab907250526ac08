"""Error replies with libnbd's client-side checks off: the server must answer
EINVAL/ENOSPC/EPERM and keep the connection usable.

usage: errors.py URI_RW URI_RO     (fresh writable and read-only memory: exports)"""

import sys
from nbdtest import *

uri_rw, uri_ro = sys.argv[1], sys.argv[2]

h = connect(uri_rw, strict=0)
size = h.get_size()
h.pwrite(b"canary!!", 0)


def alive():
    check_eq(h.pread(8, 0), b"canary!!", "connection still usable after an error")


expect_error("read past the end", errno.EINVAL, h.pread, 4096, size)
alive()
expect_error("read straddling the end", errno.EINVAL, h.pread, 8192, size - 4096)
alive()
expect_error("read at huge offset", errno.EINVAL, h.pread, 512, (1 << 63) - 512)
alive()
expect_error("write past the end", errno.ENOSPC, h.pwrite, b"x" * 4096, size)
alive()
expect_error("write straddling the end", errno.ENOSPC, h.pwrite, b"x" * 8192, size - 4096)
alive()
check_eq(h.pread(4096, size - 4096), bytes(4096), "a refused write must not write its in-range part")
expect_error("write zeroes past the end", errno.ENOSPC, h.zero, 4096, size)
alive()
expect_error("trim past the end", errno.EINVAL, h.trim, 4096, size)
alive()
expect_error("cache past the end", errno.EINVAL, h.cache, 4096, size)
alive()
# Unknown command flag (bit 15 is not defined for READ).
expect_error("read with an unknown flag", errno.EINVAL, h.pread, 512, 0, 1 << 15)
alive()
# REQ_ONE is only valid on BLOCK_STATUS.
expect_error("read with REQ_ONE", errno.EINVAL, h.pread, 512, 0, nbd.CMD_FLAG_REQ_ONE)
alive()
h.shutdown()

r = connect(uri_ro, strict=0)
check(r.is_read_only(), "read-only export must say so")
check(not r.can_trim() and not r.can_zero(), "read-only export must not offer trim/zero")
expect_error("write to read-only export", errno.EPERM, r.pwrite, b"y" * 4096, 0)
expect_error("write zeroes to read-only export", errno.EPERM, r.zero, 4096, 0)
expect_error("trim on read-only export", errno.EPERM, r.trim, 4096, 0)
check_eq(r.pread(4096, 0), bytes(4096), "read-only export unchanged and still usable")
r.flush()
r.shutdown()
log("errors: all checks passed")
