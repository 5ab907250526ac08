#!/usr/bin/env bash
# Incremental backup: ferry against qemu's tools and a libnbd Python script, side by side
# in one run (issue 20's targets). Prints markdown tables.
#
#   bash bench/backup.sh          # from the project root, after cargo build --release -p ferry
#   BIG_T=1 EXTENTS=100000 SIZE_G=4 DIRTY_PCT=2 RUNS=3 BENCH_DIR=/var/tmp bash bench/backup.sh
#   PARTS=2 bash bench/backup.sh  # only part 2 (PARTS="1 2" by default)
#
# 1. Extent query: a BIG_T TiB qcow2 image (64 KiB clusters) with EXTENTS scattered dirty
#    extents in the persistent bitmap b0. Made fast: qemu-img bitmap --add b0, then
#    qemu-nbd (read-write) and python3-libnbd write EXTENTS 4 KiB blocks, one in each of
#    EXTENTS equal stripes at a random 64 KiB-aligned offset (no two adjacent, so exactly
#    EXTENTS dirty extents), then qemu-nbd stops cleanly (SIGTERM) and stores b0.
#    Servers: `qemu-nbd -r -B b0` and `ferry serve -r -B b0`, both up for the whole run on
#    Unix sockets. Clients: `nbdinfo --map=qemu:dirty-bitmap:b0`, `ferry info
#    --map=qemu:dirty-bitmap:b0`, and bench/nbd_map_query.py (libnbd Python sending
#    nbdinfo's requests without printing: mostly the server's time). 6 cells, RUNS repetitions interleaved (every cell once per
#    round), median wall seconds of the client (the server's start is not counted). The
#    "same" column says whether the client printed the same map from both servers, and
#    whether it has EXTENTS dirty lines. A last row times each server cold: from its start
#    (opening the image and loading b0) to the end of the first full nbdinfo map.
# 2. Incremental backup of a SIZE_G GiB image (all allocated, incompressible data) with
#    DIRTY_PCT % of its 64 KiB granules dirty, scattered (a 4 KiB write in each, random
#    granules), from `qemu-nbd -r -B b0` on a Unix socket; every copy writes a qcow2 file
#    in BENCH_DIR:
#      - full `ferry copy URI full.qcow2` (and `qemu-img convert -O qcow2 URI` for scale);
#      - `ferry copy --dirty-bitmap b0 --backing base.qcow2 URI inc.qcow2`;
#      - bench/nbd_incremental.py --bitmap b0 URI OVERLAY: the way virtnbdbackup does it
#        (dirty map with block_status, then pread of each dirty extent and pwrite at its
#        offset), into a `qemu-img create -b base.qcow2` overlay served by qemu-nbd. Only the
#        script is timed (the overlay's creation and qemu-nbd's start are not), which
#        favours it.
#    Median wall seconds of RUNS runs (interleaved), and the share of the full copy. The
#    last output of each is checked: `qemu-img compare` with the export.
# Needs qemu-img, qemu-nbd, nbdinfo, python3-libnbd, openssl. Disk: about SIZE_G*3 GiB plus
# EXTENTS*64 KiB (apparent; less on disk) in BENCH_DIR (default /var/tmp).
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/lib.sh"
FERRY=${FERRY:-$PWD/target/release/ferry}
PY=${PY:-/usr/bin/python3}
BIG_T=${BIG_T:-1}
EXTENTS=${EXTENTS:-100000}
SIZE_G=${SIZE_G:-4}
DIRTY_PCT=${DIRTY_PCT:-2}
RUNS=${RUNS:-3}
PARTS=${PARTS:-1 2}
W=$(mktemp -d "${BENCH_DIR:-/var/tmp}/backup.XXXX") || exit 1
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; rm -rf "$W"; }
trap cleanup EXIT
for t in qemu-img qemu-nbd nbdinfo openssl bc; do command -v $t >/dev/null || { echo "missing $t"; exit 1; }; done
$PY -c 'import nbd' || { echo "missing python3-libnbd"; exit 1; }
[ -x "$FERRY" ] || echo "note: $FERRY missing; ferry cells will say FAIL"

# dirty IMAGE COUNT MODE: qemu-nbd (read-write) on IMAGE and COUNT 4 KiB writes through
# libnbd; MODE stripes: one per equal stripe (never adjacent); random: distinct random
# 64 KiB granules. Stops qemu-nbd with SIGTERM so the bitmaps are stored.
dirty() {
  local sock=$W/dirty.sock
  qemu-nbd -t -f qcow2 --cache=unsafe -k "$sock" "$1" & local p=$!
  wait_sock "$sock"
  $PY - "nbd+unix:///?socket=$sock" "$2" "$3" <<'EOF'
import nbd, random, sys
uri, count, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
h = nbd.NBD(); h.connect_uri(uri)
g = 65536; granules = h.get_size() // g
rnd = random.Random(20)
if mode == "stripes":
    stripe = granules // count
    assert stripe >= 3, "too many extents for the size"
    offs = [(i * stripe + rnd.randrange(stripe - 1)) * g for i in range(count)]
else:
    offs = sorted(rnd.sample(range(granules), count))
    offs = [o * g for o in offs]
buf = bytes(rnd.getrandbits(8) for _ in range(4096))
inflight = 0
for o in offs:
    while h.aio_in_flight() >= 64:
        h.poll(-1)
    h.aio_pwrite(buf, o + rnd.randrange(16) * 4096)
while h.aio_in_flight() > 0:
    h.poll(-1)
h.flush(); h.shutdown()
EOF
  kill -TERM $p; wait $p
}

