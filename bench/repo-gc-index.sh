#!/usr/bin/env bash
# The first backup after a gc (issue 35): what it costs when gc writes every index object
# anew (FERRY_BEFORE) and when gc keeps those whose packs it leaves as they are (FERRY).
# Prints one markdown table and writes it to OUT.
#
#   FERRY_BEFORE=/path/to/older/ferry bash bench/repo-gc-index.sh            # 1M chunks
#   FERRY_BEFORE=... bash bench/repo-gc-index.sh --chunks 200000
#   FERRY_BEFORE=... bash bench/repo-gc-index.sh --reuse DIR   # a repository kept by
#                     # `bash bench/repo-scale.sh --keep DIR` (copied, never changed)
#
# The repository: bench/repo-scale.sh's generator disk (64 GiB or N 64 KiB granules, the
# first N unique, served by nbdkit: bench/repo-scale-nbdkit.py) backed up once into a new
# repository, gc'd once (the build's checkpoints leave superseded pages in most of its
# packs), then a 64 MiB disk of AES-CTR bytes (`small`) backed up into it, so that the
# host's index cache covers every index object. That repository, its host state and its
# cache are copied once per binary, so both start from the same bytes. In each copy, with
# that binary: `ferry repo forget REPO ID` (the small disk's snapshot), `ferry repo gc REPO`,
# then `ferry backup small.raw REPO::small` (the first after the gc: its cache takes in what
# gc changed) and the same again (warm). Each is timed with GNU time (wall seconds, peak
# RSS); the first backup after the gc runs under `strace -f --seccomp-bpf -e trace=openat`
# (only opens are traced) to sum the bytes of the index objects it opens (each object of
# `REPO/index/` whose name it opens).
# The same backup into a new empty repository gives the column every RSS difference is
# taken against. One run of each; the load average is printed.
#
# Needs: nbdkit with its python plugin, python3, openssl, strace, GNU time. Disk: BENCH_DIR
# (default /tmp/scale-bench) holds three repositories of about 150 MB per 1M chunks at once.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
FERRY=${FERRY:-$PWD/target/release/ferry}
FERRY_BEFORE=${FERRY_BEFORE:-}
PY=${PY:-/usr/bin/python3}
OUT=${OUT:-$PWD/repo-gc-index.md}
CHUNKS=1000000
REUSE=
while [ $# -gt 0 ]; do
  case $1 in
    --chunks) CHUNKS=$2; shift ;;
    --reuse) REUSE=$2; shift ;;
    *) echo "unknown argument $1"; exit 2 ;;
  esac
  shift
done
for f in "$FERRY" "$FERRY_BEFORE"; do
  [ -x "$f" ] || { echo "missing ferry binary '$f' (FERRY, FERRY_BEFORE)"; exit 1; }
