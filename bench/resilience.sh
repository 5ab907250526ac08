#!/usr/bin/env bash
# Copies that survive failures (issue 21): what --retries, --verify and --rate cost, and
# the time one server restart takes out of a copy. Prints markdown tables.
#
#   bash bench/resilience.sh                 # after cargo build --release -p ferry
#   SIZE_G=4 RUNS=3 FERRY=target/release/ferry bash bench/resilience.sh
#
# Data: SIZE_G GiB of AES-CTR bytes in /dev/shm (nothing is skipped as zeroes), served by
# `ferry serve` (a file export) on a Unix socket.
# 1. `ferry copy URI null:` with --retries 0 and with the default (5): retries armed must
#    cost nothing when nothing fails. RUNS rounds, interleaved, median.
# 2. `ferry copy SRC URI` (a file into an NBD export of a file) without and with --verify:
#    --verify should cost about one more read of the destination.
# 3. One restart: the same copy from an nbdkit file export, the server killed with -9
#    1 s into the copy and started again on its socket DOWN seconds later; total time,
#    minus the time of an undisturbed copy and the server's downtime = time lost.
#    --retry-delay 0.2.
# 4. --rate at 3 rates: 256 MiB (or SIZE_G GiB if smaller) to null:; achieved rate.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
SIZE_G=${SIZE_G:-4}
. "$HERE/lib.sh"
FERRY=${FERRY:-$PWD/target/release/ferry}
RUNS=${RUNS:-3}
DOWN=${DOWN:-1}
for t in nbdkit openssl bc; do command -v $t >/dev/null || { echo "missing $t"; exit 1; }; done
W=$(mktemp -d /dev/shm/resil.XXXX) || exit 1
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; rm -rf "$W"; }
trap cleanup EXIT
openssl enc -aes-128-ctr -pass pass:resil -nosalt -pbkdf2 </dev/zero 2>/dev/null | head -c $((SIZE_G<<30)) >"$W/src"
truncate -s $((SIZE_G<<30)) "$W/dst"
"$FERRY" serve -r -U "$W/src.sock" "file:$W/src" 2>/dev/null & pids+=($!)
"$FERRY" serve -U "$W/dst.sock" "file:$W/dst" 2>/dev/null & pids+=($!)
wait_sock "$W/src.sock"; wait_sock "$W/dst.sock"
SRC="nbd+unix:///?socket=$W/src.sock"
DST="nbd+unix:///?socket=$W/dst.sock"
ratio() { printf "%.2f" "$(echo "$1 / $2" | bc -l)"; }
med_of() { echo "$1" | tr ' ' '\n' | grep -v '^$' | grep -v FAIL | med; }

echo "== resilience, ${SIZE_G} GiB, $(date -u +%Y-%m-%dT%H:%M)Z, medians of $RUNS"
declare -A T
for r in $(seq "$RUNS"); do
  T[r0]+="$(secs "$FERRY" copy --retries 0 "$SRC" null:) "
  T[r5]+="$(secs "$FERRY" copy "$SRC" null:) "
  T[nv]+="$(secs "$FERRY" copy "$W/src" "$DST") "
  T[v]+="$(secs "$FERRY" copy --verify "$W/src" "$DST") "
done
echo
echo "| copy | median s | GiB/s | vs the first row |"
echo "|---|---|---|---|"
for k in r0 r5 nv v; do
  case $k in
    r0) l='ferry copy --retries 0 URI null:' ;; r5) l='ferry copy URI null: (--retries 5, the default)' ;;
    nv) l='ferry copy FILE URI' ;; v) l='ferry copy --verify FILE URI' ;;
  esac
  t=$(med_of "${T[$k]}"); base=$(med_of "${T[$([ $k = r0 ] || [ $k = r5 ] && echo r0 || echo nv)]}")
  printf "| %s | %.3f | %.2f | %s |\n" "$l" "$t" "$(echo "$SIZE_G / $t" | bc -l)" "$(ratio "$t" "$base")"
done
for d in sha256 blake3; do T[h$d]="$(secs "$FERRY" hash --digest "$d" "$DST")"; done
printf "| (for scale) ferry hash --digest sha256 URI / blake3 | %.3f / %.3f | | |\n" "${T[hsha256]}" "${T[hblake3]}"
T[vb]=""; for r in $(seq "$RUNS"); do T[vb]+="$(secs "$FERRY" copy --verify --digest blake3 "$W/src" "$DST") "; done
t=$(med_of "${T[vb]}"); printf "| ferry copy --verify --digest blake3 FILE URI | %.3f | %.2f | %s |\n" "$t" "$(echo "$SIZE_G / $t" | bc -l)" "$(ratio "$t" "$(med_of "${T[nv]}")")"


# 3. One restart of the source server.
restart_copy() { # with a kill at 1 s when $1 = kill
  local sock=$W/nk.sock p c s e
  rm -f "$sock"
  nbdkit -f -U "$sock" file "$W/src" & p=$!; wait_sock "$sock"
  s=$(date +%s.%N)
  "$FERRY" copy --retry-delay 0.2 "nbd+unix:///?socket=$sock" null: 2>"$W/restart.log" & c=$!
  if [ "$1" = kill ]; then
    sleep 1; kill -9 $p; wait $p 2>/dev/null; rm -f "$sock"; sleep "$DOWN"
    nbdkit -f -U "$sock" file "$W/src" & p=$!
  fi
  wait $c || { kill $p; wait $p 2>/dev/null; echo FAIL; cat "$W/restart.log" >&2; return; }
  e=$(date +%s.%N)
  kill $p; wait $p 2>/dev/null
  echo "$e - $s" | bc -l
}
declare -A R
for r in $(seq "$RUNS"); do R[calm]+="$(restart_copy calm) "; R[kill]+="$(restart_copy kill) "; done
calm=$(med_of "${R[calm]}"); killed=$(med_of "${R[kill]}")
echo
echo "| ${SIZE_G} GiB copy from nbdkit file to null: | median s |"
echo "|---|---|"
printf "| undisturbed | %.3f |\n" "$calm"
printf "| server killed -9 at 1 s, back %s s later | %.3f |\n" "$DOWN" "$killed"
printf "| time lost beyond the downtime | %.3f |\n" "$(echo "$killed - $calm - $DOWN" | bc -l)"
echo "(retries logged in the last run: $(grep -c -i 'retry\|reconnect' "$W/restart.log"))"

# 4. --rate accuracy.
n=$(( SIZE_G >= 1 ? 256 : SIZE_G * 1024 ))
head -c $((n<<20)) "$W/src" >"$W/small"
echo
echo "| --rate | bytes | seconds | achieved | of the rate |"
echo "|---|---|---|---|---|"
for rate in 32M 128M 512M; do
  t=$(secs "$FERRY" copy --rate "$rate" "$W/small" null:)
  r=$(( ${rate%M} << 20 ))
  printf "| %s | %d MiB | %.3f | %.1f MiB/s | %.1f%% |\n" "$rate" "$n" "$t" "$(echo "$n / $t" | bc -l)" "$(echo "100 * $n * 1048576 / $t / $r" | bc -l)"
done