# serve_qemu NAME IMAGE / serve_ferry NAME IMAGE: a read-only export of IMAGE with b0 on
# $W/NAME.sock, stopped on exit.
serve_qemu() { qemu-nbd -t -r -B b0 -f qcow2 -k "$W/$1.sock" "$2" 2>"$W/$1.log" & pids+=($!); wait_sock "$W/$1.sock"; }
serve_ferry() { "$FERRY" serve -r -B b0 -U "$W/$1.sock" "$2" 2>"$W/$1.log" & pids+=($!); wait_sock "$W/$1.sock"; }
uri() { echo "nbd+unix:///?socket=$W/$1.sock"; }
# med_of "T1 T2 FAIL ...": median of the times that did not fail, 3 decimals (or FAIL).
med_of() { local m; m=$(echo "$1" | tr ' ' '\n' | grep -v '^$' | grep -v FAIL | med); [ -n "$m" ] && printf "%.3f\n" "$m" || echo FAIL; }
stop_all() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; pids=(); }

if [[ " $PARTS " == *" 1 "* ]]; then
echo "== 1. extent query: ${BIG_T} TiB qcow2, $EXTENTS dirty extents in b0 ($(date -u +%H:%M:%S))"
qemu-img create -q -f qcow2 "$W/big.qcow2" "${BIG_T}T"
qemu-img bitmap --add "$W/big.qcow2" b0
t=$(secs dirty "$W/big.qcow2" "$EXTENTS" stripes)
echo "made in ${t}s: $(du -h "$W/big.qcow2" | cut -f1) on disk"
serve_qemu q "$W/big.qcow2"
[ -x "$FERRY" ] && serve_ferry f "$W/big.qcow2"
declare -A T
cells="q:nbdinfo f:nbdinfo q:ferry f:ferry q:py f:py"
query() { # SERVER CLIENT OUT
  case $2 in
    nbdinfo) nbdinfo --map=qemu:dirty-bitmap:b0 "$(uri "$1")" >"$3" ;;
    ferry) "$FERRY" info --map=qemu:dirty-bitmap:b0 "$(uri "$1")" >"$3" ;;
    py) $PY "$HERE/nbd_map_query.py" "$(uri "$1")" >"$3" ;;
  esac
}
for r in $(seq "$RUNS"); do
  for c in $cells; do
    T[$c]+="$(secs query "${c%%:*}" "${c##*:}" "$W/map.$c") "
    [ "${c##*:}" = py ] && T[$c:in]+="$(sed -n 's/.*seconds=\([0-9.]*\).*/\1/p' "$W/map.$c") "
  done
done
dirty_lines() { # a map, or nbd_map_query.py's summary
  if grep -q '^extents=' "$1" 2>/dev/null; then sed 's/.*dirty=\([0-9]*\).*/\1/' "$1"
  else awk '$3 == 1' "$1" 2>/dev/null | wc -l; fi
}
same() { # CLIENT: both servers gave this client the same map, with EXTENTS dirty lines
  if cmp -s <(sed 's/ seconds=.*//' "$W/map.q:$1") <(sed 's/ seconds=.*//' "$W/map.f:$1") \
    && [ "$(dirty_lines "$W/map.q:$1")" = "$EXTENTS" ]; then echo yes
  else echo "no (qemu-nbd: $(dirty_lines "$W/map.q:$1"), ferry: $(dirty_lines "$W/map.f:$1") dirty lines)"; fi
}
echo
echo "| client \\ server | qemu-nbd -r -B b0 (s) | ferry serve -r -B b0 (s) | same map |"
echo "|---|---|---|---|"
for cl in nbdinfo ferry py; do
  case $cl in
    ferry) name="ferry info --map=qemu:dirty-bitmap:b0" ;;
    nbdinfo) name="nbdinfo --map=qemu:dirty-bitmap:b0" ;;
    py) name="libnbd Python block_status loop, no printing (nbd_map_query.py)" ;;
  esac
  printf "| %s | %s | %s | %s |\n" "$name" "$(med_of "${T[q:$cl]}")" "$(med_of "${T[f:$cl]}")" "$(same $cl)"
done
printf "| %s | %s | %s | |\n" "the same, timed inside the script (connect to last reply)" "$(med_of "${T[q:py:in]}")" "$(med_of "${T[f:py:in]}")"

