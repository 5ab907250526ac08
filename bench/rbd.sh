#!/usr/bin/env bash
# ferry and its peers on Ceph RBD, side by side in one run, on a throwaway single-node
# cluster (scripts/ceph-cluster: one monitor, one memstore OSD, on the same cores as
# everything else). Data: SIZE_G GiB of AES-CTR bytes in RBD_DIR (default /dev/shm).
# Medians of 3 runs.
#   serve:  ferry serve rbd:rbd/src  vs  qemu-nbd -f raw rbd:rbd/src (Unix sockets),
#           read by nbdcopy -> null:, ferry copy -> null:, qemu-img convert -> a file in RBD_DIR,
#           and fio 4k randread/randwrite (iodepth 32, one connection, FIO_SECS s)
#   copy:   file -> rbd (a new image each time) and rbd -> file (in RBD_DIR):
#           ferry copy vs qemu-img convert vs rbd import/export
#   ceiling: rbd bench (librbd straight to the OSD, 16 threads)
# Needs qemu's rbd driver: apt-get install -t bookworm-backports qemu-block-extra.
# Run from the project root after `cargo build --release -p ferry`.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/lib.sh"
FERRY=${FERRY:-$PWD/target/release/ferry}
SIZE_G=${SIZE_G:-2}
FIO_SECS=${FIO_SECS:-10}
rbd_setup rbdb $((SIZE_G * 3 + 4))
rbd import --no-progress "$W/img" rbd/src
rbd create --size 1G rbd/fio
rbd bench --io-type write --io-size 4M --io-total 1G rbd/fio >/dev/null 2>&1

echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), SIZE_G=$SIZE_G, load: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "$(ceph --version | cut -d' ' -f1-3), $(qemu-img --version | head -1), $(nbdcopy --version | head -1), $(fio --version)"

# ---- serving ---------------------------------------------------------------------
serve() { # serve ferry|qemu IMAGE SOCKET
  case $1 in
  ferry) "$FERRY" serve -q --unix "$3" "rbd:rbd/$2" 2>/dev/null & ;;
  qemu) qemu-nbd -f raw -t -e 16 --cache=writeback --socket="$3" "rbd:rbd/$2" 2>/dev/null & ;;
  esac
  SERVER=$!
  wait_sock "$3"
}
fio_iops() { # fio_iops URI RW
  fio --name=b --ioengine=nbd --uri="$1" --rw="$2" --bs=4k --size=1G --iodepth=32 --time_based \
    --runtime="$FIO_SECS" --randrepeat=1 --output-format=terse 2>/dev/null |
    awk -F';' -v rw="$2" '/^3;/ {print (rw == "randread") ? $8 : $49}'
}
echo
echo "| serving rbd/src ($SIZE_G GiB) over a Unix socket | ferry serve | qemu-nbd | ferry/qemu-nbd |"
echo "|---|---|---|---|"
declare -A R TS
# Sequential reads: 3 rounds, the two servers alternating (the order rotates), one run
# of each client per round; medians.
order=(ferry qemu)
for round in 1 2 3; do
  for s in "${order[@]}"; do
    serve $s src "$W/$s.sock"
    U="nbd+unix:///?socket=$W/$s.sock"
    TS[$s,nbdcopy]+="$(secs nbdcopy "$U" null:) "
    TS[$s,ferry]+="$(secs "$FERRY" copy "$U" null:) "
    TS[$s,qemu]+="$(secs qemu-img convert -f raw -O raw "$U" "$W/out") "
    rm -f "$W/out"
    kill $SERVER; wait $SERVER 2>/dev/null
  done
  order=("${order[@]:1}" "${order[0]}")
done
for s in ferry qemu; do
  for c in nbdcopy ferry qemu; do
    t=$(echo ${TS[$s,$c]} | tr ' ' '\n' | grep -v FAIL | med)
    R[$s,$c]=$([ -n "$t" ] && printf "%.2f" "$(echo "$SIZE_G / $t" | bc -l)" || echo fail)
  done
  serve $s fio "$W/$s.sock"
  U="nbd+unix:///?socket=$W/$s.sock"
  R[$s,rr]=$(fio_iops "$U" randread)
  R[$s,rw]=$(fio_iops "$U" randwrite)
  kill $SERVER; wait $SERVER 2>/dev/null
