#!/usr/bin/env bash
# Backups into a repository (issue 29): ferry's repository against restic and borgbackup,
# side by side in one run, on the same image. Prints markdown tables.
#
#   bash bench/repo.sh           # from the project root, after cargo build --release -p ferry
#   SIZE_G=4 DIRTY_PCT=2 RUNS=1 BENCH_DIR=/var/tmp bash bench/repo.sh
#   PARTS="3 6" bash bench/repo.sh   # only the restore and serve tables
#   PARTS=8 GC_G=1 bash bench/repo.sh # only gc after 30 daily snapshots
#
# The image: SIZE_G GiB, in 1 MiB regions drawn at random (seeded): 20% holes, 30% random
# bytes (AES-CTR), 35% text-like bytes (AES-CTR mapped onto an English-like alphabet,
# about 4 bits a byte) and 15% sparse binary-like bytes (mostly zero bytes): partly
# compressible, no two chunks alike. It is written as a sparse raw file, src/disk.raw, and
# converted into vm.qcow2 (64 KiB clusters) with an empty persistent bitmap b0.
#
# Parts (PARTS="1 2 3 4 5 6" by default; 7 and 8 on request). Parts 3-6 need the repositories of days 1 and 2:
# when part 1 or 2 is not selected, its backups are still made (once, untimed, no table).
# 1. Day 1, a full backup of src/disk.raw (a local file: the same input for every tool):
#    `ferry backup src/disk.raw REPO::vm` into a new repository (`ferry repo init`; with
#    ENCRYPT=1, the default, also into an encrypted one, --encrypt); `restic backup` (restic
#    always encrypts; password file; restic's defaults: content-defined chunks of about
#    1 MiB, zstd "auto"); `borg create` (`borg init -e none`; borg's defaults: buzhash
#    chunks of about 2 MiB, lz4). Also `ferry backup vm.qcow2 REPO::vm`, the same disk read
#    from its qcow2 image, into another repository (ferry then adds its own change-tracking
#    bitmap to the image). Every run starts from an empty repository (init untimed).
#    Median wall seconds, MB/s of the image's size, repository size (du -sb) after.
# 2. Day 2: DIRTY_PCT % of the 64 KiB granules of vm.qcow2 changed (a 4 KiB write of random
#    bytes in each, at random granules, through qemu-nbd: b0 records them), exported by
#    `qemu-nbd -r -B b0` on a Unix socket; src/disk.raw is rewritten with the new contents
#    (qemu-img convert, untimed). Backups: `ferry backup --dirty-bitmap b0 --since ID URI REPO::vm`
#    (plain and encrypted repositories), `ferry backup URI REPO::vm` without the bitmap (it
#    reads everything and stores only what is new), `ferry backup vm.qcow2 REPO::vm` (the
#    stopped image with ferry's own bitmap, before qemu-nbd exports it; one run, since a run
#    replaces that bitmap), `restic backup src/disk.raw` (it rereads
#    the file: its mtime changed), `borg create`. Every run starts from a copy of the tool's
#    day-1 state (repository and cache; copy untimed). Median seconds and repository growth
#    in MB (du -sb after minus before).
# 3. Restore day 2 to a file in BENCH_DIR: `ferry copy REPO::vm out.raw` (plain and
#    encrypted; and to null: for the read side alone), `restic restore latest --target`,
#    `borg extract --sparse`; and the file system's own ceiling: `dd if=/dev/zero bs=1M` of
#    the image's allocated bytes into a new file there (the page-cache write alone, which
#    on a shared VM costs about a CPU second a GB and swings 3x between runs). MB/s of the
#    image's size; each output compared with
#    src/disk.raw (cmp). Also `ferry hash REPO::vm` (from the index) against `ferry hash
#    src/disk.raw`.
# 4. Verify every byte: `ferry repo verify`, `restic check --read-data`, `borg check
#    --verify-data`. Seconds, and MB/s of the repository's size.
# 5. Retention: forget day 1 and free its data: `ferry repo forget --keep-last 1` + `ferry
#    repo gc`, `restic forget --keep-last 1 --prune`, `borg prune --keep-last 1` + `borg
#    compact`. Seconds, and the repository's size before and after. Runs after the first
#    start from a copy of the day-2 state.
# 6. Read day 2 without restoring it (after part 5, the snapshot it kept):
#    `ferry serve REPO::vm` (plain and encrypted) against
#    qemu-nbd serving the equivalent qcow2 chain (base.qcow2 = day 1, inc.qcow2 = the day-2
#    dirty clusters over it, as `ferry copy --dirty-bitmap b0 --backing` makes it): nbdcopy
#    to null: (median seconds, MB/s), fio 4 KiB random reads (--ioengine=nbd, iodepth 64,
#    FIO_S seconds; skipped with a note when fio lacks the nbd engine), and whether the
#    export's bytes equal src/disk.raw (qemu-img compare). With FUSE, also `restic mount` and
#    `borg mount` read sequentially (dd to /dev/null).
# 6b. (With part 6, where FUSE is.) 4 KiB random reads of day 2 as a file: fio (ioengine
#    psync, FIO_S seconds, 1 job and FUSE_JOBS jobs, default 8) on restic mount's and borg
#    mount's disk.raw and, for the same path through the kernel, on the exports of part 6
#    made files by nbdfuse (libnbd).
# 7. (Not in the default PARTS.) Day 2 of a big disk: a BIG_G GiB qcow2 image (default 40)
#    with 10% of its 64 KiB granules holding data on day 1 (a 4 KiB write in each: the
#    disk's index is as large as a full disk's would be, its data cheap to make), backed up
#    by ferry; then DIRTY_PCT % of the granules changed and `ferry backup --dirty-bitmap b0`
#    from `qemu-nbd -r -B b0`. ferry only (restic and borg would reread the whole disk).
#    Median seconds of RUNS (each from a copy of day 1) and the repository's growth.
# 8. (Not in the default PARTS.) Retention after GC_DAYS (default 30) daily snapshots of a
#    GC_G GiB image (default 1; borg's repository grows by about a third of the image each
#    day of scattered changes, and holds 30 days), DIRTY_PCT % of its granules changed each
#    day; ferry backs up from `qemu-nbd -r -B b0` with --dirty-bitmap b0, restic and borg
#    reread the raw file. Then forget all but the last GC_KEEP (default 7) and free their
#    data: seconds, CPU s, snapshots and repository size before and after; ferry's gc also
#    with --repack 0 on a copy of its repository. One tool after another, one run each.
#
# The image is made by bench/repo-image.py, each day's changes by bench/repo-dirty.py (shared
# with bench/repo-s3.sh: the same repository on S3, radosgw, against restic's S3 backend).
#
# PEERS=0 leaves restic and borg out (ferry's cells only). ENCRYPT=0 leaves the encrypted
# ferry repository out.
#
# restic and borgbackup are installed with apt-get when missing (the system's configured
# sources; needs root or sudo). Needs qemu-img, qemu-nbd, nbdcopy, python3-libnbd, openssl,
# bc, cmp. Disk: about SIZE_G * 8 GiB in BENCH_DIR (default /var/tmp) with RUNS=1, about
# twice that with more runs (the copies of each tool's state that later runs start from).
# CPU s: the user + system seconds of the timed client (median), which the machine's load
# moves less than the wall seconds.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/lib.sh"
FERRY=${FERRY:-$PWD/target/release/ferry}
PY=${PY:-/usr/bin/python3}
SIZE_G=${SIZE_G:-4}
DIRTY_PCT=${DIRTY_PCT:-2}
RUNS=${RUNS:-3}
ENCRYPT=${ENCRYPT:-1}
FIO_S=${FIO_S:-5}
PARTS=${PARTS:-1 2 3 4 5 6}
PEERS=${PEERS:-1}
BIG_G=${BIG_G:-40}
GC_G=${GC_G:-1}
GC_DAYS=${GC_DAYS:-30}
GC_KEEP=${GC_KEEP:-7}
FUSE_JOBS=${FUSE_JOBS:-8}
W=$(mktemp -d "${BENCH_DIR:-/var/tmp}/repo.XXXX") || exit 1
pids=()
# unmount DIR: a FUSE mount (fusermount3 for libfuse 3's, when installed; fusermount
# unmounts those too).
unmount() { fusermount3 -u "$1" 2>/dev/null || fusermount -u "$1" 2>/dev/null; }
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  wait 2>/dev/null
  for m in "$W"/mnt-*; do [ -d "$m" ] && unmount "$m"; done
  rm -rf "$W"
}
trap cleanup EXIT
part() { [[ " $PARTS " == *" $1 "* ]]; }

