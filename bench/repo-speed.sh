#!/usr/bin/env bash
# Restore and served random reads of one snapshot, two ferry binaries side by side with
# qemu-nbd, in one run (issue 35's two read figures). Prints a markdown table per round.
#
#   FERRY_A=old/ferry FERRY_B=target/release/ferry bash bench/repo-speed.sh
#   SIZE_G=2 ROUNDS=3 FIO_S=5 BENCH_DIR=/var/tmp bash bench/repo-speed.sh
#   PIN="taskset -c 0,1" ...   # the restores on two cores of a larger machine
#   RESTORE=no ...             # the served reads alone (no restores)
#
# The image is bench/repo.sh's (bench/repo-image.py: holes, random, text-like and sparse
# binary-like regions), SIZE_G GiB, backed up once by FERRY_A into a plain repository and
# converted into a qcow2 image (64 KiB clusters) for qemu-nbd. Then ROUNDS rounds, the
# binaries alternating within each (A first in odd rounds, B first in even ones):
# - restore: `ferry copy REPO::vm null:` (reading, decoding and checking alone) and
#   `ferry copy REPO::vm out.raw` (a new sparse file in BENCH_DIR, compared with the image
#   by cmp): wall and CPU (user + system) seconds, MB/s of the image's size;
# - served random reads: `ferry serve -r REPO::vm` and `qemu-nbd -r` on the qcow2 image,
#   each on a Unix socket, read first whole by nbdcopy to null: (as bench/repo.sh part 6
#   does before its fio), then fio 4 KiB random reads over the whole disk (ioengine nbd,
#   iodepth 64, FIO_S seconds): IOPS, and the server's CPU time (user + system) over fio's
#   run divided by its reads. The working set is the whole disk (its data chunks);
#   ferry's cache budget is printed beside it (FERRY_REPO_CACHE, else its default).
# Each round prints the load average; compare ratios within a round, and the median.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/lib.sh"
FERRY_A=${FERRY_A:?the binary before (FERRY_A=...)}
FERRY_B=${FERRY_B:-$PWD/target/release/ferry}
SIZE_G=${SIZE_G:-2}
ROUNDS=${ROUNDS:-3}
FIO_S=${FIO_S:-5}
# A command the restores run under, e.g. PIN="taskset -c 0,1" (two cores of a larger machine).
PIN=${PIN:-}
RESTORE=${RESTORE:-yes}
W=$(mktemp -d "${BENCH_DIR:-/var/tmp}/repo-speed.XXXX") || exit 1
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; rm -rf "$W"; }
trap cleanup EXIT
for t in openssl cmp python3; do command -v $t >/dev/null || { echo "missing $t"; exit 1; }; done
# Without these the served reads are left out (restore only), saying so.
SERVE=yes
for t in qemu-img qemu-nbd nbdcopy fio; do command -v $t >/dev/null || { echo "note: no $t: served reads not measured"; SERVE=no; }; done
[ $SERVE = yes ] && ! fio --enghelp 2>/dev/null | grep -qw nbd && { echo "note: this fio has no nbd engine: served reads not measured"; SERVE=no; }
SIZE=$((SIZE_G << 30))
stamp() { echo "$(date -u +%F\ %H:%M:%S) UTC, load average $(cut -d' ' -f1-3 /proc/loadavg)"; }
# cpu CMD...: "wall user+system" seconds of CMD (its output dropped), or FAIL.
cpu() {
  local TIMEFORMAT="%R %U %S" rc
  { time $PIN "$@" >/dev/null 2>&1; } 2>"$W/time"; rc=$?
  [ $rc = 0 ] || { echo FAIL; return; }
  tail -1 "$W/time" | awk '{printf "%.2f %.2f", $1, $2 + $3}'
}
# mbs SECONDS: MB/s of a restore of SIZE bytes in SECONDS; a failed one (FAIL) has none.
mbs() {
  case $1 in
    FAIL) echo "-" ;;
    *) awk -v s="$SIZE" -v t="$1" 'BEGIN { printf "%.0f", s / 1000000 / t }' ;;
  esac
}
# ticks PID: the CPU clock ticks (user + system) the process has used.
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
# iops SOCKET PID: "IOPS (CPU us a read)": fio's IOPS, and the server PID's CPU time
# over fio's reads (less moved by a busy machine than the IOPS).
iops() {
  local t0 t1
  t0=$(ticks "$2")
  fio --name=r --ioengine=nbd --uri="nbd+unix:///?socket=$1" --rw=randread --bs=4k --iodepth=64 \
    --runtime="$FIO_S" --time_based --output-format=json 2>/dev/null | sed -n '/^{/,$p' >"$W/fio.json"
  t1=$(ticks "$2")
  python3 -c 'import json,sys; r=json.load(open(sys.argv[1]))["jobs"][0]["read"]; us=(int(sys.argv[2])-int(sys.argv[3]))*1e6/int(sys.argv[4])/max(r["total_ios"],1); print("%d (%.1f us)" % (round(r["iops"]), us))' \
    "$W/fio.json" "$t1" "$t0" "$(getconf CLK_TCK)" 2>/dev/null || echo FAIL
}
# serve_iops NAME CMD...: CMD serves on $W/NAME.sock; nbdcopy reads it whole, then fio.
serve_iops() {
  local name=$1 sock=$W/$1.sock; shift
  rm -f "$sock"
  "$@" 2>"$W/$name.log" & local p=$!
  wait_sock "$sock"
  nbdcopy "nbd+unix:///?socket=$sock" null: >/dev/null 2>&1
  iops "$sock" $p
  kill $p 2>/dev/null; wait $p 2>/dev/null
}

