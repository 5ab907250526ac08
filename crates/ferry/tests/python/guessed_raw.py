"""A guest writes the first sector of its disk through an export of a file whose raw
format ferry guessed, trying to turn it into a qcow2 image.

usage: guessed_raw.py URI HEADER MODE
  HEADER: a file holding the first 512 bytes of a qcow2 image (one naming a backing file)
  MODE:   guarded  (served as PATH: header writes must fail with EPERM, other writes pass)
          raw      (served as raw:PATH: the header write must pass)"""

import errno
import sys
from nbdtest import *

uri, header_path, mode = sys.argv[1], sys.argv[2], sys.argv[3]
header = open(header_path, "rb").read()
check(len(header) == 512 and header[:4] == b"QFI\xfb", "HEADER must be 512 bytes of a qcow2 image")
h = connect(uri)
check(not h.is_read_only(), "the export must be writable")


def refused(data, offset, what):
    expect_error(what, errno.EPERM, h.pwrite, data, offset)


# A partition table in sector 0 (an MBR: boot code, signature) is fine.
mbr = bytearray(512)
mbr[0:3] = b"\xebZ\x90"
mbr[446] = 0x80
mbr[510:512] = b"\x55\xaa"
h.pwrite(bytes(mbr), 0)
check_eq(h.pread(512, 0), bytes(mbr), "the MBR written")
# The header anywhere past the first bytes is data like any other.
h.pwrite(header, 4096)
check_eq(h.pread(512, 4096), header, "a header at 4096")

if mode == "guarded":
    refused(header, 0, "the whole header at 0")
    refused(header + bytes(3584), 0, "the header in a 4 KiB write at 0")
    refused(b"QFI\xfb", 0, "the magic alone")
    # Built up from two writes: the second one is checked against the first.
    h.pwrite(b"QFI", 0)
    refused(b"\xfb", 3, "the magic's last byte after its first three")
    h.pwrite(b"\0\0\0", 0)
    h.pwrite(b"\xfb", 3)
    refused(b"QFI", 0, "the magic's first three bytes before its last")
    # The refused writes left nothing behind.
    check_eq(h.pread(4, 0), b"\0\0\0\xfb", "the first bytes after refused writes")
    # Zeroing and trimming the start are fine.
    h.zero(4096, 0)
    h.trim(512, 0)
    h.pwrite(bytes(mbr), 0)
    h.flush()
elif mode == "raw":
    h.pwrite(header, 0)
    check_eq(h.pread(512, 0), header, "the header written through raw:")
    h.flush()
else:
    raise AssertionError(f"unknown MODE {mode}")
h.shutdown()
log("guessed_raw: all checks passed")