# The peers, from the system's package sources when missing (install_pkg: lib.sh).
if [ "$PEERS" = 1 ]; then install_pkg restic restic; install_pkg borg borgbackup; fi
for t in qemu-img qemu-nbd nbdcopy nbdinfo openssl bc cmp; do command -v $t >/dev/null || { echo "missing $t"; exit 1; }; done
$PY -c 'import nbd' || { echo "missing python3-libnbd"; exit 1; }
[ -x "$FERRY" ] || echo "note: $FERRY missing; ferry cells will say FAIL"
echo "ferry: $("$FERRY" --version 2>/dev/null | head -1), $(restic version 2>/dev/null | cut -d' ' -f1-2), $(borg --version 2>/dev/null), $(qemu-img --version | head -1 | cut -d' ' -f1-3)"

SIZE=$((SIZE_G << 30))
GB() { [ -z "$1" ] && { echo -; return; }; printf "%.0f" "$(echo "$1 / 1000000" | bc -l)"; }  # bytes -> MB
rate() { [ "$1" = FAIL ] && { echo -; return; }; printf "%.0f" "$(echo "$SIZE / 1000000 / $1" | bc -l)"; }  # s -> MB/s of the image
med_of() { local m; m=$(echo "$1" | tr ' ' '\n' | grep -v '^$' | grep -v FAIL | med); [ -n "$m" ] && printf "%.3f\n" "$m" || echo FAIL; }
dub() { du -sb "$1" 2>/dev/null | cut -f1; }                           # apparent bytes of a tree
size_of() { [ -d "$1" ] && GB "$(dub "$1")" || echo -; }
stamp() { echo "$(date -u +%F\ %H:%M:%S) UTC, load average $(cut -d' ' -f1-3 /proc/loadavg)"; }
uri() { echo "nbd+unix:///?socket=$W/$1.sock"; }
stop_all() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; pids=(); }

