#!/usr/bin/env bash
# Reads in flight on ONE connection to `ferry serve rbd:...` (issue 12): qemu-img convert
# (one connection, several requests in flight) and nbdcopy (4 connections by default),
# reading SIZE_G GiB through ferry serve (and FERRY_BEFORE, an older build, if set) and
# qemu-nbd, on the throwaway cluster of scripts/ceph-cluster. 3 interleaved rounds,
# medians in GiB/s; every qemu-img output is compared with the source.
# Run from the project root after `cargo build --release -p ferry --features ferry/rbd`.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/lib.sh"
FERRY=${FERRY:-$PWD/target/release/ferry}
FERRY_BEFORE=${FERRY_BEFORE:-}
SIZE_G=${SIZE_G:-1}
rbd_setup rbdi $((SIZE_G * 2 + 4))
rbd import --no-progress "$W/img" rbd/src
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), SIZE_G=$SIZE_G, load: $(cut -d' ' -f1-3 /proc/loadavg)"
servers="ferry qemu"
[ -n "$FERRY_BEFORE" ] && servers="before ferry qemu"
serve() { # serve ferry|before|qemu SOCKET
  case $1 in
  ferry) "$FERRY" serve -q --unix "$2" rbd:rbd/src 2>/dev/null & ;;
  before) "$FERRY_BEFORE" serve -q --unix "$2" rbd:rbd/src 2>/dev/null & ;;
  qemu) qemu-nbd -f raw -t -e 16 --cache=writeback --socket="$2" rbd:rbd/src 2>/dev/null & ;;
  esac
  SERVER=$!
  wait_sock "$2"
}
declare -A T
for round in 1 2 3; do
  for s in $servers; do
    serve $s "$W/$s.sock"
    U="nbd+unix:///?socket=$W/$s.sock"
    T[$s,qemu]+="$(secs qemu-img convert -f raw -O raw "$U" "$W/out") "
    cmp -s "$W/img" "$W/out" || echo "WRONG DATA from $s" >&2
    rm -f "$W/out"
    T[$s,nbdcopy]+="$(secs nbdcopy "$U" null:) "
    kill $SERVER
    wait $SERVER 2>/dev/null
    rm -f "$W/$s.sock"
  done
done
rate() { printf "%.2f" "$(echo "$SIZE_G / $(echo ${T[$1,$2]} | tr ' ' '\n' | med)" | bc -l)"; }
echo "| GiB/s, median of 3 | ${servers// / | } | ferry/qemu-nbd |"
sep="|---|---|"
for s in $servers; do sep+="---|"; done
echo "$sep"
for c in qemu nbdcopy; do
  row="| $c |"
  for s in $servers; do row+=" $(rate $s $c) |"; done
  echo "$row $(printf "%.2f" "$(echo "$(rate ferry $c) / $(rate qemu $c)" | bc -l)") |"
done
echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)"