stop_all
# Cold: server start (opening the image, loading b0) to the end of the first nbdinfo map.
cold() { # qemu|ferry
  local sock=$W/cold.sock p i
  rm -f "$sock"
  case $1 in
    qemu) qemu-nbd -t -r -B b0 -f qcow2 -k "$sock" "$W/big.qcow2" 2>/dev/null & p=$! ;;
    ferry) "$FERRY" serve -r -B b0 -U "$sock" "$W/big.qcow2" 2>/dev/null & p=$! ;;
  esac
  for i in $(seq 2000); do
    nbdinfo --map=qemu:dirty-bitmap:b0 "nbd+unix:///?socket=$sock" >"$W/cold.map" 2>/dev/null && break
    kill -0 $p 2>/dev/null || break
    sleep 0.01
  done
  kill $p 2>/dev/null; wait $p 2>/dev/null
  [ "$(dirty_lines "$W/cold.map")" = "$EXTENTS" ]
}
declare -A C
for r in $(seq "$RUNS"); do for k in qemu ferry; do C[$k]+="$(secs cold $k) "; done; done
printf "| server start + first nbdinfo --map (cold) | %s | %s | |\n" "$(med_of "${C[qemu]}")" "$(med_of "${C[ferry]}")"
rm -f "$W/big.qcow2" "$W"/map.* "$W/cold.map"
fi
[[ " $PARTS " == *" 2 "* ]] || exit 0

echo
echo "== 2. incremental backup: ${SIZE_G} GiB, ${DIRTY_PCT}% of 64 KiB granules dirty ($(date -u +%H:%M:%S))"
openssl enc -aes-128-ctr -pass pass:backup -nosalt -pbkdf2 </dev/zero 2>/dev/null | head -c $((SIZE_G<<30)) >"$W/data.raw"
qemu-img convert -f raw -O qcow2 "$W/data.raw" "$W/vm.qcow2"; rm -f "$W/data.raw"
qemu-img convert -f qcow2 -O qcow2 "$W/vm.qcow2" "$W/base.qcow2"   # the previous backup
qemu-img bitmap --add "$W/vm.qcow2" b0
NDIRTY=$(( (SIZE_G<<14) * DIRTY_PCT / 100 ))
dirty "$W/vm.qcow2" "$NDIRTY" random
serve_qemu src "$W/vm.qcow2"
SRC=$(uri src)
echo "dirty: $(nbdinfo --map=qemu:dirty-bitmap:b0 "$SRC" | awk '$3 == 1 {n++; b += $2} END {printf "%d extents, %.1f MiB", n, b/1048576}')"
full_ferry() { rm -f "$W/full-f.qcow2"; "$FERRY" copy "$SRC" "$W/full-f.qcow2"; }
full_qemu() { rm -f "$W/full-q.qcow2"; qemu-img convert -f raw -O qcow2 "$SRC" "$W/full-q.qcow2"; }
inc_ferry() { rm -f "$W/inc-f.qcow2"; "$FERRY" copy --dirty-bitmap b0 --backing "$W/base.qcow2" "$SRC" "$W/inc-f.qcow2"; }
py_overlay() { # fresh overlay + qemu-nbd on it (not timed)
  rm -f "$W/inc-p.qcow2"
  qemu-img create -q -f qcow2 -b base.qcow2 -F qcow2 "$W/inc-p.qcow2"
  qemu-nbd -t -f qcow2 -k "$W/ov.sock" "$W/inc-p.qcow2" 2>"$W/ov.log" & ovpid=$!
  wait_sock "$W/ov.sock"
}
py_stop() { kill "$ovpid"; wait "$ovpid" 2>/dev/null; }
inc_py() { $PY "$HERE/nbd_incremental.py" --bitmap b0 "$SRC" "$(uri ov)"; }
declare -A B
for r in $(seq "$RUNS"); do
  B[full_ferry]+="$(secs full_ferry) "
  B[full_qemu]+="$(secs full_qemu) "
  B[inc_ferry]+="$(secs inc_ferry) "
  py_overlay; B[inc_py]+="$(secs inc_py) "; py_stop
done
check() { qemu-img compare -q -f qcow2 -F raw "$1" "$SRC" 2>/dev/null && echo ok || echo DIFFERENT; }
FULL=$(med_of "${B[full_ferry]}")
share() { [ "$FULL" = FAIL ] || [ "$1" = FAIL ] && { echo "-"; return; }; printf "%.1f%%" "$(echo "100 * $1 / $FULL" | bc -l)"; }
echo
echo "| copy | median s | of full ferry copy | restores to the export |"
echo "|---|---|---|---|"
for k in full_ferry:full-f "full_qemu:full-q" inc_ferry:inc-f inc_py:inc-p; do
  n=${k%%:*}; f=$W/${k##*:}.qcow2; m=$(med_of "${B[$n]}")
  case $n in
    full_ferry) label='ferry copy URI full.qcow2' ;;
    full_qemu) label='qemu-img convert -O qcow2 URI full.qcow2' ;;
    inc_ferry) label='ferry copy --dirty-bitmap b0 --backing base.qcow2' ;;
    inc_py) label='nbd_incremental.py (libnbd Python) into a qemu-nbd overlay' ;;
  esac
  [ -f "$f" ] && c=$(check "$f") || c="-"
  printf "| %s | %s | %s | %s |\n" "$label" "$m" "$(share "$m")" "$c"
done
