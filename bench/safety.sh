#!/usr/bin/env bash
# Data safety (issue 19): what image locking, metadata-overlap checks and cluster reuse
# cost. Two ferry binaries (BEFORE and AFTER, e.g. main before the change and after it)
# and qemu-nbd, measured in the same run, rounds interleaved so noise hits all alike.
#
#   BEFORE=/tmp/ferry-before AFTER=target/release/ferry bench/safety.sh
#   SIZE_G=1 RUNS=3 BENCH_DIR=/dev/shm   (defaults)
#
# Rows: reading a raw file export (ferry copy to null:), writing one (nbdcopy), fio 4k
# random writes on a raw export and on a qcow2 export (allocated, and empty: every write
# allocates), nbdcopy --flush into a new qcow2, and ferry copy raw -> qcow2. Figures are
# medians of RUNS rounds: GiB/s of the guest size, or IOPS.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/lib.sh"
BEFORE=${BEFORE:?path of the ferry binary before the change}
AFTER=${AFTER:-$PWD/target/release/ferry}
SIZE_G=${SIZE_G:-1}
RUNS=${RUNS:-3}
W=$(mktemp -d "${BENCH_DIR:-/dev/shm}/safety.XXXX") || exit 1
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; rm -rf "$W"; }
trap cleanup EXIT
for t in qemu-img qemu-nbd nbdcopy fio bc; do command -v $t >/dev/null || { echo "missing $t"; exit 1; }; done

echo "== making images in $W ($(date -u +%H:%M:%S))"
qcow2_images "$W" "$SIZE_G"
S=$W/s.sock
U="nbd+unix:///?socket=$S"
serve() { # WHO IMG FMT
  rm -f "$S"
  case $1 in
    before) "$BEFORE" serve --unix "$S" "$3:$2" 2>/dev/null & ;;
    after) "$AFTER" serve --unix "$S" "$3:$2" 2>/dev/null & ;;
    qemu) qemu-nbd -f "$3" --shared=8 --persistent -k "$S" "$2" 2>/dev/null & ;;
  esac
  SERVER=$!; pids+=($!); wait_sock "$S"
}
stop() { kill "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null; rm -f "$S"; }
fio_iops() { # rw
  fio --name=q --ioengine=nbd --uri="$U" --rw="$1" --bs=4k --iodepth=32 --numjobs=1 \
      --time_based --runtime=5 --size=$((SIZE_G<<30)) --output-format=json 2>/dev/null |
    sed -n '/^{/,$p' | python3 -c "import json,sys; j=json.load(sys.stdin)['jobs'][0]; print(int(j['read']['iops']+j['write']['iops']))" 2>/dev/null || echo FAIL
}
gib_of() { [ "$1" = FAIL ] && echo FAIL || echo "$SIZE_G / $1" | bc -l; }
declare -A v=()
add() { v[$1]="${v[$1]:-} $2"; }
bin() { case $1 in before) echo "$BEFORE" ;; *) echo "$AFTER" ;; esac; }
FILE_FMT=file # ferry's spec prefix for a raw file; qemu-nbd's -f raw
for round in $(seq "$RUNS"); do
  echo "== round $round ($(date -u +%H:%M:%S))"
  for who in before after qemu; do
    raw_fmt=$([ $who = qemu ] && echo raw || echo $FILE_FMT)
    serve $who "$W/data.raw" "$raw_fmt"
    add "$who read-raw" "$(gib_of "$(secs "$AFTER" copy "$U" null:)")"
    stop
    cp --sparse=always /dev/null "$W/dst.raw"; truncate -s $((SIZE_G<<30)) "$W/dst.raw"
    serve $who "$W/dst.raw" "$raw_fmt"
    add "$who write-raw" "$(gib_of "$(secs nbdcopy "$W/data.raw" "$U")")"
    add "$who fio-raw" "$(fio_iops randwrite)"
    stop
    cp "$W/data.qcow2" "$W/over.qcow2"
    serve $who "$W/over.qcow2" qcow2; add "$who fio-q2-over" "$(fio_iops randwrite)"; stop
    rm -f "$W/e.qcow2"; qemu-img create -q -f qcow2 "$W/e.qcow2" $((SIZE_G<<30))
    serve $who "$W/e.qcow2" qcow2; add "$who fio-q2-empty" "$(fio_iops randwrite)"; stop
    rm -f "$W/e.qcow2"; qemu-img create -q -f qcow2 "$W/e.qcow2" $((SIZE_G<<30))
    serve $who "$W/e.qcow2" qcow2
    add "$who write-q2" "$(gib_of "$(secs nbdcopy --flush "$W/data.raw" "$U")")"
    stop
    if [ $who != qemu ]; then
      add "$who conv-q2" "$(gib_of "$(secs sh -c "rm -f '$W/c.qcow2'; '$(bin $who)' copy '$W/data.raw' '$W/c.qcow2'")")"
    fi
    rm -f "$W/over.qcow2" "$W/e.qcow2" "$W/dst.raw" "$W/c.qcow2"
  done
done
ratio() { [ "$1" = fail ] || [ "$2" = fail ] && { echo "-"; return; }; printf "%.2f" "$(echo "$1 / $2" | bc -l)"; }
medv() { printf '%s\n' $1 | grep -v FAIL | med; }
fmt() { local m; m=$(medv "$1"); [ -z "$m" ] && { echo fail; return; }; case $2 in g) printf "%.2f" "$m" ;; *) printf "%.0f" "$m" ;; esac; }
echo
echo "| row (median of $RUNS, $SIZE_G GiB) | ferry before | ferry after | after/before | qemu-nbd |"
echo "|---|---|---|---|---|"
row() { # key label unit
  local b a q; b=$(fmt "${v[before $1]:-}" "$3"); a=$(fmt "${v[after $1]:-}" "$3"); q=$(fmt "${v[qemu $1]:-}" "$3")
  [ "$1" = conv-q2 ] && q="-"
  echo "| $2 | $b | $a | $(ratio "$a" "$b") | $q |"
}
row read-raw "read raw export, ferry copy to null: (GiB/s)" g
row write-raw "write raw export, nbdcopy (GiB/s)" g
row fio-raw "fio 4k randwrite, raw export (IOPS)" i
row fio-q2-over "fio 4k randwrite, allocated qcow2 (IOPS)" i
row fio-q2-empty "fio 4k randwrite, empty qcow2 (IOPS)" i
row write-q2 "nbdcopy --flush into a new qcow2 (GiB/s)" g
row conv-q2 "ferry copy raw -> new qcow2 (GiB/s)" g
echo "== done $(date -u +%H:%M:%S)"