# The tools' state: $W/T/repo (and the tool's cache), saved and put back between runs.
# ferry: plain repository; ferryx: encrypted; ferryf: a copy of ferry's day 1 for the
# day-2 backup without a bitmap.
FX=; [ "$ENCRYPT" = 1 ] && FX=ferryx
PEER="restic borg"; [ "$PEERS" = 1 ] || PEER=
TOOLS="ferry $FX $PEER"
echo "bench password $$" >"$W/pass"
chmod 600 "$W/pass"
# Each run starts from a copy of a tool's earlier state: to ferry's record of the
# repositories it used (docs/safety.md), a repository put back from an older copy is a
# rollback. The record goes with the copies: it is dropped whenever a state is loaded.
export FERRY_STATE_DIR=$W/ferry-state
export RESTIC_PASSWORD_FILE=$W/pass BORG_BASE_DIR=$W/borg/base BORG_UNKNOWN_UNENCRYPTED_REPO_ACCESS_IS_OK=yes
RC="--cache-dir $W/restic/cache"
# fx: ferry with the passphrase of the encrypted repository (FERRY_PASSWORD_FILE).
fx() { FERRY_PASSWORD_FILE=$W/pass "$FERRY" "$@"; }
save() { rm -rf "$W/$1.$2"; cp -a "$W/$1" "$W/$1.$2"; }   # TOOL TAG
load() { rm -rf "$W/$1" "$FERRY_STATE_DIR"; cp -a "$W/$2.$3" "$W/$1"; }      # TOOL FROM-TOOL TAG
# latest TOOL: the id of the latest snapshot in $W/TOOL/repo, the one a change map continues
# (`ferry backup --since`; looked up before a backup is timed).
latest() {
  case $1 in ferryx) fx repo list --json "$W/$1/repo" ;; *) "$FERRY" repo list --json "$W/$1/repo" ;; esac |
    $PY -c 'import json,sys; print(json.load(sys.stdin)[-1]["id"])'
}
init() { # TOOL: a new, empty repository
  rm -rf "$W/$1"; mkdir -p "$W/$1"
  case $1 in
    ferry | ferryq) "$FERRY" repo init "$W/$1/repo" ;;
    ferryx) fx repo init --encrypt "$W/ferryx/repo" ;;
    restic) restic $RC init -r "$W/restic/repo" ;;
    borg) borg init -e none "$W/borg/repo" ;;
  esac >/dev/null 2>&1
}
# backup TOOL SRC: SRC is src (the file) or an NBD URI; --bitmap as 3rd argument (the snapshot
# it continues in $SINCE).
backup() {
  case $1 in
    ferry | ferryf) "$FERRY" backup ${3:+--dirty-bitmap $3 --since $SINCE} "$2" "$W/$1/repo::vm" ;;
    ferryq) "$FERRY" backup "$W/vm.qcow2" "$W/ferryq/repo::vm" ;;
    ferryx) fx backup ${3:+--dirty-bitmap $3 --since $SINCE} "$2" "$W/$1/repo::vm" ;;
    restic) restic $RC -r "$W/restic/repo" backup "$W/src/disk.raw" ;;
    borg) (cd "$W/src" && borg create "$W/borg/repo::day$(date +%s%N)" disk.raw) ;;
  esac
}

# dirty IMAGE COUNT [SEED [RAW]]: COUNT 4 KiB writes of random bytes at distinct random 64 KiB
# granules, through qemu-nbd (read-write), stopped with SIGTERM so the bitmaps are stored; with
# RAW, the same writes into that raw file too (bench/repo-dirty.py).
dirty() {
  local sock=$W/dirty.sock
  qemu-nbd -t -f qcow2 --cache=unsafe -k "$sock" "$1" & local p=$!
  wait_sock "$sock"
  $PY "$HERE/repo-dirty.py" "nbd+unix:///?socket=$sock" "$2" "${3:-20}" ${4:+"$4"}
  kill -TERM $p; wait $p
}

declare -A T G CPU
# timed KEY CMD...: runs CMD in this shell; appends its wall seconds to T[KEY] (FAIL if it
# fails) and the CPU seconds (user + system) of the processes it ran to CPU[KEY]: the
# client's CPU, not that of servers started before it. On this shared machine the CPU
# seconds move less with the load than the wall seconds do.
tsum() { awk 'NR == 2 { for (i = 1; i <= 2; i++) { split($i, a, "m"); s += a[1] * 60 + a[2] } print s }' "$1"; }
timed() {
  local k=$1 s e c0 c1; shift
  times >"$W/times.0"; s=$(date +%s.%N)
  if "$@" >/dev/null 2>&1; then
    e=$(date +%s.%N); times >"$W/times"
    c0=$(tsum "$W/times.0"); c1=$(tsum "$W/times")
    T[$k]+="$(echo "$e - $s" | bc -l) "; CPU[$k]+="$(echo "$c1 - $c0" | bc -l) "
  else T[$k]+="FAIL "; fi
}
cpu_of() { med_of "${CPU[$1]:-}" | sed 's/FAIL/-/'; }
if part 1 || part 2 || part 3 || part 4 || part 5 || part 6; then
# --- The image (day 1) ---------------------------------------------------------------
mkdir -p "$W/src"
$PY "$HERE/repo-image.py" "$W/src/disk.raw" "$SIZE"
qemu-img convert -f raw -O qcow2 "$W/src/disk.raw" "$W/vm.qcow2"
qemu-img bitmap --add "$W/vm.qcow2" b0
part 6 && qemu-img convert -f raw -O qcow2 "$W/src/disk.raw" "$W/base.qcow2"
ALLOC=$(($(du -s --block-size=1 "$W/src/disk.raw" | cut -f1)))
ZSTD=$(command -v zstd >/dev/null && zstd -3 -q -c "$W/src/disk.raw" | wc -c)
echo "image: ${SIZE_G} GiB ($(GB "$SIZE") MB), $(GB "$ALLOC") MB allocated${ZSTD:+, $(GB "$ZSTD") MB as one zstd -3 stream}; files in $W"

# --- 1. Day 1 ------------------------------------------------------------------------
D1="ferry ferryq $FX $PEER"
n=$RUNS; part 1 || n=1
for r in $(seq "$n"); do
  for t in $D1; do init "$t"; timed "$t" backup "$t" "$W/src/disk.raw"; done
done
# Copies of the state to start each later run from (only what RUNS > 1 needs; ferry's
# day 1 always, for the day-2 backup without a bitmap).
save ferry day1
if [ "$RUNS" -gt 1 ]; then for t in $D1; do [ $t = ferry ] || save "$t" day1; done; fi
if part 1; then
  echo
  echo "== 1. day 1: full backup of a ${SIZE_G} GiB image, a local sparse raw file ($(stamp), median of $RUNS)"
  echo
  echo "| backup | median s | MB/s of the image | CPU s | repository MB |"
  echo "|---|---|---|---|---|"
  for t in $D1; do
    case $t in
      ferry) label='`ferry backup disk.raw REPO::vm`' ;;
      ferryq) label='`ferry backup vm.qcow2 REPO::vm` (the same disk as a qcow2 image; ferry adds its own change-tracking bitmap)' ;;
      ferryx) label='the same, encrypted repository (`--encrypt`)' ;;
      restic) label='`restic backup disk.raw` (encrypted, zstd auto)' ;;
      borg) label='`borg create REPO::day1 disk.raw` (`-e none`, lz4)' ;;
    esac
    m=$(med_of "${T[$t]}")
    printf "| %s | %s | %s | %s | %s |\n" "$label" "$m" "$(rate "$m")" "$(cpu_of "$t")" "$(size_of "$W/$t/repo")"
  done
