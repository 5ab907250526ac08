#!/usr/bin/python3
"""Capture real NBD client->server traffic and cut it into fuzz seeds.

How fuzz/seeds/ was made (from the repository root, Debian packages nbdkit,
libnbd-bin, python3-libnbd and qemu-utils installed; /usr/bin/python3 because
nbdsh needs Debian's python3-libnbd):

    /usr/bin/python3 fuzz/capture.py            # rewrites fuzz/seeds/{handshake,options,request}
    /usr/bin/python3 fuzz/capture.py OUTDIR     # or somewhere else

It starts two real servers on Unix sockets in a scratch directory:
  * `nbdkit -U SOCK memory 1M`  (nbdkit 1.32: structured replies, no extended headers)
  * `qemu-nbd -k SOCK -t disk.raw` (qemu 10: extended headers, so 32-byte requests)
and puts a logging proxy (below) in front of each. Real clients then run through
the proxies: `nbdinfo --json/--list/--map`, `nbdsh` scripts (reads, writes, trim,
zero, cache, block status, option mode, an old-style NBD_OPT_EXPORT_NAME client),
`qemu-img info/map/convert` and `qemu-io`. Every connection's client->server bytes
are split into:
  * handshake/  one split byte (see fuzz_targets/handshake.rs) + the client flags
                and every option up to and including GO / EXPORT_NAME / ABORT;
  * options/    the data of each NBD_OPT_INFO/GO and NBD_OPT_*_META_CONTEXT;
  * request/    one selector byte (0 compact, 1 extended), one request header as
                sent (write payloads dropped), then 11 session bytes (size 1 MiB,
                every transmission flag, chunked + base:allocation, min block 1),
                the input layout of fuzz_targets/request.rs.
Duplicates are dropped (requests: one per header form, command and flags).
"""

import hashlib
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

IHAVEOPT = 0x49484156454F5054
REQUEST_MAGIC = 0x25609513
EXTENDED_REQUEST_MAGIC = 0x21E41C71
OPT_NAMES = {1: "export-name", 2: "abort", 3: "list", 5: "starttls", 6: "info",
             7: "go", 8: "structured-reply", 9: "list-meta", 10: "set-meta",
             11: "extended-headers"}
CMD_NAMES = {0: "read", 1: "write", 2: "disc", 3: "flush", 4: "trim", 5: "cache",
             6: "write-zeroes", 7: "block-status"}
CMD_FLAG_PAYLOAD_LEN = 1 << 5
# Session bytes appended to request seeds: size, flags (HAS_FLAGS, SEND_FLUSH, FUA,
# TRIM, WRITE_ZEROES, DF, CACHE, FAST_ZERO), switches (chunked, base:allocation).
SESSION = struct.pack(">QHB", 1 << 20, 0x0001 | 0x0004 | 0x0008 | 0x0020 | 0x0040
                      | 0x0080 | 0x0400 | 0x0800, 0x03)


class Proxy:
    """Unix-socket proxy that records each connection's client->server bytes."""

    def __init__(self, listen, upstream):
        self.upstream = upstream
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(listen)
        self.sock.listen(16)
        self.label = "none"
        self.captures = []  # (label, bytearray)
        self.threads = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            u = socket.socket(socket.AF_UNIX)
            u.connect(self.upstream)
            log = bytearray()
            self.captures.append((self.label, log))
            t = threading.Thread(target=self._pump, args=(c, u, log), daemon=True)
            t.start()
            self.threads.append(t)
            threading.Thread(target=self._pump, args=(u, c, None), daemon=True).start()

    @staticmethod
    def _pump(src, dst, log):
        try:
            while True:
                b = src.recv(1 << 16)
                if not b:
                    break
                if log is not None:
                    log += b
                dst.sendall(b)
        except OSError:
            pass
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def wait(self):
        """Waits until every client so far has closed its side."""
        for t in self.threads:
            t.join(timeout=10)
        self.threads = []


