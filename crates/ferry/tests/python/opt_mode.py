"""Option negotiation in libnbd's opt mode: LIST, INFO, LIST_META_CONTEXT, GO to a
missing export (fails, connection stays usable), then GO to a real one; and STARTTLS
offered by the client is declined so the session goes on in plain text.

usage: opt_mode.py URI DEFAULT_SIZE NAME NAME_SIZE DESCRIPTION
       (URI of the default export; NAME is an extra export)"""

import sys
from nbdtest import *

uri, default_size, name, name_size, description = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]

h = connect(uri, opt_mode=True)
check(h.aio_is_negotiating(), "opt mode: still negotiating after connect")

exports = []
n = h.opt_list(lambda nm, desc: exports.append((nm, desc)) or 0)
log("LIST:", exports)
names = [e[0] for e in exports]
check("" in names, f"the default export must be listed: {exports}")
check(name in names, f"export {name!r} must be listed: {exports}")
check_eq(n, len(exports), "opt_list return value")

contexts = []
n = h.opt_list_meta_context(lambda c: contexts.append(c) or 0)
log("LIST_META_CONTEXT:", contexts)
check(nbd.CONTEXT_BASE_ALLOCATION in contexts, f"base:allocation must be offered: {contexts}")

h.set_full_info(True)
h.set_export_name("")
h.opt_info()
check_eq(h.get_size(), default_size, "INFO size of the default export")
check_eq(h.get_export_description(), description, "INFO description of the default export")
log("ok: INFO default export")

h.set_export_name(name)
h.opt_info()
check_eq(h.get_size(), name_size, f"INFO size of export {name!r}")
log(f"ok: INFO {name!r}")

h.set_export_name("no-such-export")
try:
    h.opt_info()
    raise AssertionError("INFO for a missing export must fail")
except nbd.Error as e:
    log("ok: INFO missing export fails:", e.string)
check(h.aio_is_negotiating(), "connection still negotiating after a failed INFO")

try:
    h.opt_go()
    raise AssertionError("GO for a missing export must fail")
except nbd.Error as e:
    log("ok: GO missing export fails:", e.string)
check(h.aio_is_negotiating(), "connection still negotiating after a failed GO")

h.set_export_name(name)
h.opt_go()
check(h.aio_is_ready(), "ready after GO")
check_eq(h.get_size(), name_size, "size after GO")
check(h.can_meta_context(nbd.CONTEXT_BASE_ALLOCATION), "base:allocation negotiated by GO")
h.pwrite(b"named export", 4096)
check_eq(h.pread(12, 4096), b"named export", "I/O on the export chosen by GO")
h.shutdown()

# Abort from opt mode.
h = connect(uri, opt_mode=True)
h.opt_abort()
check(h.aio_is_closed() or h.aio_is_dead(), "closed after opt_abort")

# STARTTLS is answered with ERR_UNSUP; a client that merely allows TLS goes on in plain text.
h = nbd.NBD()
h.set_tls(nbd.TLS_ALLOW)
h.connect_uri(uri)
check(not h.get_tls_negotiated(), "TLS must not be negotiated")
check_eq(h.get_size(), default_size, "size over the plain session")
h.pread(4096, 0)
h.shutdown()
log("ok: STARTTLS declined, plain session works")

# A client that requires TLS fails cleanly.
h = nbd.NBD()
h.set_tls(nbd.TLS_REQUIRE)
try:
    h.connect_uri(uri)
    raise AssertionError("a TLS-only client must not connect to a plain server")
except nbd.Error as e:
    log("ok: TLS-required client refused:", e.string)
log("opt_mode: all checks passed")
