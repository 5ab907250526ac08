"""A client that does not ask for structured replies gets simple replies that work,
including errors.

usage: simple_replies.py URI      (a fresh memory: export of at least 8 MiB)"""

import sys
from nbdtest import *

uri = sys.argv[1]
h = connect(uri, meta=False, structured=False, strict=0)
check(not h.get_structured_replies_negotiated(), "structured replies must not be negotiated")
check(not h.can_df(), "DF must not be advertised without structured replies")
size = h.get_size()
data = rand_bytes(20, 3 * MiB + 5)
h.pwrite(data, 1 * MiB - 3)
check_eq(h.pread(len(data), 1 * MiB - 3), data, "read back with simple replies")
check_eq(h.pread(4096, 7 * MiB), bytes(4096), "untouched range reads zero")
h.zero(4096, 1 * MiB)
check_eq(h.pread(4096, 1 * MiB), bytes(4096), "zeroed")
h.trim(64 * KiB, 2 * MiB)
check_eq(h.pread(64 * KiB, 2 * MiB), bytes(64 * KiB), "trimmed")
h.flush()
expect_error("read past the end", errno.EINVAL, h.pread, 4096, size)
expect_error("write past the end", errno.ENOSPC, h.pwrite, b"z" * 4096, size)
check_eq(h.pread(16, 3 * MiB), data[2 * MiB + 3:2 * MiB + 19], "usable after errors")
# Large simple-reply read.
big = h.pread(32 * MiB if size >= 32 * MiB else size, 0)
check_eq(len(big), min(size, 32 * MiB), "large read length")
h.shutdown()
log("simple_replies: all checks passed")