done
row() { printf "| %s | %s | %s | %.2f |\n" "$1" "${R[ferry,$2]}" "${R[qemu,$2]}" "$(echo "${R[ferry,$2]} / ${R[qemu,$2]}" | bc -l)"; }
row "nbdcopy -> null: (GiB/s)" nbdcopy
row "ferry copy -> null: (GiB/s)" ferry
row "qemu-img convert -> file in ${RBD_DIR:-/dev/shm} (GiB/s)" qemu
row "fio 4k randread, iodepth 32 (IOPS)" rr
row "fio 4k randwrite, iodepth 32 (IOPS)" rw

# ---- copying ---------------------------------------------------------------------
echo
echo "| copy $SIZE_G GiB (GiB/s, median of 3 interleaved rounds) | ferry copy | qemu-img convert | rbd import/export |"
echo "|---|---|---|---|"
# Round by round, each tool in turn, so a burst of load from elsewhere hits all three.
declare -A T
# The order rotates each round, and every rbd -> file copy runs once untimed first: on
# this VM, memory a deleted output gave back returns slowly to whoever writes next
# (BENCHMARKING 13b), so the timed run starts right after the file it replaces is deleted.
order=(ferry qemu rbd)
for round in 1 2 3; do
  for t in "${order[@]}"; do
    rbd rm --no-progress rbd/dst >/dev/null 2>&1
    rm -f "$W/out"
    case $t in
    ferry) in=("$FERRY" copy "$W/img" rbd:rbd/dst) out=("$FERRY" copy rbd:rbd/src "$W/out") ;;
    qemu) in=(qemu-img convert -f raw -O raw "$W/img" rbd:rbd/dst) out=(qemu-img convert -f raw -O raw rbd:rbd/src "$W/out") ;;
    rbd) in=(rbd import --no-progress "$W/img" rbd/dst) out=(rbd export --no-progress rbd/src "$W/out") ;;
    esac
    T[$t,in]+="$(secs "${in[@]}") "
    # Only one image beside the source at a time: the memstore OSD keeps them in memory.
    rbd rm --no-progress rbd/dst >/dev/null 2>&1
    "${out[@]}" >/dev/null 2>&1
    rm -f "$W/out"
    o=$(secs "${out[@]}")
    T[$t,out]+="$o "
    if [ "$o" = FAIL ]; then
      echo "$t: rbd -> file FAILED (exit status non-zero)"
    elif ! cmp -s "$W/out" "$W/img"; then
      echo "$t: rbd -> file differs from the source!"
    fi
  done
  order=("${order[@]:1}" "${order[0]}")
done
rm -f "$W/out"
rbd rm --no-progress rbd/dst >/dev/null 2>&1
rate() { local t; t=$(echo $1 | tr ' ' '\n' | grep -v FAIL | med); printf "%.2f" "$(echo "$SIZE_G / $t" | bc -l)"; }
echo "| file -> rbd (new image) | $(rate "${T[ferry,in]}") | $(rate "${T[qemu,in]}") | $(rate "${T[rbd,in]}") |"
echo "| rbd -> file (${RBD_DIR:-/dev/shm}) | $(rate "${T[ferry,out]}") | $(rate "${T[qemu,out]}") | $(rate "${T[rbd,out]}") |"

# ---- the cluster's own ceiling -----------------------------------------------------
echo
echo "| rbd bench, 16 threads | result |"
echo "|---|---|"
bench() { rbd bench --io-threads 16 "$@" 2>&1 | awk '/elapsed/ {print}' | sed 's/  */ /g'; }
echo "| write 4M seq, $SIZE_G GiB | $(bench --io-type write --io-size 4M --io-total ${SIZE_G}G rbd/src) |"
echo "| read 4M seq, $SIZE_G GiB | $(bench --io-type read --io-size 4M --io-total ${SIZE_G}G rbd/src) |"
echo "| write 4k rand, 256 MiB | $(bench --io-type write --io-size 4K --io-pattern rand --io-total 256M rbd/fio) |"
echo "| read 4k rand, 256 MiB | $(bench --io-type read --io-size 4K --io-pattern rand --io-total 256M rbd/fio) |"
