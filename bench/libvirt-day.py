#!/usr/bin/env python3
"""One day's changes of a running libvirt domain's disk, for bench/libvirt.sh.

    python3 bench/libvirt-day.py DOMAIN SIZE PCT SEED DIR RAW > COMMANDS

PCT % of the 64 KiB granules of a disk of SIZE bytes (at distinct random granules, seeded)
each get a 4 KiB write of random bytes at a random 4 KiB block of the granule. Each write's
bytes go to a file DIR/SEED-N.bin; the same bytes are written at the same offset of the raw
file RAW (the disk's expected contents). Prints the virsh commands (one per line, for
`virsh < COMMANDS`) that make the writes through the running virtio disk vda with the HMP
`qemu-io` command, as a guest writing its disk would.
"""
import os
import random
import sys

domain, size, pct, seed, out, raw = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6]
g = 65536
granules = size // g
count = max(1, round(granules * pct / 100))
rnd = random.Random(seed)
fd = os.open(raw, os.O_WRONLY)
dev = "/machine/peripheral/virtio-disk0/virtio-backend"
for n, o in enumerate(sorted(rnd.sample(range(granules), count))):
    data, at = rnd.randbytes(4096), o * g + rnd.randrange(16) * 4096
    f = os.path.join(out, f"{seed}-{n}.bin")
    with open(f, "wb") as w:
        w.write(data)
    os.pwrite(fd, data, at)
    print(f"qemu-monitor-command {domain} --hmp 'qemu-io -d {dev} \"write -s {f} {at} 4096\"'")
os.fsync(fd)
os.close(fd)
