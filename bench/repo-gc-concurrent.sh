#!/usr/bin/env bash
# gc beside four backups (issue 35): `ferry repo gc` over a large repository started while four
# `ferry backup` of distinct disks run into it. All five must finish with exit 0; then every
# snapshot they wrote restores byte-exact and `ferry repo check` is clean, and again after a
# second gc that deletes what the first condemned. Prints one markdown table, written to OUT.
#
#   bash bench/repo-gc-concurrent.sh REPO          # from the project root; REPO: an existing
#                                                  # repository (e.g. bench/repo-scale.sh --keep DIR's)
#   DISK_MIB=64 bash bench/repo-gc-concurrent.sh REPO   # smaller disks (a quick try)
#
# In order, timed (wall seconds, peak RSS):
# 1. alone: four backups of four disks A1..A4 (DISK_MIB MiB of AES-CTR bytes each, distinct)
#    at once, no gc: what a backup costs beside three others. Their snapshots are then
#    forgotten, so the gc below has packs to free;
# 2. beside: `ferry repo gc REPO` started, and one second later four backups of four other
#    distinct disks B1..B4 at once; how much slower the backups were than in 1, and the gc's
#    time beside them (its time alone is bench/repo-scale.sh's forget + gc row);
# 3. each B snapshot restored (`ferry copy REPO::NAME@ID out.raw`) and compared with its disk,
#    `ferry repo check REPO`;
# 4. `ferry repo gc --condemn-margin 0 REPO` (deletes the packs the first gc condemned beside
#    the backups), then the B snapshots restored and compared again, and `repo check`.
# At the end the B snapshots are forgotten and a last gc (not timed) frees their data, so
# REPO holds what it held before. Disk: 8 * DISK_MIB MiB of disks
# and one restore at a time under BENCH_DIR (default /tmp/scale-bench), removed at exit.
# FERRY_STATE_DIR is the caller's (the repository's index cache: keep it warm).
set -u
FERRY=${FERRY:-$PWD/target/release/ferry}
OUT=${OUT:-$PWD/repo-gc-concurrent.md}
DISK_MIB=${DISK_MIB:-256}
R=${1:?usage: repo-gc-concurrent.sh REPO}
[ -x "$FERRY" ] || { echo "missing $FERRY: cargo build --release -p ferry first"; exit 1; }
[ -d "$R" ] || { echo "$R: no repository there"; exit 1; }
mkdir -p "${BENCH_DIR:-/tmp/scale-bench}"
W=$(mktemp -d "${BENCH_DIR:-/tmp/scale-bench}/gcc.XXXX") || exit 1
trap 'kill $(jobs -p) 2>/dev/null; wait 2>/dev/null; rm -rf "$W"' EXIT
trap 'exit 130' INT TERM
LOG=$W/log
stamp() { echo "$(date -u +%F\ %H:%M:%S) UTC, load average $(cut -d' ' -f1-3 /proc/loadavg)"; }
fjson() { python3 -c "import json,sys; print(json.load(sys.stdin)$1)"; }
echo "ferry: $("$FERRY" --version | head -1), repository $R, disks of $DISK_MIB MiB, $(stamp)"
for d in A1 A2 A3 A4 B1 B2 B3 B4; do
  openssl enc -aes-128-ctr -pass "pass:gc-$d-$$" -nosalt -pbkdf2 </dev/zero 2>/dev/null | head -c $((DISK_MIB << 20)) >"$W/$d.raw"