def split(stream):
    """Splits one client stream into (handshake bytes, [(opt, data)], [request header])."""
    opts = []
    p = 4
    while p + 16 <= len(stream):
        magic, opt, ln = struct.unpack_from(">QII", stream, p)
        if magic != IHAVEOPT:
            break
        opts.append((opt, bytes(stream[p + 16:p + 16 + ln])))
        p += 16 + ln
        if opt in (1, 2):
            break
        if opt == 7:
            # GO succeeded if requests follow; otherwise the client goes on with options.
            if p + 4 <= len(stream) and struct.unpack_from(">I", stream, p)[0] in (
                    REQUEST_MAGIC, EXTENDED_REQUEST_MAGIC):
                break
    handshake = bytes(stream[:p])
    reqs = []
    while p + 28 <= len(stream):
        magic = struct.unpack_from(">I", stream, p)[0]
        if magic == REQUEST_MAGIC:
            flags, cmd, _cookie, _off, ln = struct.unpack_from(">HHQQI", stream, p + 4)
            hdr, payload = stream[p:p + 28], ln if cmd == 1 else 0
        elif magic == EXTENDED_REQUEST_MAGIC and p + 32 <= len(stream):
            flags, cmd, _cookie, _off, ln = struct.unpack_from(">HHQQQ", stream, p + 4)
            # qemu 10's client sends extended WRITEs *without* NBD_CMD_FLAG_PAYLOAD_LEN
            # (qemu-nbd takes the payload anyway), so a WRITE always carries one here.
            has = cmd == 1 or flags & CMD_FLAG_PAYLOAD_LEN
            hdr, payload = stream[p:p + 32], ln if has else 0
        else:
            break
        reqs.append(bytes(hdr))
        p += len(hdr) + payload
    return handshake, opts, reqs


def write_seeds(captures, outdir):
    for d in ("handshake", "options", "request"):
        shutil.rmtree(os.path.join(outdir, d), ignore_errors=True)
        os.makedirs(os.path.join(outdir, d))
    seen = set()
    n = 0

    def put(kind, name, data, key=None):
        nonlocal n
        key = (kind, key if key is not None else hashlib.sha1(data).digest())
        if key in seen:
            return
        seen.add(key)
        with open(os.path.join(outdir, kind, name), "wb") as f:
            f.write(data)
        n += 1

    for label, stream in captures:
        handshake, opts, reqs = split(stream)
        if len(handshake) < 4:
            continue
        # Split byte 0xff: big pieces. Also one byte-by-byte-ish copy of the first.
        put("handshake", f"{label}", b"\xff" + handshake, key=handshake)
        for opt, data in opts:
            if opt in (6, 7, 9, 10):
                put("options", f"{label}-{OPT_NAMES[opt]}", data)
        for h in reqs:
            ext = len(h) == 32
            flags, cmd = struct.unpack_from(">HH", h, 4)
            key = (ext, cmd, flags)
            name = f"{label}-{'ext' if ext else 'compact'}-{CMD_NAMES.get(cmd, cmd)}-f{flags:x}"
            put("request", name, bytes([int(ext)]) + h + SESSION, key=key)
    if captures:
        put("handshake", "short-pieces", b"\x02" + split(captures[0][1])[0], key="short")
    return n


