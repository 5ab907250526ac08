"""Writes numbered batches to an NBD export, flushing as it goes, until the server dies.

usage: qcow2_crash.py URI CONNECTIONS [churn]
Batch k writes 3 partial-cluster pieces with byte value (k % 250) + 1 at k * 256 KiB,
spread over CONNECTIONS connections, then flushes one; after each flush returns it
prints "flushed k".
With churn, the export is 16 slots of 256 KiB reused so that freed clusters are
allocated again: batch k trims slot (k + 8) % 16 (batch k - 8), then fills slot k % 16
with the value; only after batches 3, 7, 11, ... does it flush and print.
Exits 0 when the connection drops (the test kills the server)."""
import sys
import nbd

uri, conns = sys.argv[1], int(sys.argv[2])
churn = sys.argv[3:] == ["churn"]
hs = []
for _ in range(conns):
    h = nbd.NBD()
    h.connect_uri(uri)
    hs.append(h)
size = hs[0].get_size()
SLOT = 262144
k = 0
try:
    while churn or (k + 1) * SLOT <= size:
        v = bytes([(k % 250) + 1])
        if churn:
            hs[k % conns].trim(SLOT, ((k + 8) % 16) * SLOT)
            pieces = [((k % 16) * SLOT + i * SLOT // 4, SLOT // 4) for i in range(4)]
        else:
            pieces = [(k * SLOT + off, n) for off, n in [(1000, 30000), (70000, 100000), (200000, 50000)]]
        for i, (off, n) in enumerate(pieces):
            hs[i % conns].pwrite(v * n, off)
        if not churn or k % 4 == 3:
            hs[k % conns].flush()
            print("flushed", k, flush=True)
        k += 1
except nbd.Error:
    pass