done
declare -A T M RC ID
# start KEY CMD...: runs CMD in the background, its time and RSS in $W/KEY.time, output in $W/KEY.out.
start() {
  local k=$1; shift
  echo "== $k: $*" >>"$LOG"
  (date +%s.%N >"$W/$k.t0"; /usr/bin/time -f '%e %M' -o "$W/$k.time" "$@" >"$W/$k.out" 2>&1; echo $? >"$W/$k.rc"; date +%s.%N >"$W/$k.t1") &
}
collect() {
  local k=$1
  RC[$k]=$(cat "$W/$k.rc")
  local t m
  read -r t m < <(tail -1 "$W/$k.time")
  T[$k]=$t M[$k]=$m
  cat "$W/$k.out" >>"$LOG"
  ID[$k]=$(grep '^{' "$W/$k.out" | tail -1 | fjson '["id"]' 2>/dev/null)
  [ "${RC[$k]}" = 0 ] || { echo "   FAIL: $k exited ${RC[$k]}:"; tail -5 "$W/$k.out"; }
}
LOAD1=$(cut -d' ' -f1 /proc/loadavg)
echo "-- 1. four backups alone ($(stamp))"
for d in A1 A2 A3 A4; do start "$d" "$FERRY" backup --json "$W/$d.raw" "$R::gcc-$d"; done
wait
for d in A1 A2 A3 A4; do collect "$d"; done
for d in A1 A2 A3 A4; do [ -n "${ID[$d]}" ] && "$FERRY" repo forget "$R" "${ID[$d]}" >>"$LOG" 2>&1; done
LOAD2=$(cut -d' ' -f1 /proc/loadavg)
echo "-- 2. gc beside four backups ($(stamp))"
start gc "$FERRY" repo gc "$R"
sleep 1
for d in B1 B2 B3 B4; do start "$d" "$FERRY" backup --json "$W/$d.raw" "$R::gcc-$d"; done
wait
for k in gc B1 B2 B3 B4; do collect "$k"; done
echo "-- 3. restores and check ($(stamp))"
# restored KEY: the B snapshots restored and compared; check: repo check.
declare -A OK
restored() {
  local ok=0
  for d in B1 B2 B3 B4; do
    if [ -n "${ID[$d]}" ] && "$FERRY" copy -q "$R::gcc-$d@${ID[$d]}" "$W/out.raw" >>"$LOG" 2>&1 && cmp -s "$W/$d.raw" "$W/out.raw"; then
      ok=$((ok + 1))
    else
      echo "   $d: the restore of ${ID[$d]:-(no snapshot)} failed or differs"
    fi
    rm -f "$W/out.raw"
  done
  OK[$1]="$ok of 4 byte-exact"
  /usr/bin/time -f '%e %M' -o "$W/check$1.time" "$FERRY" repo check "$R" >>"$LOG" 2>&1
  RC[check$1]=$?
  local t m
  read -r t m < <(tail -1 "$W/check$1.time")
  T[check$1]=$t M[check$1]=$m
}
restored 1
echo "-- 4. a second gc, condemned packs deleted, restores and check ($(stamp))"
start gc2 "$FERRY" repo gc --condemn-margin 0 "$R"
wait
collect gc2
restored 2
for d in B1 B2 B3 B4; do [ -n "${ID[$d]}" ] && "$FERRY" repo forget "$R" "${ID[$d]}" >>"$LOG" 2>&1; done
"$FERRY" repo gc --condemn-margin 0 "$R" >>"$LOG" 2>&1 || echo "   the last gc failed (see the log)"
mb() { [ -z "$1" ] && { echo -; return; }; printf "%.0f" "$(echo "$1 * 1024 / 1000000" | bc -l)"; }
avg() { echo "$@" | tr ' ' '\n' | awk '{s+=$1} END{printf "%.2f", s/NR}'; }
{
  echo "## gc beside four backups: ferry $("$FERRY" --version | head -1 | cut -d' ' -f2-), $(git -C "$(dirname "$0")" rev-parse --short HEAD 2>/dev/null)"
  echo
  echo "$(date -u +%F), $(nproc) CPUs, load average $LOAD1 (backups alone), $LOAD2 (gc beside them). Repository: $R ($("$FERRY" repo list "$R" 2>/dev/null | grep -c .) lines of \`repo list\`, $(du -sh "$R" | cut -f1))."
  echo "Command: \`bash bench/repo-gc-concurrent.sh $R\` (disks of $DISK_MIB MiB)."
  echo
  echo "| step | exit | s | MB |"
  echo "|---|---|---|---|"
  for d in A1 A2 A3 A4; do echo "| backup $d, four at once, no gc | ${RC[$d]} | ${T[$d]} | $(mb "${M[$d]}") |"; done
  echo "| gc, beside four backups | ${RC[gc]} | ${T[gc]} | $(mb "${M[gc]}") |"
  for d in B1 B2 B3 B4; do echo "| backup $d, four at once beside the gc | ${RC[$d]} | ${T[$d]} | $(mb "${M[$d]}") |"; done
  echo "| restores after: ${OK[1]}; repo check | ${RC[check1]} | ${T[check1]} | $(mb "${M[check1]}") |"
  echo "| second gc (--condemn-margin 0) | ${RC[gc2]} | ${T[gc2]} | $(mb "${M[gc2]}") |"
  echo "| restores after it: ${OK[2]}; repo check | ${RC[check2]} | ${T[check2]} | $(mb "${M[check2]}") |"
  echo
  # the backups ran beside the gc when one started before the gc ended
  first=$(cat "$W"/B?.t0 | sort -g | head -1)
  overlap=$(echo "$first < $(cat "$W/gc.t1")" | bc -l)
  echo "The gc ended $(echo "$(cat "$W/gc.t1") - $first" | bc -l | xargs printf '%.1f') s after the first of these backups started ($([ "$overlap" = 1 ] && echo "they overlapped" || echo "NO overlap: the gc was too quick"))."
  echo "Backups beside the gc: $(avg "${T[B1]}" "${T[B2]}" "${T[B3]}" "${T[B4]}") s on average against $(avg "${T[A1]}" "${T[A2]}" "${T[A3]}" "${T[A4]}") s without it."
} >"$OUT"
cp "$LOG" "${OUT%.md}.log"
echo
cat "$OUT"
ok=1
for k in A1 A2 A3 A4 gc B1 B2 B3 B4 gc2 check1 check2; do [ "${RC[$k]}" = 0 ] || ok=0; done
[ "${OK[1]}" = "4 of 4 byte-exact" ] && [ "${OK[2]}" = "4 of 4 byte-exact" ] || ok=0
[ $ok = 1 ] || { echo "FAILED: see ${OUT%.md}.log"; exit 1; }