def main():
    root = os.path.dirname(os.path.abspath(__file__))
    outdir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(root, "seeds")
    tmp = tempfile.mkdtemp(prefix="ferry-capture-")
    procs = []
    try:
        kit, qemu = os.path.join(tmp, "kit.sock"), os.path.join(tmp, "qemu.sock")
        img, src = os.path.join(tmp, "disk.raw"), os.path.join(tmp, "src.raw")
        # Source image: data, a hole, zeroes, data again.
        with open(src, "wb") as f:
            f.truncate(1 << 20)
            f.write(b"\x55" * 65536)
            f.seek(512 << 10)
            f.write(b"\0" * 65536 + b"\xaa" * 4096)
        subprocess.run(["qemu-img", "create", "-q", "-f", "raw", img, "1M"], check=True)
        procs.append(subprocess.Popen(["nbdkit", "-f", "-U", kit, "memory", "1M"]))
        procs.append(subprocess.Popen(["qemu-nbd", "-t", "-e", "8", "-f", "raw",
                                       "-k", qemu, img]))
        for s in (kit, qemu):
            for _ in range(100):
                if os.path.exists(s):
                    break
                time.sleep(0.05)
        pk = Proxy(os.path.join(tmp, "kit-proxy.sock"), kit)
        pq = Proxy(os.path.join(tmp, "qemu-proxy.sock"), qemu)
        uk = f"nbd+unix:///?socket={tmp}/kit-proxy.sock"
        uq = f"nbd+unix:///?socket={tmp}/qemu-proxy.sock"

        nbdsh_io = """
h.add_meta_context(nbd.CONTEXT_BASE_ALLOCATION)
h.connect_uri(URI)
h.pwrite(b"\\x55" * 65536, 0)
h.pwrite(b"\\x66" * 4096, 65536, nbd.CMD_FLAG_FUA)
h.pread(4096, 0)
h.pread_structured(4096, 0, lambda *a: 0, nbd.CMD_FLAG_DF)
h.flush()
h.trim(4096, 8192)
h.zero(8192, 16384)
h.zero(8192, 16384, nbd.CMD_FLAG_NO_HOLE)
if h.can_fast_zero(): h.zero(4096, 32768, nbd.CMD_FLAG_FAST_ZERO)
if h.can_cache(): h.cache(4096, 0)
h.block_status(1 << 20, 0, lambda *a: 0)
h.block_status(1 << 20, 0, lambda *a: 0, nbd.CMD_FLAG_REQ_ONE)
h.shutdown()
"""
        nbdsh_opts = """
h.set_opt_mode(True)
h.connect_uri(URI)
h.opt_list(lambda name, desc: 0)
h.opt_info()
h.opt_list_meta_context(lambda name: 0)
h.opt_abort()
"""
        nbdsh_oldstyle = """
h.set_handshake_flags(0)
h.set_request_structured_replies(False)
h.connect_uri(URI)
h.pread(512, 0)
h.shutdown()
"""
        qemu_io = ["-c", "write -P 0x55 0 64k", "-c", "write -f -P 0x66 64k 4k",
                   "-c", "write -z 128k 64k", "-c", "write -z -u 192k 64k",
                   "-c", "discard 256k 64k", "-c", "read 0 64k", "-c", "flush"]
        runs = [
            (pk, "libnbd-json", ["nbdinfo", "--json", uk]),
            (pk, "libnbd-list", ["nbdinfo", "--list", uk]),
            (pk, "libnbd-map", ["nbdinfo", "--map", uk]),
            (pk, "libnbd-io", ["nbdsh", "-c", f"URI={uk!r}", "-c", nbdsh_io]),
            (pk, "libnbd-opts", ["nbdsh", "-c", f"URI={uk!r}", "-c", nbdsh_opts]),
            (pk, "libnbd-oldstyle", ["nbdsh", "-c", f"URI={uk!r}", "-c", nbdsh_oldstyle]),
            (pk, "nbdcopy", ["nbdcopy", src, uk]),
            (pk, "qemu-kit-info", ["qemu-img", "info", uk]),
            (pk, "qemu-kit-io", ["qemu-io", "-f", "raw", uk] + qemu_io),
            (pq, "libnbd-qemu-json", ["nbdinfo", "--json", uq]),
            (pq, "qemu-info", ["qemu-img", "info", uq]),
            (pq, "qemu-map", ["qemu-img", "map", "-f", "raw", "--output=json", uq]),
            (pq, "qemu-convert-to", ["qemu-img", "convert", "-n", "-f", "raw", "-O", "raw",
                                     src, uq]),
            (pq, "qemu-convert-from", ["qemu-img", "convert", "-f", "raw", "-O", "raw", uq,
                                       os.path.join(tmp, "out.raw")]),
            (pq, "qemu-io", ["qemu-io", "-f", "raw", uq] + qemu_io),
        ]
        # nbdsh runs `python3` from PATH and needs Debian's python3-libnbd.
        env = dict(os.environ, PATH="/usr/bin:" + os.environ.get("PATH", ""))
        captures = []
        for proxy, label, cmd in runs:
            proxy.label = label
            before = len(proxy.captures)
            r = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               timeout=60, env=env)
            proxy.wait()
            new = proxy.captures[before:]
            print(f"{label}: exit {r.returncode}, {len(new)} connection(s), "
                  f"{sum(len(b) for _, b in new)} bytes", file=sys.stderr)
            if r.returncode != 0:
                print(r.stderr.decode(errors="replace"), file=sys.stderr)
            for i, (_, b) in enumerate(new):
                captures.append((label if len(new) == 1 else f"{label}{i}", b))
        n = write_seeds(captures, outdir)
        print(f"wrote {n} seeds under {outdir}", file=sys.stderr)
    finally:
        for p in procs:
            p.terminate()
            p.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