done
for c in nbdkit strace openssl /usr/bin/time; do command -v "$c" >/dev/null || { echo "missing $c"; exit 1; }; done
mkdir -p "${BENCH_DIR:-/tmp/scale-bench}"
W=$(mktemp -d "${BENCH_DIR:-/tmp/scale-bench}/gcindex.XXXX") || exit 1
GPID=
cleanup() {
  [ -n "$GPID" ] && { kill "$GPID" 2>/dev/null; wait "$GPID" 2>/dev/null; }
  rm -rf "$W"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
LOG=$W/log
load() { cut -d' ' -f1 /proc/loadavg; }
# timed VAR CMD...: runs CMD under GNU time; VAR gets "seconds / MB" (or FAIL).
timed() {
  local var=$1; shift
  if /usr/bin/time -f '%e %M' -o "$W/time" "$@" >>"$LOG" 2>&1; then
    printf -v "$var" '%s / %d' "$(cut -d' ' -f1 "$W/time")" "$(($(cut -d' ' -f2 "$W/time") / 1024))"
  else
    printf -v "$var" FAIL
  fi
}

echo "load $(load) at the start ($(date -u +%H:%M:%S) UTC)"
openssl enc -aes-128-ctr -pass pass:gcindex -nosalt -pbkdf2 </dev/zero 2>/dev/null | head -c $((64 << 20)) >"$W/small.raw"
if [ -n "$REUSE" ]; then
  cp -a "$REUSE/repo" "$W/base-repo" && cp -a "$REUSE/state" "$W/base-state" &&
    { [ ! -d "$REUSE/cache" ] || cp -a "$REUSE/cache" "$W/base-cache"; } || exit 1
else
  G=$(( CHUNKS > 1048576 ? CHUNKS : 1048576 ))
  nbdkit -f -U "$W/gen.sock" python "$HERE/repo-scale-nbdkit.py" granules="$G" unique="$CHUNKS" rest=zero >>"$LOG" 2>&1 &
  GPID=$!
  for _ in $(seq 600); do [ -S "$W/gen.sock" ] && break; sleep 0.1; done
  export FERRY_STATE_DIR=$W/base-state FERRY_CACHE_DIR=$W/base-cache
  "$FERRY" repo init "$W/base-repo" >>"$LOG" 2>&1 || exit 1
  echo "building $CHUNKS chunks ($(date -u +%H:%M:%S) UTC)"
  "$FERRY" backup "nbd+unix:///?socket=$W/gen.sock" "$W/base-repo::gen" >>"$LOG" 2>&1 || { echo "the build failed: $LOG"; tail "$LOG"; exit 1; }
  kill "$GPID"; wait "$GPID" 2>/dev/null; GPID=
fi
export FERRY_STATE_DIR=$W/base-state FERRY_CACHE_DIR=$W/base-cache
# a first gc frees what the build's checkpoints left (their superseded pages, in most of its
# packs): the rows then measure a gc of what one backup left, as a nightly gc is
"$FERRY" repo gc "$W/base-repo" >>"$LOG" 2>&1 || { echo "the first gc failed"; exit 1; }
"$FERRY" backup "$W/small.raw" "$W/base-repo::small" >>"$LOG" 2>&1 || { echo "the small backup failed"; exit 1; }
SMALL=$("$FERRY" repo list --json "$W/base-repo" | $PY -c 'import json,sys; print([s["id"] for s in json.load(sys.stdin) if s["name"] == "small"][0])')
echo "repository ready ($(date -u +%H:%M:%S) UTC, load $(load)): $(du -sm "$W/base-repo" | cut -f1) MB, $(find "$W/base-repo/index" -type f | wc -l) index objects"

# the empty repository's column
export FERRY_STATE_DIR=$W/empty-state FERRY_CACHE_DIR=$W/empty-cache
"$FERRY" repo init "$W/empty" >>"$LOG" 2>&1
timed EMPTY "$FERRY" backup "$W/small.raw" "$W/empty::small"
rm -rf "$W/empty" "$W/empty-state" "$W/empty-cache"

# one binary: forget + gc, then the first backup after it and the next
row() { # NAME BINARY
  local R=$W/repo-$1 ix
  rm -rf "$R" "$W/state-$1" "$W/cache-$1"
  cp -a "$W/base-repo" "$R" && cp -a "$W/base-state" "$W/state-$1" && cp -a "$W/base-cache" "$W/cache-$1" || return 1
  export FERRY_STATE_DIR=$W/state-$1 FERRY_CACHE_DIR=$W/cache-$1
  local before; before=$(find "$R/index" -type f -printf "%f\n" | sort)
  "$2" repo forget "$R" "$SMALL" >>"$LOG" 2>&1
  timed GC "$2" repo gc "$R"
  local after; after=$(find "$R/index" -type f -printf "%f\n" | sort)
  KEPT=$(comm -12 <(echo "$before") <(echo "$after") | grep -c .)
  OBJS=$(echo "$after" | grep -c .)
  timed FIRST strace -f --seccomp-bpf -e trace=openat -o "$W/strace-$1" "$2" backup "$W/small.raw" "$R::small"
  # the directory store opens an object by its name under the directory's descriptor
  ix=0
  for f in "$R"/index/*; do
    grep -q "\"$(basename "$f")\"" "$W/strace-$1" && ix=$((ix + $(stat -c %s "$f")))
  done
  IXREAD=$ix
  IXALL=$(du -cb "$R"/index/* | tail -1 | cut -f1)
  timed NEXT "$2" backup "$W/small.raw" "$R::small"
  printf '| %s | %s | %s of %s kept (%s now) | %s | %s (%s MB of %s MB of index objects read) | %s |\n' \
    "$1" "$GC" "$KEPT" "$(echo "$before" | grep -c .)" "$OBJS" "$EMPTY" "$FIRST" $((IXREAD >> 20)) $((IXALL >> 20)) "$NEXT"
  rm -rf "$R" "$W/state-$1" "$W/cache-$1"
}
{
  echo "| binary | forget + gc: s / MB | old index objects | backup into an empty repository: s / MB | first backup after the gc: s / MB | the next: s / MB |"
  echo "|---|---|---|---|---|---|"
  row before "$FERRY_BEFORE"
  echo "   (load $(load))" >&2
  row after "$FERRY"
} | tee "$OUT"
echo "load $(load) at the end ($(date -u +%H:%M:%S) UTC); $CHUNKS chunks$([ -n "$REUSE" ] && echo ", from $REUSE"); table in $OUT"
