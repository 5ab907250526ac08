"""Writes bytes to an export: pwrite.py URI OFFSET:LENGTH:BYTE ... (flushes at the end)."""

import sys
from nbdtest import *

h = connect(sys.argv[1], meta=False)
for spec in sys.argv[2:]:
    off, length, byte = spec.split(":")
    h.pwrite(bytes([int(byte, 0)]) * int(length), int(off))
h.flush()
h.shutdown()
