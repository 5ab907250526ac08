#!/usr/bin/env bash
# Repository commands beside many stored chunks (issue 35): what each command costs, in wall
# seconds and peak RSS, as the repository grows, with restic 0.14 beside it. Prints one
# markdown table and writes it to OUT.
#
#   bash bench/repo-scale.sh                          # from the project root, after cargo build --release -p ferry
#   bash bench/repo-scale.sh --chunks 200000,1000000  # the sizes (stored chunks), comma-separated
#   bash bench/repo-scale.sh --chunks 10000000 --disk-gib 1024 --rest zero --no-restic --keep /tmp/scale10m
#                     # 10M: a 1 TiB generator disk whose first 10M granules are unique and the rest
#                     # zero; the repository is kept in /tmp/scale10m (its build alone takes about an
#                     # hour on 2 busy cores)
#   bash bench/repo-scale.sh --reuse /tmp/scale10m    # the command rows again on that kept repository
#                     # (no build: e.g. after a change to ferry), with the 0 column built anew
#   bash bench/repo-scale.sh --gen file               # the generator disk as a sparse file (GEN_DIR)
#   bash bench/repo-scale.sh --encrypt                # encrypted ferry repositories (`repo init --encrypt`)
#   bash bench/repo-scale.sh --no-restic              # ferry's rows only
#   bash bench/repo-scale.sh --restic-chunks 200000   # restic only at these sizes (default: all of them)
#   GEN_MIN=16384 bash bench/repo-scale.sh --chunks 4000   # a quick try of the script (1 GiB disk)
#
# The repositories: for each size N (and for N = 0, the column every RSS difference is
# taken against), a generator disk, GEN = max(64 GiB, N * 64 KiB) (for N > 0 at least
# --disk-gib), whose first N 64 KiB granules each hold their own 8-byte number and the rest
# one shared 8-byte pattern (--rest zero, for N > 0: zero), everything else zero: N unique
# chunks that compress to a few bytes each, plus one. By default GEN is served by nbdkit,
# computed on the fly (bench/repo-scale-nbdkit.py: no disk used; its block status gives
# 4 KiB of data a granule, so ferry reads 4 KiB a granule); `--gen file` writes it as a
# sparse raw file instead (bench/repo-scale-gen.py, the same bytes). It is backed up once
# with `ferry backup GEN REPO::gen` into a new repository (the "build" row; the repository
# then holds N + 1 chunks and one snapshot of GEN). Then, timed (wall seconds) and with
# their peak RSS (GNU time's maximum resident set size), in this order:
# - `ferry repo list REPO`;
# - `ferry backup small.raw REPO::small`: a separate 64 MiB disk of random bytes (AES-CTR);
#   also, once, into a new empty repository (the "empty repository" row);
# - `ferry copy REPO::small out.raw` (compared with small.raw afterwards), `ferry hash REPO::small`;
# - serve, time to first byte: from starting `ferry serve -r -U SOCK REPO::small` to the
#   end of one 4 KiB read by python3-libnbd (connecting as soon as the socket is there);
#   the RSS is the server's after that read;
# - `ferry repo check REPO`, `ferry repo verify REPO`;
# - `ferry repo forget REPO ID` (the small disk's snapshot) + `ferry repo gc REPO`;
# - day 2 of the generator disk: 2% of its granules, at random (seeded), changed to new
#   unique numbers, and `ferry backup --extents-from bitmap:65536:MAP --since GENID GEN REPO::gen`
#   with the bitmap of exactly those granules (at N up to 1M: 2% of a 64 GiB disk).
# restic (unless --no-restic), in its own repository, on the same data: `restic backup GEN`
# (from the nbdkit generator: `nbdcopy GEN - | restic backup --stdin`, timed together)
# (build; restic cuts this data into 512 KiB blobs, so its repository holds N/8 + 1 data
# blobs: the same stored volume, fewer objects), `restic snapshots`, `restic backup
# small.raw`, `restic restore latest --tag small` (compared), `restic check`, `restic check
# --read-data`, `restic forget ID --prune`. restic has no change list, so no day-2 row.
#
# One run of each command (the build of a large repository takes minutes). The machine is
# shared: the load average is printed with each size. Disk: BENCH_DIR (default
# /tmp/scale-bench) holds one ferry and one restic repository at a time (about 150 MB per
# 1M chunks) and, with `--gen file`, GEN_DIR the generator file (about 4 GiB per 64 GiB of
# disk: one block a granule); everything the script made there is removed at exit.
#
# Each repository's host state and index cache (FERRY_STATE_DIR, FERRY_CACHE_DIR) are under
# the work directory: the first command that needs the cache builds it (the small backup's
# row, "cold cache").
#
# --keep DIR keeps the largest size's repository in DIR (DIR/repo, its host state DIR/state,
# its index cache DIR/cache and DIR/gen.env, the generator's parameters and the build's
# snapshot id);
# --reuse DIR takes it as that size instead of building it (restic is then not run). There
# the day-2 snapshot is forgotten after its row, so a rerun's day 2 continues the build
# again (the same 2%), and a rerun's forget + gc row also frees the last day 2's chunks.
#
# Needs: python3 with libnbd (python3-libnbd; PY=/usr/bin/python3 by default), nbdkit with
# its python plugin (nbdkit-plugin-python), restic (installed with apt-get when missing),
# openssl, cmp, GNU time (/usr/bin/time).
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=bench/lib.sh
. "$HERE/lib.sh"
FERRY=${FERRY:-$PWD/target/release/ferry}
PY=${PY:-/usr/bin/python3}
OUT=${OUT:-$PWD/repo-scale.md}
GEN_MIN=${GEN_MIN:-1048576}  # the generator disk's least size in granules (tests of the script: smaller)
CHUNKS=1000000
RESTIC_CHUNKS=
ENCRYPT=0
PEERS=1
GENKIND=nbdkit
DISK_GIB=0
REST=same
KEEP=
REUSE=
while [ $# -gt 0 ]; do
  case $1 in
    --chunks) CHUNKS=$2; shift ;;
    --restic-chunks) RESTIC_CHUNKS=$2; shift ;;
    --encrypt) ENCRYPT=1 ;;
    --no-restic) PEERS=0 ;;
    --gen) GENKIND=$2; shift ;;
    --disk-gib) DISK_GIB=$2; shift ;;
    --rest) REST=$2; shift ;;
    --keep) KEEP=$2; shift ;;
    --reuse) REUSE=$2; shift ;;
    --out) OUT=$2; shift ;;
    -h | --help) sed -n '2,/^set -u/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "unknown argument $1 (see --help)"; exit 2 ;;
  esac
  shift