python3 "$HERE/repo-image.py" "$W/disk.raw" "$SIZE"
"$FERRY_A" repo init "$W/repo" >/dev/null
"$FERRY_A" backup "$W/disk.raw" "$W/repo::vm" >/dev/null 2>&1 || { echo "backup failed"; exit 1; }
[ $SERVE = yes ] && qemu-img convert -f raw -O qcow2 -o cluster_size=65536 "$W/disk.raw" "$W/disk.qcow2"
DATA=$(du -B1 --apparent-size -s "$W/repo/data" | cut -f1)
echo "image: $SIZE_G GiB, $(du -B1 -s "$W/disk.raw" | cut -f1) bytes allocated; repository data $DATA bytes"
echo "A: $FERRY_A ($("$FERRY_A" --version | head -1)); B: $FERRY_B"
echo "ferry's cache budget: ${FERRY_REPO_CACHE:-its default}"
for r in $(seq "$ROUNDS"); do
  if [ $((r % 2)) = 1 ]; then order="A B"; else order="B A"; fi
  declare -A N F I
  for x in $order; do
    eval "bin=\$FERRY_$x"
    N[$x]=- F[$x]=-
    if [ "$RESTORE" != no ]; then
      N[$x]=$(cpu "$bin" copy "$W/repo::vm" null:)
      rm -f "$W/out.raw"
      F[$x]=$(cpu "$bin" copy "$W/repo::vm" "$W/out.raw")
      cmp -s "$W/out.raw" "$W/disk.raw" || F[$x]="$(echo "${F[$x]}") DIFFERS"
      rm -f "$W/out.raw"
    fi
    I[$x]=-
    [ $SERVE = yes ] && I[$x]=$(serve_iops "ferry$x" "$bin" serve -r -U "$W/ferry$x.sock" "$W/repo::vm")
  done
  Q=-
  [ $SERVE = yes ] && Q=$(serve_iops qemu qemu-nbd -t -r -f qcow2 -k "$W/qemu.sock" "$W/disk.qcow2")
  echo
  echo "== round $r of $ROUNDS ($(stamp)), $order"
  echo
  echo "| | restore to null: s (CPU s), MB/s | restore to a file: s (CPU s), MB/s | fio 4k randread IOPS (server CPU a read) |"
  echo "|---|---|---|---|"
  for x in A B; do
    n=- f=-
    if [ "$RESTORE" != no ]; then
      set -- ${N[$x]}; n="$1 (${2:-}), $(mbs "$1")"
      set -- ${F[$x]}; f="$1 (${2:-}), $(mbs "$1") ${3:-}"
    fi
    echo "| ferry $x | $n | $f | ${I[$x]} |"
  done
  echo "| qemu-nbd on the qcow2 | - | - | $Q |"
done
