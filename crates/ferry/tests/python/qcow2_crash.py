"""Writes numbered batches to an NBD export, flushing after each, until the server dies.

usage: qcow2_crash.py URI CONNECTIONS
Batch k writes 3 partial-cluster pieces with byte value (k % 250) + 1 at k * 256 KiB,
spread over CONNECTIONS connections, then flushes one; after each flush returns it
prints "flushed k". Exits 0 when the connection drops (the test kills the server)."""
import sys
import nbd

uri, conns = sys.argv[1], int(sys.argv[2])
hs = []
for _ in range(conns):
    h = nbd.NBD()
    h.connect_uri(uri)
    hs.append(h)
size = hs[0].get_size()
k = 0
try:
    while (k + 1) * 262144 <= size:
        v = bytes([(k % 250) + 1])
        base = k * 262144
        for i, (off, n) in enumerate([(1000, 30000), (70000, 100000), (200000, 50000)]):
            hs[i % conns].pwrite(v * n, base + off)
        hs[k % conns].flush()
        print("flushed", k, flush=True)
        k += 1
except nbd.Error:
    pass