done
[[ $GENKIND =~ ^(nbdkit|file)$ ]] || { echo "--gen takes nbdkit or file"; exit 2; }
[[ $REST =~ ^(same|zero)$ ]] || { echo "--rest takes same or zero"; exit 2; }
[[ $DISK_GIB =~ ^[0-9]+$ ]] || { echo "--disk-gib takes a number"; exit 2; }  # 0: GEN_MIN alone
[ "$GENKIND:$REST" = file:zero ] && { echo "--rest zero needs the nbdkit generator"; exit 2; }
if [ -n "$REUSE" ]; then
  if [ ! -s "$REUSE/gen.env" ] || [ ! -d "$REUSE/repo" ]; then echo "$REUSE: no kept repository (gen.env, repo) there"; exit 2; fi
  # shellcheck disable=SC1091 # written by --keep: RGRANULES RUNIQUE RREST RGENID
  . "$REUSE/gen.env"
  # shellcheck disable=SC2153
  CHUNKS=$RUNIQUE PEERS=0 GENKIND=nbdkit REST=$RREST
fi
[ "$ENCRYPT" = 1 ] && [ -n "$KEEP$REUSE" ] && { echo "--keep and --reuse are for repositories without encryption"; exit 2; }
SIZES="0 $(echo "$CHUNKS" | tr ',' ' ')"
RSIZES=${RESTIC_CHUNKS:+0 $(echo "$RESTIC_CHUNKS" | tr ',' ' ')}
RSIZES=${RSIZES:-$SIZES}
for n in $SIZES; do
  [[ $n =~ ^[0-9]+$ ]] || { echo "--chunks takes numbers: $CHUNKS"; exit 2; }
  [ "$n" -ge 5000000 ] && [ -z "$REUSE" ] && echo "note: $n chunks: the build alone takes about $((n / 3000 / 60)) minutes on 2 busy cores, restic's as long"
done
LARGEST=$(echo "$SIZES" | tr ' ' '\n' | sort -n | tail -1)

