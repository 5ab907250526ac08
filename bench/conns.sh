#!/usr/bin/env bash
# A busy client alone and beside 1,000 and 10,000 idle connections (issue 13), for
# ferry and the peers, in one run. Run from the project root after
# `cargo build --release`; prints a markdown table. Compare ratios within this run.
#
#   bench/conns.sh                    # 1000 and 10000 idle, 5 s busy, 5 rounds
#   IDLE="1000" BUSY=3 bench/conns.sh # quicker
#
# The busy load is `ferry bench conns`: 2 connections x 32 random 4 KiB reads in
# flight, alone and then beside the idle connections (medians of ROUNDS rounds); the
# server's RSS and threads are read from /proc with the idle connections open.
# Needs: nbdkit, qemu-utils (qemu-nbd), python3; a hard RLIMIT_NOFILE above 10,100.
set -u
FERRY=${FERRY:-$PWD/target/release/ferry}
IDLE=${IDLE:-"1000 10000"}
BUSY=${BUSY:-5}
ROUNDS=${ROUNDS:-5}
W=$(mktemp -d /dev/shm/ferry-conns.XXXX) || exit 1
trap 'kill $(jobs -p) 2>/dev/null; wait 2>/dev/null; rm -rf "$W"' EXIT
[ -x "$FERRY" ] || { echo "build ferry first: cargo build --release"; exit 1; }
. "$(dirname "$0")/lib.sh"
ulimit -n "$(ulimit -Hn)"
S=$W/s.sock
truncate -s 1G "$W/img"

# start NAME: a server on $S; sets $PID.
start() {
  rm -f "$S"
  case $1 in
    ferry) "$FERRY" serve -q -U "$S" memory:1G & ;;
    nbdkit) nbdkit -f -U "$S" memory 1G & ;;
    # qemu-nbd refuses clients beyond --shared (default 1); let it take them all.
    qemu-nbd) qemu-nbd -t -e 10100 -f raw -k "$S" "$W/img" 2>/dev/null & ;;
  esac
  PID=$!
  wait_sock "$S"
}
stop() { kill "$PID" 2>/dev/null; wait "$PID" 2>/dev/null; }

row() { # server idle json
  python3 - "$1" "$2" "$3" <<'PY'
import json, sys
srv, n, raw = sys.argv[1], sys.argv[2], sys.argv[3]
try:
    d = json.loads(raw.strip().splitlines()[-1])
except Exception:
    last = raw.strip().splitlines()[-1][:120] if raw.strip() else "no output"
    print(f"| {srv} | {n} | failed: {last} | | | | | | | | | | | | |")
    sys.exit()
a, b, w, r = d["alone"], d["beside_idle"], d["server"]["with_idle"], d["paired_ratio"]
pa, pb = a["latency_us"]["p99"], b["latency_us"]["p99"]
rounds = " ".join(f"{x/1e3:.0f}/{y/1e3:.0f}" for x, y in d["iops_rounds"])
c, o = d["server_cpu_us_per_request"], d["client_cpu_us_per_request"]
print(f"| {srv} | {n} | {a['iops']/1e3:.0f}k | {b['iops']/1e3:.0f}k | {r['iops']:.2f} | "
      f"{pa:.0f} | {pb:.0f} | {r['p99']:.2f} | {w['rss_kib']/1024:.0f} MiB, {w['threads']} threads | "
      f"{c['alone']:.2f} / {c['beside']:.2f} | {c['paired_ratio']:.2f} | {o['paired_ratio']:.2f} | "
      f"{d['idle_closed_by_server']} | {d['open_seconds']:.1f} | {rounds} |")
PY
}

echo "## Busy client (2 x 32 random 4 KiB reads) alone and beside idle connections, Unix socket"
echo "(medians of $ROUNDS rounds of $BUSY s, alone first in odd rounds and last in even ones; RSS and threads of"
echo "the server with the idle connections open)"
echo
echo "(ratios: median over the rounds of each round's beside/alone, paired so drift cancels)"
echo
echo "| server | idle | IOPS alone | IOPS beside | IOPS ratio | p99 us alone | p99 us beside | p99 ratio | server with idle | server CPU us/request alone / beside | server CPU ratio | bench CPU ratio | idle closed | s to open idle | kIOPS alone/beside per round |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
for srv in ${SERVERS:-ferry nbdkit qemu-nbd}; do
  for n in $IDLE; do
    if [ "$srv" = nbdkit ] && [ "$n" -gt "${NBDKIT_MAX:-2000}" ]; then
      # nbdkit runs a thread per connection plus its -t worker threads (16): 17 per
      # connection. Thousands would take every pid of the machine (kernel.pid_max),
      # starving other processes, so it is not tried.
      echo "| nbdkit | $n | not run: would need $((n * 17)) threads (17 per connection; kernel.pid_max is $(cat /proc/sys/kernel/pid_max)) | | | | | | | | | | | | |"
      continue
    fi
    start $srv
    rounds=$ROUNDS
    # qemu-nbd takes minutes to accept 10,000 connections (each one slower than the
    # last: 83 s with the shortest handshake, several times that with ferry's): one
    # round there, and only when asked for (QEMU_NBD_MANY=1).
    if [ "$srv" = qemu-nbd ] && [ "$n" -gt 2000 ]; then
      if [ -z "${QEMU_NBD_MANY:-}" ]; then
        echo "| qemu-nbd | $n | not run: accepting them takes minutes (QEMU_NBD_MANY=1 runs one round) | | | | | | | | | | | | |"
        continue
      fi
      rounds=1
    fi
    out=$(timeout 900 "$FERRY" bench conns "nbd+unix:///?socket=$S" --idle "$n" --busy-seconds "$BUSY" \
          --rounds "$rounds" --server-pid "$PID" --json 2>&1)
    row "$srv" "$n" "$out"
    stop
  done
done
