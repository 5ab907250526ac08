#!/usr/bin/env bash
# qcow2: ferry against qemu's own tools, side by side in one run (issue 11's targets).
#
#   bench/qcow2.sh            # from the project root, after cargo build --release -p ferry
#   SIZE_G=4 COMP_G=1 RUNS=3 BENCH_DIR=/dev/shm bench/qcow2.sh   (needs ~15 GiB there at 4 GiB)
#
# Images (64 KiB clusters, made by qemu-img): data.qcow2 (SIZE_G GiB of incompressible
# data), half.qcow2 (every other MiB data, the rest unallocated), comp.qcow2 (COMP_G GiB
# of compressible data, qemu-img convert -c, zlib).
#  1. serving for reading: ferry serve vs qemu-nbd -f qcow2 (--shared=8, defaults
#     otherwise), each read whole by nbdcopy and by ferry copy to null:, over a Unix socket;
#  2. serving for writing: nbdcopy --flush of the raw data into a new empty qcow2 served
#     by each;
#  3. converting: ferry copy vs qemu-img convert (and -m 8 -W) qcow2 -> raw and raw -> qcow2;
#  4. fio 4k random reads and writes (nbd engine, iodepth 32, 1 job, 8 s) on each export:
#     reads of data.qcow2, writes over a copy of data.qcow2 (clusters already allocated)
#     and into an empty image (every write allocates a cluster and copies the rest of it).
# Copies: median seconds of RUNS runs, in GiB/s of the guest size; fio: IOPS.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/lib.sh"
FERRY=${FERRY:-$PWD/target/release/ferry}
SIZE_G=${SIZE_G:-4}
COMP_G=${COMP_G:-1}
RUNS=${RUNS:-3}
W=$(mktemp -d "${BENCH_DIR:-/dev/shm}/q2.XXXX") || exit 1
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; rm -rf "$W"; }
trap cleanup EXIT
for t in qemu-img qemu-nbd nbdcopy fio; do command -v $t >/dev/null || { echo "missing $t"; exit 1; }; done

echo "== making images in $W ($(date -u +%H:%M:%S))"
qcow2_images "$W" "$SIZE_G"
# Compressible: hex text of random bytes (about 2:1 under zlib).
openssl enc -aes-128-ctr -pass pass:comp -nosalt -pbkdf2 </dev/zero 2>/dev/null | head -c $((COMP_G<<29)) | od -An -v -tx1 -w32 | head -c $((COMP_G<<30)) > "$W/comp.raw"
qemu-img convert -c -m 8 -W -f raw -O qcow2 "$W/comp.raw" "$W/comp.qcow2"; rm -f "$W/comp.raw"
ls -la "$W"

