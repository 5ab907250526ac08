"""Random writes, trims and zeroes (with and without NO_HOLE) from several connections
at once, each on its own stripes of the export, checked against a model.

usage: qcow2_churn.py URI CONNECTIONS OPS SEED
Connection c owns the 1 MiB stripes s with s % CONNECTIONS == c, so clusters one
connection frees are reused by the others. Each does OPS operations (every 16th a
FLUSH), then reads its stripes back and compares them with its model. Exits 1 on the
first difference."""
import random
import sys
import threading
import nbd

uri, conns, ops, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
MIB = 1 << 20
size = None
errors = []


def worker(c):
    global size
    h = nbd.NBD()
    h.connect_uri(uri)
    size = h.get_size()
    rng = random.Random(seed * 100 + c)
    stripes = [s for s in range(size // MIB) if s % conns == c]
    model = {s: bytearray(MIB) for s in stripes}
    for i in range(ops):
        s = rng.choice(stripes)
        off = rng.randrange(MIB)
        n = rng.choice([rng.randrange(1, 4096), rng.randrange(1, 200000), MIB - off])
        n = min(n, MIB - off)
        at = s * MIB + off
        kind = rng.randrange(4)
        if kind == 0:
            v = bytes([rng.randrange(1, 256)]) * n
            h.pwrite(v, at)
            model[s][off:off + n] = v
        elif kind == 1:
            # TRIM: contents unspecified afterwards; read them back into the model.
            h.trim(n, at)
            model[s][off:off + n] = h.pread(n, at)
        else:
            flags = nbd.CMD_FLAG_NO_HOLE if kind == 3 else 0
            h.zero(n, at, flags)
            model[s][off:off + n] = bytes(n)
        if i % 16 == 15:
            h.flush()
    for s in stripes:
        got = h.pread(MIB, s * MIB)
        if got != model[s]:
            bad = next(i for i in range(MIB) if got[i] != model[s][i])
            errors.append("connection %d stripe %d differs at byte %d" % (c, s, bad))
    h.flush()
    h.shutdown()


threads = [threading.Thread(target=worker, args=(c,)) for c in range(conns)]
for t in threads:
    t.start()
for t in threads:
    t.join()
if errors:
    print("\n".join(errors))
    sys.exit(1)
print("ok")
