"""Starts `ferry serve` the way systemd socket activation does, then uses the export.

usage: socket_activation.py FERRY_BINARY

The listening socket is created here, passed as fd 3, and LISTEN_PID/LISTEN_FDS are set
to the pid of the process that execs ferry (sh's $$ survives exec), as systemd does.
"""
import os
import signal
import socket
import subprocess
import sys
import tempfile

import nbd

ferry = sys.argv[1]
# A server that ignores the passed socket never answers: fail instead of hanging.
signal.alarm(30)
with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "activated.sock")
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lsock.bind(path)
    lsock.listen(16)

    def child_setup():
        os.dup2(lsock.fileno(), 3)
        os.set_inheritable(3, True)

    proc = subprocess.Popen(
        ["sh", "-c", 'LISTEN_PID=$$ LISTEN_FDS=1 exec "$0" serve -U /nonexistent/unused.sock memory:1M', ferry],
        preexec_fn=child_setup,
        pass_fds=(),
        close_fds=False,
    )
    try:
        h = nbd.NBD()
        h.connect_unix(path)
        assert h.get_size() == 1 << 20, h.get_size()
        h.pwrite(b"activated" * 100, 4096)
        assert h.pread(900, 4096) == b"activated" * 100
        h.shutdown()
        print("socket activation ok")
    finally:
        proc.terminate()
        rc = proc.wait(timeout=10)
    assert rc == 0, f"ferry exited with {rc} after SIGTERM"
