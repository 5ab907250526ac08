#!/usr/bin/env python3
"""The image of bench/repo.sh and bench/repo-s3.sh: PATH, a sparse raw file of SIZE bytes.

    python3 bench/repo-image.py PATH SIZE

SIZE bytes in 1 MiB regions drawn at random (seeded, so every run makes the same image):
20% holes, 30% random bytes (AES-CTR from openssl), 35% text-like bytes (AES-CTR mapped
onto an English-like alphabet, about 4 bits a byte) and 15% sparse binary-like bytes (mostly
zero bytes): partly compressible, no two chunks alike.
"""
import random
import subprocess
import sys

path, size = sys.argv[1], int(sys.argv[2])
MiB = 1 << 20
rnd = random.Random(29)
src = subprocess.Popen(["openssl", "enc", "-aes-128-ctr", "-pass", "pass:repo", "-nosalt", "-pbkdf2"],
                       stdin=open("/dev/zero", "rb"), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
letters = " etaoinshrdlcumwfgypbvkjxqz\n.,0123456789"
weights = [18, 10, 7, 6.5, 6, 5.5, 5.5, 5, 4.8, 4, 3.4, 3, 2.8, 2.4, 2.2, 2, 1.8, 1.6, 1.6, 1.2,
           1, 0.8, 0.6, 0.2, 0.15, 0.1, 0.07, 2, 1, 1] + [0.5] * 10
tab, acc, tot = bytearray(), 0.0, sum(weights)
for c, w in zip(letters, weights):
    acc += w
    while len(tab) < round(256 * acc / tot):
        tab.append(ord(c))
TEXT = bytes(tab[:256]).ljust(256, b" ")
LOW = bytes([0] * 200 + [0xff] * 16 + list(range(1, 41)))
kinds = ["hole"] * 20 + ["random"] * 30 + ["text"] * 35 + ["low"] * 15
with open(path, "wb") as f:
    f.truncate(size)
    for off in range(0, size, MiB):
        k = rnd.choice(kinds)
        if k == "hole":
            continue
        b = src.stdout.read(MiB)
        if k == "text":
            b = b.translate(TEXT)
        elif k == "low":
            b = b.translate(LOW)
        f.seek(off)
        f.write(b)
src.kill()