fi

# --- 2. Day 2 ------------------------------------------------------------------------
NDIRTY=$(( (SIZE_G << 14) * DIRTY_PCT / 100 ))
dirty "$W/vm.qcow2" "$NDIRTY"
qemu-img convert -f qcow2 -O raw "$W/vm.qcow2" "$W/src/disk.raw.new" && mv "$W/src/disk.raw.new" "$W/src/disk.raw"
# The stopped VM's image with ferry's own bitmap: one run (a run replaces that bitmap), before
# qemu-nbd exports the image (ferry opens it for writing).
before=$(dub "$W/ferryq/repo")
timed d2:ferryq backup ferryq
after=$(dub "$W/ferryq/repo")
[ -n "$before" ] && [ -n "$after" ] && G[ferryq]="$((after - before))"
qemu-nbd -t -r -B b0 -f qcow2 -k "$W/src.sock" "$W/vm.qcow2" 2>"$W/src.log" & pids+=($!)
wait_sock "$W/src.sock"
SRC=$(uri src)
DIRTYMAP=$(nbdinfo --map=qemu:dirty-bitmap:b0 "$SRC" 2>/dev/null | awk '$3 == 1 {n++; b += $2} END {printf "%d extents, %.1f MiB", n, b/1048576}')
part 6 && "$FERRY" copy --dirty-bitmap b0 --backing "$W/base.qcow2" "$SRC" "$W/inc.qcow2" >/dev/null 2>&1
D2="ferry $FX ferryf $PEER"
n=$RUNS; part 2 || n=1
for r in $(seq "$n"); do
  for t in $D2; do
    from=$t; [ $t = ferryf ] && from=ferry
    [ "$r" -gt 1 ] || [ $t = ferryf ] && load "$t" "$from" day1
    before=$(dub "$W/$t/repo")
    case $t in
      ferry | ferryx) SINCE=$(latest "$t"); timed d2:$t backup "$t" "$SRC" b0 ;;
      ferryf) timed d2:$t backup "$t" "$SRC" ;;
      *) timed d2:$t backup "$t" src ;;
    esac
    after=$(dub "$W/$t/repo")
    [ -n "$before" ] && [ -n "$after" ] && G[$t]+="$((after - before)) "
  done