[ "$PEERS" = 1 ] && install_pkg restic restic
for t in openssl cmp /usr/bin/time; do command -v $t >/dev/null || { echo "missing $t"; exit 1; }; done
$PY -c 'import nbd' || { echo "missing python3-libnbd for $PY"; exit 1; }
[ "$GENKIND" = nbdkit ] && { nbdkit python --version >/dev/null 2>&1 || { echo "missing nbdkit's python plugin (nbdkit-plugin-python)"; exit 1; }; }
[ -x "$FERRY" ] || { echo "missing $FERRY: cargo build --release -p ferry first"; exit 1; }

mkdir -p "${BENCH_DIR:-/tmp/scale-bench}"
W=$(mktemp -d "${BENCH_DIR:-/tmp/scale-bench}/run.XXXX") || exit 1
# The generator file lives in GEN_DIR, /dev/shm by default (about 4 GiB of memory per 64 GiB
# of disk): on a file system mounted with `discard`, as this machine's is, removing a file of
# a million scattered blocks discards them one by one and takes more than ten minutes.
GEN_DIR=${GEN_DIR:-/dev/shm}
[ "$GENKIND" = nbdkit ] && GEN_DIR=$W
GW=$(mktemp -d "$GEN_DIR/scale-gen.XXXX") || { rm -rf "$W"; exit 1; }
SPID=
cleanup() {
  [ -n "$SPID" ] && kill "$SPID" 2>/dev/null
  gen_stop
  wait 2>/dev/null
  rm -rf "$W" "$GW"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

echo "bench password $$" >"$W/pass"
chmod 600 "$W/pass"
export RESTIC_PASSWORD_FILE=$W/pass RESTIC_CACHE_DIR=$W/restic-cache
[ "$ENCRYPT" = 1 ] && export FERRY_PASSWORD_FILE=$W/pass
LOG=$W/log
# gen G N [SEED]: the generator disk of G granules, the first N unique, as GEN (a path or an
# NBD URI); with SEED day 2's 2% changed too and $W/day2.map written.
GPID=
gen_stop() { [ -n "$GPID" ] && { kill "$GPID" 2>/dev/null; wait "$GPID" 2>/dev/null; }; GPID=; }
gen() {
  local rest=$REST; [ "$2" = 0 ] && rest=same
  if [ "$GENKIND" = file ]; then
    GEN=$GW/gen.raw
    $PY "$HERE/repo-scale-gen.py" "$GEN" "$1" "$2" ${3:+"$3" "$W/day2.map"}
    return
  fi
  gen_stop
  [ -n "${3:-}" ] && { $PY "$HERE/repo-scale-gen.py" --bitmap-only "$W/day2.map" "$1" "$3" || return 1; }
  rm -f "$GW/gen.sock"
  # in the foreground of a background job: its pid is known at once (a forked nbdkit's pid
  # file may not be written yet when the command returns)
  nbdkit -f -U "$GW/gen.sock" python "$HERE/repo-scale-nbdkit.py" granules="$1" unique="$2" rest="$rest" \
    ${3:+seed="$3" bitmap="$W/day2.map"} >>"$LOG" 2>&1 &
  GPID=$!
  for _ in $(seq 600); do [ -S "$GW/gen.sock" ] && break; kill -0 "$GPID" 2>/dev/null || return 1; sleep 0.1; done
  [ -S "$GW/gen.sock" ] || return 1
  GEN="nbd+unix:///?socket=$GW/gen.sock"
}
stamp() { echo "$(date -u +%F\ %H:%M:%S) UTC, load average $(cut -d' ' -f1-3 /proc/loadavg)"; }
echo "ferry: $("$FERRY" --version | head -1), $(restic version 2>/dev/null | cut -d' ' -f1-2), work in $W, $(stamp)"

declare -A LOAD STORED RBLOBS GIB
declare -A S M  # S[ROW:SIZE]: wall seconds; M[ROW:SIZE]: peak RSS in KiB
ROWS=()
row() { [[ " ${ROWS[*]} " == *" $1 "* ]] || ROWS+=("$1"); }
# timed ROW SIZE CMD...: one run of CMD; its seconds and peak RSS (FAIL when it fails).
timed() {
  local r=$1 n=$2; shift 2
  row "$r"
  echo "== $r ($n): $*" >>"$LOG"
  if /usr/bin/time -f '%e %M' -o "$W/time" "$@" >>"$LOG" 2>&1; then
    local t m
    read -r t m <"$W/time"
    S["$r:$n"]=$t; M["$r:$n"]=$m
    echo "   $r ($n): $t s, $m KiB"
  else
    S["$r:$n"]=FAIL; M["$r:$n"]=
    echo "   FAIL: $r at $n chunks (see the log below)"; tail -5 "$LOG"
  fi
}
# ttfb ROW SIZE SPEC: seconds from starting `ferry serve` to the end of the first 4 KiB read,
# and the server's peak RSS up to then.
ttfb() {
  local r=$1 n=$2 sock=$W/serve.sock t
  row "$r"
  rm -f "$sock" "$W/time" "$W/serve.pid"
  local s; s=$(date +%s.%N)
  /usr/bin/time -f '%e %M' -o "$W/time" "$FERRY" serve -r -q -U "$sock" -P "$W/serve.pid" "$3" >>"$LOG" 2>&1 &
  SPID=$!
  t=$($PY - "$sock" "$s" <<'EOF'
import nbd, os, sys, time
sock, start = sys.argv[1], float(sys.argv[2])
deadline = time.time() + 600
while True:
    try:
        h = nbd.NBD()
        h.connect_unix(sock)
        break
    except nbd.Error:
        if time.time() > deadline:
            sys.exit(1)
        time.sleep(0.002)
h.pread(4096, 0)
print("%.3f" % (time.time() - start))
h.shutdown()
EOF
  )
  # the server's pid file is written once it accepts connections
  for _ in $(seq 100); do [ -s "$W/serve.pid" ] && break; sleep 0.05; done
  kill "$(cat "$W/serve.pid" 2>/dev/null)" 2>/dev/null
  wait "$SPID" 2>/dev/null; SPID=
  S["$r:$n"]=${t:-FAIL}
  local m; m=$(tail -1 "$W/time" 2>/dev/null | cut -d' ' -f2)
  [[ $m =~ ^[0-9]+$ ]] || m=
  M["$r:$n"]=$m
  echo "   $r ($n): ${t:-FAIL} s, $m KiB"
}
fjson() { $PY -c "import json,sys; print(json.load(sys.stdin)$1)"; }

# The small disk: 64 MiB of AES-CTR bytes.
openssl enc -aes-128-ctr -pass pass:scale -nosalt -pbkdf2 </dev/zero 2>/dev/null | head -c $((64 << 20)) >"$W/small.raw"
INIT=(repo init); [ "$ENCRYPT" = 1 ] && INIT+=(--encrypt)

# The empty repository: the small disk's backup with nothing else stored.
export FERRY_STATE_DIR=$W/ferry-state FERRY_CACHE_DIR=$W/ferry-cache
"$FERRY" "${INIT[@]}" "$W/empty" >>"$LOG" 2>&1
timed "ferry backup small.raw REPO::small, into an empty repository" 0 "$FERRY" backup "$W/small.raw" "$W/empty::small"
rm -rf "$W/empty" "$W/ferry-state" "$W/ferry-cache"
ROWS=()  # that row is printed apart

for n in $SIZES; do
  G=$(( n > GEN_MIN ? n : GEN_MIN ))
  [ "$n" != 0 ] && G=$(( G > DISK_GIB << 14 ? G : DISK_GIB << 14 ))
  R=$W/repo
  rm -rf "$R" "$W/ferry-state" "$W/ferry-cache"
  export FERRY_STATE_DIR=$W/ferry-state FERRY_CACHE_DIR=$W/ferry-cache
  if [ -n "$REUSE" ] && [ "$n" = "$LARGEST" ]; then
    # shellcheck disable=SC2153 # from gen.env
    G=$RGRANULES R=$REUSE/repo GENID=$RGENID
    export FERRY_STATE_DIR=$REUSE/state FERRY_CACHE_DIR=$REUSE/cache
    LATEST=$("$FERRY" repo list --json "$R" 2>>"$LOG" | $PY -c 'import json,sys; print(max((s for s in json.load(sys.stdin) if s["name"] == "gen"), key=lambda s: s["time"])["id"])' 2>>"$LOG")
    [ "$LATEST" = "$GENID" ] || { echo "$R: the latest snapshot of gen is ${LATEST:-unknown}, not the build's $GENID: day 2 continues the build; \`ferry repo forget $R ID\` the later ones first"; exit 1; }
  fi
  echo "-- $n chunks ($(stamp)): generator disk of $((G >> 14)) GiB"
  LOAD[$n]=$(cut -d' ' -f1 /proc/loadavg)
  gen "$G" "$n" || exit 1
  if [ "$R" = "$W/repo" ]; then
    "$FERRY" "${INIT[@]}" "$R" >>"$LOG" 2>&1
    timed "build: ferry backup GEN REPO::gen" "$n" "$FERRY" backup --json "$GEN" "$R::gen"
    GENID=$(grep '^{' "$LOG" | tail -1 | fjson '["id"]')
  fi
  timed "ferry repo list REPO" "$n" "$FERRY" repo list "$R"
  timed "ferry backup small.raw REPO::small (64 MiB)" "$n" "$FERRY" backup --json "$W/small.raw" "$R::small"
  SMALLID=$(grep '^{' "$LOG" | tail -1 | fjson '["id"]')
  timed "ferry copy REPO::small out.raw" "$n" "$FERRY" copy "$R::small" "$W/out.raw"
  cmp -s "$W/small.raw" "$W/out.raw" || { echo "   restore differs from small.raw at $n"; S["ferry copy REPO::small out.raw:$n"]=WRONG; }
  rm -f "$W/out.raw"
  timed "ferry hash REPO::small" "$n" "$FERRY" hash "$R::small"
  ttfb "ferry serve -r REPO::small: first 4 KiB read" "$n" "$R::small"
  timed "ferry repo check REPO" "$n" "$FERRY" repo check "$R"
  timed "ferry repo verify REPO" "$n" "$FERRY" repo verify "$R"
  # shellcheck disable=SC2016 # the inner sh expands them
  timed "ferry repo forget REPO ID (small) + gc" "$n" sh -c '"$1" repo forget "$2" "$3" && "$1" repo gc "$2"' sh "$FERRY" "$R" "$SMALLID"
  if [ "$PEERS" = 1 ] && [[ " $RSIZES " == *" $n "* ]]; then
    Q=$W/restic
    rm -rf "$Q" "$RESTIC_CACHE_DIR"
    restic init -r "$Q" >>"$LOG" 2>&1
    if [ "$GENKIND" = file ]; then
      timed "restic: build: restic backup GEN" "$n" restic -r "$Q" backup "$GEN"
    else
      # shellcheck disable=SC2016 # the inner sh expands them
      timed "restic: build: restic backup GEN" "$n" bash -c 'set -o pipefail; nbdcopy "$1" - | restic -r "$2" backup --stdin --stdin-filename gen.raw' sh "$GEN" "$Q"
    fi
    timed "restic: restic snapshots" "$n" restic -r "$Q" snapshots
    timed "restic: restic backup small.raw" "$n" restic -r "$Q" backup --tag small "$W/small.raw"
    timed "restic: restic restore latest --tag small" "$n" restic -r "$Q" restore latest --tag small --target "$W/rout"
    cmp -s "$W/small.raw" "$W/rout$W/small.raw" || { echo "   restic's restore differs at $n"; S["restic: restic restore latest --tag small:$n"]=WRONG; }
    rm -rf "$W/rout"
    timed "restic: restic check" "$n" restic -r "$Q" check
    timed "restic: restic check --read-data" "$n" restic -r "$Q" check --read-data
    RID=$(restic -r "$Q" snapshots --tag small --json 2>>"$LOG" | fjson '[-1]["id"]')
    timed "restic: restic forget ID (small) --prune" "$n" restic -r "$Q" forget "$RID" --prune
    RBLOBS[$n]=$(restic -r "$Q" stats --mode raw-data --json 2>>"$LOG" | fjson '["total_blob_count"]' 2>/dev/null)
    rm -rf "$Q" "$RESTIC_CACHE_DIR"
  fi
  # Day 2 last: it changes the generator file (the next size writes every granule again).
  gen "$G" "$n" 2 || exit 1
  timed "day 2: ferry backup --extents-from (2% of GEN) --since ID" "$n" "$FERRY" backup --extents-from "bitmap:65536:$W/day2.map" --since "$GENID" "$GEN" "$R::gen"
  gen_stop
  STORED[$n]=$(du -sb "$R" | cut -f1)
  if [ "$n" = "$LARGEST" ] && [ -n "$KEEP$REUSE" ]; then
    # the repository as built, but for unused data: day 2's snapshot (the latest of gen) goes
    D2=$("$FERRY" repo list --json "$R" 2>>"$LOG" | $PY -c 'import json,sys; print(max((s for s in json.load(sys.stdin) if s["name"] == "gen"), key=lambda s: s["time"])["id"])' 2>>"$LOG")
    { [ "$D2" != "$GENID" ] && "$FERRY" repo forget "$R" "$D2"; } >>"$LOG" 2>&1 ||
      echo "   could not forget day 2's snapshot $D2 from $R: a --reuse of it will fail (see the log)"
  fi
  GIB[$n]=$((G >> 14))
  if [ -n "$KEEP" ] && [ "$n" = "$LARGEST" ] && [ "$R" = "$W/repo" ]; then
    mkdir -p "$KEEP" && rm -rf "$KEEP/repo" "$KEEP/state" "$KEEP/cache"
    mv "$R" "$KEEP/repo" && mv "$FERRY_STATE_DIR" "$KEEP/state" && { [ ! -d "$FERRY_CACHE_DIR" ] || mv "$FERRY_CACHE_DIR" "$KEEP/cache"; }
    printf 'RGRANULES=%s\nRUNIQUE=%s\nRREST=%s\nRGENID=%s\n' "$G" "$n" "$REST" "$GENID" >"$KEEP/gen.env"
    echo "   kept in $KEEP"
  fi
  rm -rf "$W/repo"
done

# The table: per size, seconds, peak RSS (MB) and the RSS above the N = 0 column.
mb() { [ -z "$1" ] && { echo -; return; }; printf "%.0f" "$(echo "$1 * 1024 / 1000000" | bc -l)"; }
{
  echo "## Repository scale: ferry $("$FERRY" --version | head -1 | cut -d' ' -f2-), $(git -C "$HERE" rev-parse --short HEAD 2>/dev/null)$([ "$ENCRYPT" = 1 ] && echo ", encrypted")"
  echo
  echo "$(date -u +%F), $(nproc) CPUs; load average at the start of each size: $(for n in $SIZES; do printf '%s: %s; ' "$n" "${LOAD[$n]}"; done | sed 's/; $//')."
  echo "Command: \`bash bench/repo-scale.sh $([ -n "$REUSE" ] && echo "--reuse $REUSE" || echo "--chunks $CHUNKS")$([ "$ENCRYPT" = 1 ] && [ -z "$REUSE" ] && echo ' --encrypt')$([ "$PEERS" = 1 ] || [ -n "$REUSE" ] || echo ' --no-restic')$([ -n "$RESTIC_CHUNKS" ] && echo " --restic-chunks $RESTIC_CHUNKS")$([ "$GENKIND" = file ] && echo ' --gen file')$([ "$DISK_GIB" != 0 ] && echo " --disk-gib $DISK_GIB")$([ "$REST" = zero ] && [ -z "$REUSE" ] && echo ' --rest zero')$([ -n "$KEEP" ] && echo " --keep $KEEP")\`."
  printf "Generator disk (GiB):"; for n in $SIZES; do printf " %s: %s;" "$n" "${GIB[$n]:--}"; done | sed 's/;$/./'; echo "$([ "$REST" = zero ] && echo " Past the unique granules the disks of N > 0 are zero.")$([ -n "$REUSE" ] && echo " The $LARGEST column is the kept repository $REUSE (not built by this run).")"
  echo "Seconds (one run) and peak RSS in MB; Δ: RSS above the same command at 0 chunks (a repository holding the generator disk's one shared chunk)."
  printf "Repository after day 2 (du -sb, MB):"; for n in $SIZES; do printf " %s: %s;" "$n" "$(mb $(( ${STORED[$n]:-0} / 1024 )))"; done | sed 's/;$/./'; echo
  [ "$PEERS" = 1 ] && { printf "restic data blobs after prune:"; for n in $RSIZES; do printf " %s: %s;" "$n" "${RBLOBS[$n]:--}"; done | sed 's/;$/./'; echo; }
  echo
  printf "| command |"; for n in $SIZES; do printf " %s s | MB | Δ MB |" "$n"; done; echo
  printf "|---|"; for _ in $SIZES; do printf -- "---|---|---|"; done; echo
  for r in "${ROWS[@]}"; do
    printf "| %s |" "$r"
    for n in $SIZES; do
      d=-; [ -n "${M[$r:$n]:-}" ] && [ -n "${M[$r:0]:-}" ] && [ "$n" != 0 ] && d=$(mb $(( ${M[$r:$n]} - ${M[$r:0]} )))
      printf " %s | %s | %s |" "${S[$r:$n]:--}" "$(mb "${M[$r:$n]:-}")" "$d"
    done
    echo
  done
  r="ferry backup small.raw REPO::small, into an empty repository"
  echo
  echo "The same small backup into a new, empty repository: ${S[$r:0]:--} s, $(mb "${M[$r:0]:-}") MB."
} >"$OUT"
cp "$LOG" "${OUT%.md}.log"
echo
cat "$OUT"
echo
echo "written to $OUT (the commands' output: ${OUT%.md}.log)"