gsize() { case $1 in comp) echo "$COMP_G" ;; *) echo "$SIZE_G" ;; esac; }
rate() { # GIB CMD... -> GiB/s of the median of RUNS runs
  local g=$1; shift
  local t; t=$(for i in $(seq "$RUNS"); do secs "$@"; done | grep -v FAIL | med)
  [ -z "$t" ] && { echo fail; return; }
  printf "%.2f" "$(echo "$g / $t" | bc -l)"
}
serve() { # NAME SOCK IMG [ro]
  local ro=(); [ "${4:-}" = ro ] && ro=(1)
  case $1 in
    ferry) "$FERRY" serve -U "$2" ${ro:+--read-only} "$3" 2>/dev/null & ;;
    qemu) qemu-nbd -f qcow2 --shared=8 --persistent -k "$2" ${ro:+-r} "$3" 2>/dev/null & ;;
  esac
  pids+=($!); SERVER=$!
  wait_sock "$2"
}
stop() { kill "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null; rm -f "$1"; }
ratio() { [ "$1" = fail ] || [ "$2" = fail ] && { echo "-"; return; }; printf "%.2f" "$(echo "$1 / $2" | bc -l)"; }

echo; echo "== 1. serving for reading ($(date -u +%H:%M:%S))"
echo "| image | client | ferry serve GiB/s | qemu-nbd GiB/s | ferry/qemu |"
echo "|---|---|---|---|---|"
for img in data half comp; do
  declare -A r=()
  for srv in ferry qemu; do
    S=$W/$srv.sock; serve $srv "$S" "$W/$img.qcow2" ro
    U="nbd+unix:///?socket=$S"
    r[$srv-nbdcopy]=$(rate "$(gsize $img)" nbdcopy "$U" null:)
    r[$srv-ferry]=$(rate "$(gsize $img)" "$FERRY" copy "$U" null:)
    stop "$S"
  done
  for c in nbdcopy ferry; do
    echo "| $img | $([ $c = ferry ] && echo "ferry copy" || echo nbdcopy) | ${r[ferry-$c]} | ${r[qemu-$c]} | $(ratio "${r[ferry-$c]}" "${r[qemu-$c]}") |"
  done
done

echo; echo "== 2. serving for writing ($(date -u +%H:%M:%S))"
echo "| nbdcopy --flush data.raw -> new qcow2 | ferry serve GiB/s | qemu-nbd GiB/s | ferry/qemu |"
echo "|---|---|---|---|"
declare -A w=()
for srv in ferry qemu; do
  ts=()
  for i in $(seq "$RUNS"); do
    rm -f "$W/w.qcow2"; qemu-img create -q -f qcow2 "$W/w.qcow2" $((SIZE_G<<30))
    S=$W/$srv.sock; serve $srv "$S" "$W/w.qcow2"
    ts+=("$(secs nbdcopy --flush "$W/data.raw" "nbd+unix:///?socket=$S")")
    stop "$S"
  done
  check=$(qemu-img check "$W/w.qcow2" 2>&1 | head -1)
  w[$srv]=$(printf "%.2f" "$(echo "$SIZE_G / $(printf '%s\n' "${ts[@]}" | grep -v FAIL | med)" | bc -l)")
  echo "  $srv: qemu-img check: $check" >&2
done
echo "| $SIZE_G GiB | ${w[ferry]} | ${w[qemu]} | $(ratio "${w[ferry]}" "${w[qemu]}") |"
rm -f "$W/w.qcow2"

echo; echo "== 3. converting ($(date -u +%H:%M:%S))"
echo "| conversion | ferry copy GiB/s | qemu-img convert GiB/s | qemu-img convert -m 8 -W GiB/s | ferry/best qemu |"
echo "|---|---|---|---|---|"
conv() { # label GIB SRC OUT FMT
  local f q qw
  f=$(rate "$2" sh -c "rm -f '$4'; '$FERRY' copy '$3' '$4'")
  q=$(rate "$2" sh -c "rm -f '$4'; qemu-img convert -O $5 '$3' '$4'")
  qw=$(rate "$2" sh -c "rm -f '$4'; qemu-img convert -m 8 -W -O $5 '$3' '$4'")
  best=$q; [ "$(echo "$qw > $q" | bc -l)" = 1 ] && best=$qw
  echo "| $1 | $f | $q | $qw | $(ratio "$f" "$best") |"
  rm -f "$4"
}
conv "data.qcow2 -> raw" "$SIZE_G" "$W/data.qcow2" "$W/out.raw" raw
conv "comp.qcow2 -> raw" "$COMP_G" "$W/comp.qcow2" "$W/out.raw" raw
conv "half.qcow2 -> raw" "$SIZE_G" "$W/half.qcow2" "$W/out.raw" raw
conv "data.raw -> qcow2" "$SIZE_G" "$W/data.raw" "$W/out.qcow2" qcow2

echo; echo "== 4. fio 4k random I/O, iodepth 32, 8 s ($(date -u +%H:%M:%S))"
fio_iops() { # URI rw
  fio --name=q --ioengine=nbd --uri="$1" --rw="$2" --bs=4k --iodepth=32 --numjobs=1 \
      --time_based --runtime=8 --size=$((SIZE_G<<30)) --output-format=json 2>/dev/null |
    sed -n '/^{/,$p' | python3 -c "import json,sys; j=json.load(sys.stdin)['jobs'][0]; print(int(j['read']['iops']+j['write']['iops']))" 2>/dev/null || echo fail
}
echo "| fio 4k | ferry serve IOPS | qemu-nbd IOPS | ferry/qemu |"
echo "|---|---|---|---|"
declare -A f=()
for srv in ferry qemu; do
  S=$W/$srv.sock
  serve $srv "$S" "$W/data.qcow2" ro; f[$srv-r]=$(fio_iops "nbd+unix:///?socket=$S" randread); stop "$S"
  cp "$W/data.qcow2" "$W/over.qcow2"
  serve $srv "$S" "$W/over.qcow2"; f[$srv-o]=$(fio_iops "nbd+unix:///?socket=$S" randwrite); stop "$S"
  rm -f "$W/over.qcow2" "$W/empty.qcow2"; qemu-img create -q -f qcow2 "$W/empty.qcow2" $((SIZE_G<<30))
  serve $srv "$S" "$W/empty.qcow2"; f[$srv-a]=$(fio_iops "nbd+unix:///?socket=$S" randwrite); stop "$S"
  echo "  $srv: empty image after random writes: $(qemu-img check "$W/empty.qcow2" 2>&1 | head -1)" >&2
  rm -f "$W/empty.qcow2"
done
echo "| randread data.qcow2 | ${f[ferry-r]} | ${f[qemu-r]} | $(ratio "${f[ferry-r]}" "${f[qemu-r]}") |"
echo "| randwrite over allocated clusters | ${f[ferry-o]} | ${f[qemu-o]} | $(ratio "${f[ferry-o]}" "${f[qemu-o]}") |"
echo "| randwrite into an empty image | ${f[ferry-a]} | ${f[qemu-a]} | $(ratio "${f[ferry-a]}" "${f[qemu-a]}") |"
echo "== done $(date -u +%H:%M:%S)"