done
rm -rf "$W"/*.day1 "$W/ferryf" "$W/ferryq"
if [ "$RUNS" -gt 1 ]; then for t in $TOOLS; do save "$t" day2; done; fi
if part 2; then
  echo
  echo "== 2. day 2: ${DIRTY_PCT}% of the 64 KiB granules changed ($NDIRTY; b0: $DIRTYMAP) ($(stamp), median of $RUNS)"
  echo
  echo "| backup | median s | CPU s | repository growth MB |"
  echo "|---|---|---|---|"
  for t in $D2 ferryq; do
    case $t in
      ferryq) label='`ferry backup vm.qcow2 REPO::vm`: the stopped image, ferry'"'"'s own bitmap (one run)' ;;
      ferry) label='`ferry backup --dirty-bitmap b0 --since ID URI REPO::vm` (qemu-nbd -r -B b0)' ;;
      ferryx) label='the same, encrypted repository' ;;
      ferryf) label='`ferry backup URI REPO::vm` without the bitmap (reads all, stores what is new)' ;;
      restic) label='`restic backup disk.raw` (rereads the file)' ;;
      borg) label='`borg create REPO::day2 disk.raw` (rereads the file)' ;;
    esac
    g=$(echo "${G[$t]}" | tr ' ' '\n' | grep -v '^$' | med)
    printf "| %s | %s | %s | %s |\n" "$label" "$(med_of "${T[d2:$t]}")" "$(cpu_of "d2:$t")" "$(GB "$g")"
  done
fi

# --- 3. Restore ----------------------------------------------------------------------
restore() { # TOOL
  rm -rf "$W/out"; mkdir -p "$W/out"
  case $1 in
    ferry) "$FERRY" copy "$W/ferry/repo::vm" "$W/out/disk.raw" ;;
    ferryx) fx copy "$W/ferryx/repo::vm" "$W/out/disk.raw" ;;
    ferry0) "$FERRY" copy "$W/ferry/repo::vm" null: ;;
    # The file system's write path alone: the bytes the image has allocated, written by dd
    # into a new file there (what no restore to a file can beat on this host).
    ceiling) dd if=/dev/zero of="$W/out/disk.raw" bs=1M count=$((ALLOC >> 20)) status=none ;;
    restic) restic $RC -r "$W/restic/repo" restore latest --target "$W/out" && mv "$W/out$W/src/disk.raw" "$W/out/disk.raw" ;;
    borg) (cd "$W/out" && borg extract --sparse "$W/borg/repo::$(borg list --last 1 --short "$W/borg/repo")") ;;
  esac
}
R="ferry $FX ferry0 ceiling $PEER"
if part 3; then
  declare -A SAME
  for r in $(seq "$RUNS"); do
    for t in $R; do
      timed r:$t restore "$t"
      # the last run's output, compared with day 2
      [ "$r" = "$RUNS" ] && [ $t != ferry0 ] && [ $t != ceiling ] && [ -f "$W/out/disk.raw" ] &&
        { cmp -s "$W/out/disk.raw" "$W/src/disk.raw" && SAME[$t]=yes || SAME[$t]=NO; }
    done
  done
  echo
  echo "== 3. restore day 2 to a file in ${BENCH_DIR:-/var/tmp} ($(stamp), median of $RUNS)"
  echo
  echo "| restore | median s | MB/s of the image | CPU s | equals day 2 |"
  echo "|---|---|---|---|---|"
  for t in $R; do
    case $t in
      ferry) label='`ferry copy REPO::vm out.raw`' ;;
      ferryx) label='the same, encrypted repository' ;;
      ferry0) label='`ferry copy REPO::vm null:` (reading only)' ;;
      ceiling) label='`dd if=/dev/zero bs=1M` of the allocated bytes (the file system'"'"'s write alone)' ;;
      restic) label='`restic restore latest --target DIR`' ;;
      borg) label='`borg extract --sparse REPO::day2`' ;;
    esac
    m=$(med_of "${T[r:$t]}")
    printf "| %s | %s | %s | %s | %s |\n" "$label" "$m" "$(rate "$m")" "$(cpu_of "r:$t")" "${SAME[$t]:--}"
  done
  rm -rf "$W/out"
  h1=$("$FERRY" hash "$W/ferry/repo::vm" 2>/dev/null | awk '{print $1}')
  h2=$("$FERRY" hash "$W/src/disk.raw" 2>/dev/null | awk '{print $1}')
  ht=$(med_of "$(secs "$FERRY" hash "$W/ferry/repo::vm")")
  echo
  if [ -n "$h1" ] && [ "$h1" = "$h2" ]; then echo "ferry hash REPO::vm (from the index, ${ht}s) equals ferry hash disk.raw: yes"
  else echo "ferry hash REPO::vm: '${h1:-FAIL}' against disk.raw: '${h2:-FAIL}': NO"; fi
fi

# --- 4. Verify -----------------------------------------------------------------------
verify() {
  case $1 in
    ferry) "$FERRY" repo verify "$W/ferry/repo" ;;
    ferryx) fx repo verify "$W/ferryx/repo" ;;
    restic) restic $RC -r "$W/restic/repo" check --read-data ;;
    borg) borg check --verify-data "$W/borg/repo" ;;
  esac
}
if part 4; then
  for r in $(seq "$RUNS"); do for t in $TOOLS; do timed v:$t verify "$t"; done; done
  echo
  echo "== 4. verify every stored byte, 2 snapshots ($(stamp), median of $RUNS)"
  echo
  echo "| verify | median s | CPU s | repository MB | MB/s of the repository |"
  echo "|---|---|---|---|---|"
  for t in $TOOLS; do
    case $t in
      ferry) label='`ferry repo verify REPO`' ;;
      ferryx) label='the same, encrypted repository' ;;
      restic) label='`restic check --read-data`' ;;
      borg) label='`borg check --verify-data`' ;;
    esac
    m=$(med_of "${T[v:$t]}"); b=$(dub "$W/$t/repo")
    [ "$m" = FAIL ] || [ -z "$b" ] && v=- || v=$(printf "%.0f" "$(echo "$b / 1000000 / $m" | bc -l)")
    printf "| %s | %s | %s | %s | %s |\n" "$label" "$m" "$(cpu_of "v:$t")" "$(GB "$b")" "$v"
  done
fi

# --- 5. Retention --------------------------------------------------------------------
retain() {
  case $1 in
    ferry) "$FERRY" repo forget "$W/ferry/repo" --keep-last 1 && "$FERRY" repo gc "$W/ferry/repo" ;;
    ferryx) fx repo forget "$W/ferryx/repo" --keep-last 1 && fx repo gc "$W/ferryx/repo" ;;
    restic) restic $RC -r "$W/restic/repo" forget --keep-last 1 --prune ;;
    borg) borg prune --keep-last 1 "$W/borg/repo" && borg compact "$W/borg/repo" ;;
  esac
}
if part 5; then
  declare -A S
  for r in $(seq "$RUNS"); do
    for t in $TOOLS; do
      [ "$r" = 1 ] || load "$t" "$t" day2
      S[$t:b]=$(dub "$W/$t/repo")
      timed g:$t retain "$t"; S[$t:a]=$(dub "$W/$t/repo")
    done
  done
  echo
  echo "== 5. retention: forget day 1 and free its data ($(stamp), median of $RUNS)"
  echo
  echo "| forget + gc | median s | CPU s | repository MB before | after |"
  echo "|---|---|---|---|---|"
  for t in $TOOLS; do
    case $t in
      ferry) label='`ferry repo forget --keep-last 1` + `ferry repo gc`' ;;
      ferryx) label='the same, encrypted repository' ;;
      restic) label='`restic forget --keep-last 1 --prune`' ;;
      borg) label='`borg prune --keep-last 1` + `borg compact`' ;;
    esac
    printf "| %s | %s | %s | %s | %s |\n" "$label" "$(med_of "${T[g:$t]}")" "$(cpu_of "g:$t")" "$(GB "${S[$t:b]}")" "$(GB "${S[$t:a]}")"
  done
fi

# --- 6. Reading a snapshot in place --------------------------------------------------
if part 6; then
  stop_all
  serve() { # NAME: an export of day 2 on $W/NAME.sock
    rm -f "$W/$1.sock"
    case $1 in
      ferry) exec "$FERRY" serve -r -U "$W/ferry.sock" "$W/ferry/repo::vm" ;;
      ferryx) FERRY_PASSWORD_FILE=$W/pass exec "$FERRY" serve -r -U "$W/ferryx.sock" "$W/ferryx/repo::vm" ;;
      qemu) exec qemu-nbd -t -r -f qcow2 -k "$W/qemu.sock" "$W/inc.qcow2" ;;
    esac 2>"$W/$1.log" & pids+=($!)
    wait_sock "$W/$1.sock"
  }
  S6="ferry $FX qemu"
  for s in $S6; do serve $s; done
  FIO_NBD=no; fio --enghelp 2>/dev/null | grep -qw nbd && FIO_NBD=yes
  iops() {
    fio --name=r --ioengine=nbd --uri="$(uri "$1")" --rw=randread --bs=4k --iodepth=64 \
      --runtime="$FIO_S" --time_based --output-format=json 2>/dev/null | sed -n '/^{/,$p' |
      $PY -c 'import json,sys; print(round(json.load(sys.stdin)["jobs"][0]["read"]["iops"]))' 2>/dev/null || echo FAIL
  }
  for r in $(seq "$RUNS"); do for s in $S6; do T[s:$s]+="$(secs nbdcopy "$(uri $s)" null:) "; done; done
  echo
  echo "== 6. reading day 2 in place, exports on Unix sockets ($(stamp), median of $RUNS)"
  echo
  echo "| export | nbdcopy to null: median s | MB/s | fio 4k randread IOPS (iodepth 64, ${FIO_S} s) | equals day 2 |"
  echo "|---|---|---|---|---|"
  for s in $S6; do
    case $s in
      ferry) label='`ferry serve -r REPO::vm`' ;;
      ferryx) label='the same, encrypted repository' ;;
      qemu) label='`qemu-nbd -r` on inc.qcow2 (day-2 clusters) over base.qcow2 (day 1)' ;;
    esac
    m=$(med_of "${T[s:$s]}")
    if [ -S "$W/$s.sock" ]; then
      [ $FIO_NBD = yes ] && io=$(iops $s) || io="-"
      qemu-img compare -q -f raw -F raw "$(uri $s)" "$W/src/disk.raw" 2>/dev/null && eq=yes || eq=NO
    else io=FAIL; eq=-; fi
    printf "| %s | %s | %s | %s | %s |\n" "$label" "$m" "$(rate "$m")" "$io" "$eq"
  done
  [ $FIO_NBD = yes ] || echo "note: this fio has no nbd engine: IOPS not measured"
  # restic mount / borg mount: the day-2 file read sequentially through FUSE (dd), then 4 KiB
  # random reads of it by fio (6b), the same fio job on the NBD exports above made files by
  # nbdfuse (libnbd's FUSE file: the same kernel path as restic's and borg's files).
  HAVE_FUSE=no; [ -c /dev/fuse ] && { command -v fusermount3 || command -v fusermount; } >/dev/null && HAVE_FUSE=yes
  declare -A FF=()   # reader -> its file through FUSE
  if [ $HAVE_FUSE = yes ]; then
    if [ "$PEERS" = 1 ]; then
      mkdir -p "$W/mnt-restic" "$W/mnt-borg"
      restic $RC -r "$W/restic/repo" mount "$W/mnt-restic" >/dev/null 2>&1 & pids+=($!)
      borg mount "$W/borg/repo" "$W/mnt-borg" >/dev/null 2>&1
      for i in $(seq 100); do
        FF[restic]=$(ls "$W/mnt-restic/snapshots/latest$W/src/disk.raw" 2>/dev/null)
        [ -n "${FF[restic]}" ] && break; sleep 0.1
      done
      FF[borg]=$(ls -d "$W"/mnt-borg/*/disk.raw 2>/dev/null | sort | tail -1)
    fi
    if command -v nbdfuse >/dev/null; then
      for s in $S6; do
        [ -S "$W/$s.sock" ] || continue
        mkdir -p "$W/mnt-nbd-$s"
        nbdfuse -r "$W/mnt-nbd-$s/disk" --unix "$W/$s.sock" >/dev/null 2>&1 & pids+=($!)
        for i in $(seq 100); do [ -f "$W/mnt-nbd-$s/disk" ] && break; sleep 0.1; done
        [ -f "$W/mnt-nbd-$s/disk" ] && FF[$s]=$W/mnt-nbd-$s/disk
      done
    fi
  fi
  if [ "$PEERS" != 1 ]; then :
  elif [ $HAVE_FUSE = yes ]; then
    for pair in "restic mount:${FF[restic]:-}" "borg mount:${FF[borg]:-}"; do
      f=${pair#*:}
      [ -n "$f" ] && { t=$(med_of "$(secs dd if="$f" of=/dev/null bs=1M)"); c=$(cmp -s "$f" "$W/src/disk.raw" && echo yes || echo NO); } || { t=FAIL; c=-; }
      printf "| %s, \`dd bs=1M\` of the file to /dev/null (one run) | %s | %s | - | %s |\n" "${pair%%:*}" "$t" "$(rate "$t")" "$c"
    done
  else
    echo "note: no FUSE here: restic mount and borg mount not measured"
  fi
  # 6b. fio 4 KiB random reads of the file through FUSE: ioengine psync (one read at a time
  # per job; FUSE files take no O_DIRECT, and buffered libaio would not queue), fio's
  # defaults invalidate the page cache before the run and advise random access (no read-
  # ahead); 1 job, then FUSE_JOBS jobs (threads) reading at once. One run each.
  if [ $HAVE_FUSE = yes ] && [ ${#FF[@]} -gt 0 ]; then
    fuse_iops() { # FILE JOBS
      fio --name=r --filename="$1" --readonly --rw=randread --bs=4k --ioengine=psync \
        --numjobs="$2" --thread --group_reporting --runtime="$FIO_S" --time_based \
        --output-format=json 2>/dev/null | sed -n '/^{/,$p' |
        $PY -c 'import json,sys; print(round(json.load(sys.stdin)["jobs"][0]["read"]["iops"]))' 2>/dev/null || echo FAIL
    }
    echo
    echo "== 6b. 4 KiB random reads of day 2 as a file through FUSE, fio psync, ${FIO_S} s each ($(stamp))"
    echo
    echo "| reader | fio IOPS, 1 job | fio IOPS, $FUSE_JOBS jobs |"
    echo "|---|---|---|"
    for s in $S6 restic borg; do
      f=${FF[$s]:-}; [ -n "$f" ] || continue
      case $s in
        ferry) label='`ferry serve -r REPO::vm`, as a file by `nbdfuse -r`' ;;
        ferryx) label='the same, encrypted repository' ;;
        qemu) label='`qemu-nbd -r` on the qcow2 chain, as a file by `nbdfuse -r`' ;;
        restic) label='`restic mount`, the snapshot'"'"'s disk.raw' ;;
        borg) label='`borg mount`, the archive'"'"'s disk.raw' ;;
      esac
      printf "| %s | %s | %s |\n" "$label" "$(fuse_iops "$f" 1)" "$(fuse_iops "$f" "$FUSE_JOBS")"
    done
  fi
  for m in "$W"/mnt-*; do [ -d "$m" ] && unmount "$m"; done
