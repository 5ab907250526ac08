#!/usr/bin/env bash
# qcow2 <-> raw conversions only (issue 11), short and interleaved: each round runs every
# tool once on every conversion, so a burst of load from elsewhere hits all of them alike.
#
#   SIZE_G=1 ROUNDS=3 BENCH_DIR=/dev/shm bench/qcow2-convert.sh
#
# Images as in bench/qcow2.sh (64 KiB clusters, made by qemu-img): data.qcow2 (all
# allocated, AES-CTR bytes), half.qcow2 (every other MiB data, the rest unallocated),
# data.raw. Prints the median GiB/s of the guest size per tool, and CPU seconds (user+sys,
# from /usr/bin/time) beside it: on a shared machine the CPU a tool burns is steadier
# than its wall time. EXTRA_FERRY="-C 8" adds a ferry row with those options. Before each
# run the previous output is deleted and `sync` writes back what is dirty, so no tool pays
# for another's writeback (on a disk file system; neither tool syncs its own output).
# `qemu-img -C` is copy offloading (copy_file_range).
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/lib.sh"
FERRY=${FERRY:-$PWD/target/release/ferry}
SIZE_G=${SIZE_G:-1}
ROUNDS=${ROUNDS:-3}
W=$(mktemp -d "${BENCH_DIR:-/dev/shm}/q2c.XXXX") || exit 1
trap 'rm -rf "$W"' EXIT
command -v qemu-img >/dev/null || { echo "missing qemu-img"; exit 1; }
[ -x /usr/bin/time ] || { echo "missing /usr/bin/time"; exit 1; }

qcow2_images "$W" "$SIZE_G"

tools=("ferry" "qemu-img" "qemu-img -m 8 -W" "qemu-img -C")
[ -n "${EXTRA_FERRY:-}" ] && tools+=("ferry $EXTRA_FERRY")
# FERRY_OLD=PATH: another ferry binary (an earlier build) as one more column.
[ -n "${FERRY_OLD:-}" ] && tools+=("ferry-old")
cmd() { # TOOL SRC OUT FMT
  case $1 in
    ferry-old) echo "$FERRY_OLD copy $2 $3" ;;
    ferry*) echo "$FERRY copy ${1#ferry} $2 $3" ;;
    "qemu-img -m 8 -W") echo "qemu-img convert -m 8 -W -O $4 $2 $3" ;;
    "qemu-img -C") echo "qemu-img convert -C -O $4 $2 $3" ;;
    qemu-img) echo "qemu-img convert -O $4 $2 $3" ;;
  esac
}
convs=("data.qcow2 out.raw raw" "half.qcow2 out.raw raw" "data.raw out.qcow2 qcow2")
declare -A T=() C=()
echo "== $(date -u +%H:%M:%S) load: $(cut -d' ' -f1-3 /proc/loadavg)"
n=${#tools[@]}
for r in $(seq "$ROUNDS"); do
  for c in "${convs[@]}"; do
    set -- $c
    # Untimed, so the first timed tool also follows an output of this conversion just
    # deleted: on this VM the cost of a new file's pages depends on what was freed just
    # before (BENCHMARKING 13). The order rotates each round for the same reason.
    rm -f "$W/out.raw" "$W/out.qcow2"
    qemu-img convert -C -O "$3" "$W/$1" "$W/$2" || { echo "FAIL: warm-up $c"; exit 1; }
    for k in $(seq 0 $((n - 1))); do
      t=${tools[$(((k + r) % n))]}
      rm -f "$W/$2"
      sync
      /usr/bin/time -o "$W/t" -f "%e %U %S" $(cmd "$t" "$W/$1" "$W/$2" "$3") >/dev/null 2>&1 || { echo "FAIL: $t $c"; exit 1; }
      read -r e u s <"$W/t"
      T[$c|$t]+="$e "; C[$c|$t]+="$(echo "$u + $s" | bc -l) "
    done
  done
done
rm -f "$W/out.raw" "$W/out.qcow2"
echo "== $(date -u +%H:%M:%S) load: $(cut -d' ' -f1-3 /proc/loadavg)"
printf "| conversion |"; for t in "${tools[@]}"; do printf " %s GiB/s (CPU s) |" "$t"; done; echo
printf "|---|"; for t in "${tools[@]}"; do printf -- "---|"; done; echo
for c in "${convs[@]}"; do
  set -- $c
  printf "| %s -> %s |" "$1" "$3"
  for t in "${tools[@]}"; do
    m=$(tr ' ' '\n' <<<"${T[$c|$t]}" | grep . | med); cpu=$(tr ' ' '\n' <<<"${C[$c|$t]}" | grep . | med)
    printf " %.2f (%.2f) |" "$(echo "$SIZE_G / $m" | bc -l)" "$cpu"
  done
  echo
done
echo "every run, wall seconds (CPU seconds):"
for c in "${convs[@]}"; do
  for t in "${tools[@]}"; do
    printf "  %-26s %-18s" "${c% *}" "$t"; paste -d' ' <(tr ' ' '\n' <<<"${T[$c|$t]}" | grep .) <(tr ' ' '\n' <<<"${C[$c|$t]}" | grep .) | awk '{printf " %s(%s)", $1, $2}'; echo
  done
done