fi

fi # parts 1-6

# --- 7. Day 2 of a big disk (ferry only) ----------------------------------------------
if part 7; then
  stop_all
  rm -rf "$W"/*.day1 "$W"/*.day2 "$W/inc.qcow2" "$W/base.qcow2"
  qemu-img create -q -f qcow2 "$W/big.qcow2" "${BIG_G}G"
  dirty "$W/big.qcow2" $(( (BIG_G << 14) / 10 )) 7
  qemu-img bitmap --add "$W/big.qcow2" b0
  rm -rf "$W/ferryb"; mkdir -p "$W/ferryb"; "$FERRY" repo init "$W/ferryb/repo" >/dev/null 2>&1
  t1=$(secs "$FERRY" backup "$W/big.qcow2" "$W/ferryb/repo::big")
  [ "$RUNS" = 1 ] || save ferryb day1
  NB=$(( (BIG_G << 14) * DIRTY_PCT / 100 ))
  dirty "$W/big.qcow2" "$NB" 8
  qemu-nbd -t -r -B b0 -f qcow2 -k "$W/big.sock" "$W/big.qcow2" 2>"$W/big.log" & pids+=($!)
  wait_sock "$W/big.sock"
  BM=$(nbdinfo --map=qemu:dirty-bitmap:b0 "$(uri big)" 2>/dev/null | awk '$3 == 1 {n++; b += $2} END {printf "%d extents, %.1f MiB", n, b/1048576}')
  for r in $(seq "$RUNS"); do
    [ "$r" = 1 ] || load ferryb ferryb day1
    before=$(dub "$W/ferryb/repo")
    SINCE=$("$FERRY" repo list --json "$W/ferryb/repo" | $PY -c 'import json,sys; print(json.load(sys.stdin)[-1]["id"])')
    T[big]+="$(secs "$FERRY" backup --dirty-bitmap b0 --since "$SINCE" "$(uri big)" "$W/ferryb/repo::big") "
    after=$(dub "$W/ferryb/repo"); [ -n "$before" ] && [ -n "$after" ] && G[big]+="$((after - before)) "
  done
  g=$(echo "${G[big]:-}" | tr ' ' '\n' | grep -v '^$' | med)
  echo
  echo "== 7. day 2 of a ${BIG_G} GiB disk: ${DIRTY_PCT}% of its granules changed ($NB; b0: $BM) ($(stamp), median of $RUNS)"
  echo
  echo "| backup | median s | repository growth MB |"
  echo "|---|---|---|"
  printf "| %s | %s | %s |\n" "day 1: \`ferry backup big.qcow2 REPO::big\` (10% of the granules hold data; one run)" "$(med_of "$t1")" "$(size_of "$W/ferryb/repo")"
  printf "| %s | %s | %s |\n" "day 2: \`ferry backup --dirty-bitmap b0 --since ID URI REPO::big\` (qemu-nbd -r -B b0)" "$(med_of "${T[big]:-}")" "$(GB "$g")"
fi

# --- 8. Retention after GC_DAYS daily snapshots ----------------------------------------
# Each tool in turn (so that only one tool's repository is on the disk at a time) takes
# GC_DAYS daily snapshots of the same GC_G GiB image: day 1 a full backup of the raw file,
# then each day DIRTY_PCT % of the 64 KiB granules changed (4 KiB writes at random granules,
# seeded by the day: every tool sees the same days) in vm.qcow2 through qemu-nbd (bitmap b0
# records them) and in its raw twin disk.raw; ferry backs up `qemu-nbd -r -B b0`
# with --dirty-bitmap b0 (then `qemu-img bitmap --clear`, as a pull-mode backup does),
# restic and borg reread disk.raw. Then all but the last GC_KEEP are forgotten and their data
# freed, timed: `ferry repo forget --keep-last N` + `ferry repo gc` (and, on a copy of the
# same repository, + `ferry repo gc --repack 0`), `restic forget --keep-last N --prune`,
# `borg prune --keep-last N` + `borg compact`. One run each.
if part 8; then
  stop_all
  # Room: the state of parts 1-7 is not needed any more.
  rm -rf "$W"/*.day1 "$W"/*.day2 "$W"/*.qcow2 "$W/src" "$W/ferry" "$W/ferryx" "$W/ferryb" "$W/restic" "$W/borg" "$W/out"
  G8=$W/gc; mkdir -p "$G8"
  $PY "$HERE/repo-image.py" "$G8/day1.raw" $((GC_G << 30))
  qemu-img convert -f raw -O qcow2 "$G8/day1.raw" "$G8/day1.qcow2"
  qemu-img bitmap --add "$G8/day1.qcow2" b0
  NG=$(( (GC_G << 14) * DIRTY_PCT / 100 ))
  avail() { df -k --output=avail "$W" | tail -1; }
  daily() { # TOOL DAY
    case $1 in
      ferry)
        if [ "$2" = 1 ]; then "$FERRY" backup "$G8/disk.raw" "$W/ferry/repo::vm"
        else
          qemu-nbd -t -r -B b0 -f qcow2 -k "$W/gc.sock" "$G8/vm.qcow2" 2>"$W/gc.log" & local p=$!
          wait_sock "$W/gc.sock"
          "$FERRY" backup --dirty-bitmap b0 --since "$SINCE" "$(uri gc)" "$W/ferry/repo::vm"; local rc=$?
          kill $p; wait $p 2>/dev/null
          [ $rc = 0 ] && qemu-img bitmap --clear "$G8/vm.qcow2" b0
        fi ;;
      restic) restic $RC -r "$W/restic/repo" backup "$G8/disk.raw" ;;
      borg) (cd "$G8" && borg create "$W/borg/repo::day$2" disk.raw) ;;
    esac
  }
  forget() { # TOOL (ferry0: ferry's copy, gc --repack 0)
    case $1 in
      ferry) "$FERRY" repo forget "$W/ferry/repo" --keep-last "$GC_KEEP" && "$FERRY" repo gc "$W/ferry/repo" ;;
      ferry0) "$FERRY" repo forget "$W/ferry0/repo" --keep-last "$GC_KEEP" && "$FERRY" repo gc --repack 0 "$W/ferry0/repo" ;;
      restic) restic $RC -r "$W/restic/repo" forget --keep-last "$GC_KEEP" --prune ;;
      borg) borg prune --keep-last "$GC_KEEP" "$W/borg/repo" && borg compact "$W/borg/repo" ;;
    esac
  }
  count() { # TOOL: the snapshots the repository lists
    case $1 in
      ferry | ferry0) "$FERRY" repo list --json "$W/$1/repo" | $PY -c 'import json,sys; print(len(json.load(sys.stdin)))' ;;
      restic) restic $RC -r "$W/restic/repo" snapshots --json | $PY -c 'import json,sys; print(len(json.load(sys.stdin)))' ;;
      borg) borg list --short "$W/borg/repo" | grep -c . ;;
    esac 2>/dev/null
  }
  declare -A S8 DAYS8
  for t in ferry $PEER; do
    cp --sparse=always "$G8/day1.raw" "$G8/disk.raw"; cp "$G8/day1.qcow2" "$G8/vm.qcow2"
    init "$t"
    DAYS8[$t]=$GC_DAYS
    for d in $(seq "$GC_DAYS"); do
      if [ "$(avail)" -lt $((3 << 20)) ]; then DAYS8[$t]="$((d - 1)) (stopped: less than 3 GiB free)"; break; fi
      [ "$d" = 1 ] || dirty "$G8/vm.qcow2" "$NG" $((100 + d)) "$G8/disk.raw"
      SINCE=; [ "$t" = ferry ] && [ "$d" -gt 1 ] && SINCE=$(latest ferry)
      timed "g8d$d:$t" daily "$t" "$d"
      [ "$d" = 1 ] || T[g8days:$t]+="${T[g8d$d:$t]} "
    done
    S8[$t:n]=$(count "$t")
    [ $t = ferry ] && { rm -rf "$W/ferry0" "$FERRY_STATE_DIR"; cp -a "$W/ferry" "$W/ferry0"; S8[ferry0:n]=${S8[ferry:n]}; }
    for u in $t $([ $t = ferry ] && echo ferry0); do
      S8[$u:b]=$(dub "$W/$u/repo")
      S8[$u:load]=$(cut -d' ' -f1 /proc/loadavg)
      timed "g8:$u" forget "$u"
      S8[$u:a]=$(dub "$W/$u/repo"); S8[$u:k]=$(count "$u")
      case $u in ferry | ferry0) "$FERRY" repo verify "$W/$u/repo" >/dev/null 2>&1 && S8[$u:v]=yes || S8[$u:v]=NO ;; esac
      [ $u = ferry ] || rm -rf "$W/$u"
    done
    rm -rf "$W/ferry"
  done
  echo
  echo "== 8. retention after $GC_DAYS daily snapshots of a ${GC_G} GiB image (${DIRTY_PCT}% of the granules, $NG, changed each day): forget all but the last $GC_KEEP and free their data ($(stamp), one run)"
  echo
  echo "| forget + gc | s | CPU s | load | snapshots before | after | repository MB before | after | days 2-$GC_DAYS: backup s in all (median a day) |"
  echo "|---|---|---|---|---|---|---|---|---|"
  for u in ferry ferry0 $PEER; do
    case $u in
      ferry) label='`ferry repo forget --keep-last '$GC_KEEP'` + `ferry repo gc` (repacks a pack when at least 10% of it is unused)'" (verify after: ${S8[ferry:v]:--})" ;;
      ferry0) label='the same repository, + `ferry repo gc --repack 0` (repacks every pack with unused chunks)'" (verify after: ${S8[ferry0:v]:--})" ;;
      restic) label='`restic forget --keep-last '$GC_KEEP' --prune`' ;;
      borg) label='`borg prune --keep-last '$GC_KEEP'` + `borg compact`' ;;
    esac
    src=$u; [ $u = ferry0 ] && src=ferry
    ds=$(echo "${T[g8days:$src]:-}" | tr ' ' '\n' | grep -v '^$' | grep -v FAIL | awk '{s += $1} END {printf "%.1f", s}')
    dm=$(med_of "${T[g8days:$src]:-}")
    nf=$(echo "${T[g8days:$src]:-}" | tr ' ' '\n' | grep -c FAIL)
    [ "$nf" = 0 ] && nf= || nf=", $nf FAILED"
    printf "| %s | %s | %s | %s | %s | %s | %s | %s | %s (%s)%s |\n" "$label" "$(med_of "${T[g8:$u]:-}")" "$(cpu_of "g8:$u")" "${S8[$u:load]:--}" \
      "${S8[$src:n]:--}${DAYS8[$src]:+ of ${DAYS8[$src]}}" "${S8[$u:k]:--}" "$(GB "${S8[$u:b]:-}")" "$(GB "${S8[$u:a]:-}")" "$ds" "$dm" "$nf"
  done
fi
