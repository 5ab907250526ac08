#!/usr/bin/env bash
# Backups into a repository on S3 (issue 29): ferry's repository at s3://BUCKET/PREFIX
# against restic's S3 backend, side by side in one run, on Ceph's radosgw (a throwaway
# single-node cluster: scripts/ceph-cluster with CEPH_RGW=1, one monitor, one memstore OSD
# and radosgw on the same cores as the clients; plain HTTP on 127.0.0.1). Borg has no S3
# backend (borg 1.x stores a repository on a file system or over SSH only): no borg cells.
# Prints markdown tables.
#
#   bash bench/repo-s3.sh            # from the project root, after cargo build --release -p ferry
#   S3_G=2 DIRTY_PCT=2 BENCH_DIR=/var/tmp bash bench/repo-s3.sh
#   S3_BACKEND=moto bash bench/repo-s3.sh   # moto_server instead of radosgw
#
# The image: S3_G GiB (default 2) made by bench/repo-image.py (as bench/repo.sh makes it:
# holes, random, text-like and sparse binary-like 1 MiB regions), a sparse raw file
# src/disk.raw and its qcow2 twin vm.qcow2 with an empty persistent bitmap b0.
# 1. Day 1, a full backup of src/disk.raw: `ferry backup disk.raw s3://ferry/repo::vm`
#    (`ferry repo init s3://ferry/repo` untimed; also into s3://ferry/nobitmap, untimed, for
#    the day-2 row without a bitmap) and `restic -r s3:ENDPOINT/restic backup disk.raw`
#    (restic's defaults; it encrypts). Seconds, MB/s of the image, the client's CPU s, the
#    cluster's CPU s meanwhile (radosgw + OSD + monitor, from /proc), the stored bytes (the
#    sizes of the objects under the repository's prefix).
# 2. Day 2: DIRTY_PCT % of the 64 KiB granules changed (bench/repo-dirty.py: 4 KiB writes at
#    random granules of vm.qcow2 through qemu-nbd, b0 records them, and the same bytes in
#    src/disk.raw). `ferry backup --dirty-bitmap b0 --since ID URI s3://ferry/repo::vm` from `qemu-nbd
#    -r -B b0`; `ferry backup URI s3://ferry/nobitmap::vm` without the bitmap (reads all,
#    stores what is new); `restic backup disk.raw` (rereads the file). Seconds, CPU s and
#    the growth of the stored bytes.
# 3. Restore day 2 from S3 into a file in BENCH_DIR: `ferry copy s3://ferry/repo::vm
#    out.raw` (and to null:), `restic restore latest --target DIR`; each output compared with
#    src/disk.raw (cmp).
# One run of each cell: on a shared machine, compare within the run (the load average is
# printed with each table).
#
# Needs radosgw (Debian's radosgw, ceph-mon, ceph-osd, ceph-common), python3 with boto3 (to
# make the bucket and sum object sizes), qemu-img, qemu-nbd, python3-libnbd, openssl, bc, cmp.
# With S3_BACKEND=moto, or when the cluster does not start, moto_server (`pip install
# 'moto[server]'`) instead, and the tables say so. restic is installed with apt-get when
# missing (needs root or sudo). Disk: about S3_G * 3 GiB in BENCH_DIR; memory: the memstore
# OSD holds every stored byte (about S3_G * 2.5 GB with both tools' repositories).
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/lib.sh"
FERRY=${FERRY:-$PWD/target/release/ferry}
PY=${PY:-/usr/bin/python3}      # with python3-libnbd
BOTO_PY=${BOTO_PY:-python3}     # with boto3
S3_G=${S3_G:-2}
DIRTY_PCT=${DIRTY_PCT:-2}
BACKEND=${S3_BACKEND:-radosgw}
[ -x "$FERRY" ] || { echo "no ferry binary at $FERRY: cargo build --release -p ferry, or set FERRY" >&2; exit 1; }
for t in qemu-img qemu-nbd openssl bc cmp; do command -v $t >/dev/null || { echo "missing $t" >&2; exit 1; }; done
$PY -c 'import nbd' 2>/dev/null || { echo "$PY has no nbd module: apt-get install python3-libnbd (or set PY)" >&2; exit 1; }
$BOTO_PY -c 'import boto3' 2>/dev/null || { echo "$BOTO_PY has no boto3: apt-get install python3-boto3, pip install boto3 (or set BOTO_PY)" >&2; exit 1; }
if ! command -v restic >/dev/null; then
  sudo=; [ "$(id -u)" = 0 ] || sudo="sudo -n"
  echo "installing restic with apt-get"
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q restic >/dev/null 2>&1 ||
    { $sudo apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q restic >/dev/null 2>&1; } ||
    echo "note: could not install restic: its cells will say FAIL"
fi

W=$(mktemp -d "${BENCH_DIR:-/var/tmp}/repos3.XXXX") || exit 1
C=$(mktemp -d "/tmp/repos3-cluster.XXXX") || { rm -rf "$W"; exit 1; }
rmdir "$C"
pids=()
MOTO_PID=
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  [ -n "$MOTO_PID" ] && kill "$MOTO_PID" 2>/dev/null
  wait 2>/dev/null
  [ -d "$C" ] && "$HERE/../scripts/ceph-cluster" stop "$C"
  rm -rf "$W"
}
trap cleanup EXIT
stamp() { echo "$(date -u +%F\ %H:%M:%S) UTC, load average $(cut -d' ' -f1-3 /proc/loadavg)"; }
SIZE=$((S3_G << 30))

# --- The S3 API ----------------------------------------------------------------------
for v in AWS_PROFILE AWS_SESSION_TOKEN AWS_CONFIG_FILE AWS_SHARED_CREDENTIALS_FILE AWS_ENDPOINT_URL_S3; do unset $v; done
t0=$(date +%s.%N)
if [ "$BACKEND" = radosgw ]; then
  if out=$(CEPH_RGW=1 CEPH_MEMSTORE_BYTES=$(((S3_G * 3 + 2) << 30)) "$HERE/../scripts/ceph-cluster" start "$C" 2>"$W/cluster.err"); then
    export CEPH_CONF=$C/ceph.conf
    AWS_ENDPOINT_URL=$(sed -n 's/^RGW_ENDPOINT=//p' <<<"$out")
    AWS_ACCESS_KEY_ID=$(sed -n 's/^AWS_ACCESS_KEY_ID=//p' <<<"$out")
    AWS_SECRET_ACCESS_KEY=$(sed -n 's/^AWS_SECRET_ACCESS_KEY=//p' <<<"$out")
    echo "radosgw up in $(printf %.0f "$(echo "$(date +%s.%N) - $t0" | bc -l)") s: $(ceph --version | cut -d' ' -f1-3)"
  else
    echo "note: the Ceph cluster did not start (scripts/ceph-cluster: $(tail -n 3 "$W/cluster.err" | tr '\n' ' ')); moto_server instead"
    BACKEND=moto
  fi
fi
if [ "$BACKEND" = moto ]; then
  command -v moto_server >/dev/null || { echo "no moto_server (pip install 'moto[server]')" >&2; exit 1; }
  port=$($PY -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  moto_server -H 127.0.0.1 -p "$port" >"$W/moto.log" 2>&1 & MOTO_PID=$!
  wait_port "$port"; sleep 1
  AWS_ENDPOINT_URL=http://127.0.0.1:$port AWS_ACCESS_KEY_ID=bench AWS_SECRET_ACCESS_KEY=benchsecret
fi
export AWS_ENDPOINT_URL AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY AWS_REGION=us-east-1

# The CPU seconds (user + system) of the S3 servers so far: radosgw, the OSD and the monitor
# (or moto_server).
tick=$(getconf CLK_TCK)
server_cpu() {
  local t=0 p st
  for p in $([ "$BACKEND" = radosgw ] && cat "$C"/run/*.pid 2>/dev/null) $MOTO_PID; do
    read -r -a st <"/proc/$p/stat" 2>/dev/null || continue
    t=$((t + st[13] + st[14]))
  done
  echo "scale=2; $t / $tick" | bc -l
}
# timed KEY CMD...: the wall seconds of one run into T[KEY] (FAIL if it fails), the client's
# user + system CPU (its children included) into CU[KEY], the servers' CPU meanwhile into SV[KEY].
declare -A T CU SV SZ
timed() {
  local k=$1 b out wall u s; shift
  b=$(server_cpu)
  if out=$({ TIMEFORMAT='%R %U %S'; time "$@" >"$W/last.log" 2>&1; } 2>&1); then
    read -r wall u s <<<"$out"
    T[$k]=$wall; CU[$k]=$(echo "$u + $s" | bc -l); SV[$k]=$(echo "$(server_cpu) - $b" | bc -l)
  else
    T[$k]=FAIL; echo "$k FAILED: $(tail -n 3 "$W/last.log" | tr '\n' ' ')"
  fi
}
s3py() { $BOTO_PY - "$@" <<'EOF'
import sys, boto3
s3 = boto3.client("s3")
op = sys.argv[1]
if op == "mb":
    s3.create_bucket(Bucket=sys.argv[2])
elif op == "du":  # the bytes of the objects under a prefix
    n = 0
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=sys.argv[2], Prefix=sys.argv[3] if len(sys.argv) > 3 else ""):
        n += sum(o["Size"] for o in page.get("Contents", []))
    print(n)
EOF
}
stored() { # TOOL: the bytes of its repository's objects
  case $1 in
    ferry) s3py du ferry repo/ ;;
    ferryf) s3py du ferry nobitmap/ ;;
    restic) s3py du restic ;;
  esac 2>/dev/null
}
echo "ferry: $("$FERRY" --version 2>/dev/null | head -1), $(restic version 2>/dev/null | cut -d' ' -f1-2), S3: $BACKEND at $AWS_ENDPOINT_URL"
s3py mb ferry || { echo "cannot make the bucket ferry at $AWS_ENDPOINT_URL" >&2; exit 1; }
echo "bench password $$" >"$W/pass"
export RESTIC_PASSWORD_FILE=$W/pass
RR=(restic --cache-dir "$W/restic-cache" -r "s3:$AWS_ENDPOINT_URL/restic")
"$FERRY" repo init s3://ferry/repo >/dev/null 2>&1 || echo "ferry repo init s3://ferry/repo FAILED"
"$FERRY" repo init s3://ferry/nobitmap >/dev/null 2>&1 || echo "ferry repo init s3://ferry/nobitmap FAILED"
"${RR[@]}" init >/dev/null 2>&1 || echo "restic init FAILED"

# --- The image (day 1) ---------------------------------------------------------------
mkdir -p "$W/src"
$PY "$HERE/repo-image.py" "$W/src/disk.raw" "$SIZE"
qemu-img convert -f raw -O qcow2 "$W/src/disk.raw" "$W/vm.qcow2"
qemu-img bitmap --add "$W/vm.qcow2" b0
echo "image: ${S3_G} GiB, $(( $(du -s --block-size=1 "$W/src/disk.raw" | cut -f1) / 1000000 )) MB allocated; files in $W"

rate() { [ "$1" = FAIL ] && { echo -; return; }; printf "%.0f" "$(echo "$SIZE / 1000000 / $1" | bc -l)"; }
MB() { [ -z "$1" ] && { echo -; return; }; printf "%.0f" "$(echo "$1 / 1000000" | bc -l)"; }
row() { # LABEL KEY [STORED]
  local k=$2
  local cu=- sv=-
  [ -n "${CU[$k]:-}" ] && cu=$(printf %.2f "${CU[$k]}")
  [ -n "${SV[$k]:-}" ] && sv=$(printf %.2f "${SV[$k]}")
  printf "| %s | %s | %s | %s | %s | %s |\n" "$1" "${T[$k]}" "$(rate "${T[$k]}")" "$cu" "$sv" "${3:--}"
}

# --- 1. Day 1 ------------------------------------------------------------------------
L1=$(stamp)
timed d1:ferry "$FERRY" backup "$W/src/disk.raw" s3://ferry/repo::vm
timed d1:restic "${RR[@]}" backup "$W/src/disk.raw"
"$FERRY" backup "$W/src/disk.raw" s3://ferry/nobitmap::vm >/dev/null 2>&1 || echo "ferry backup into s3://ferry/nobitmap FAILED"
for t in ferry ferryf restic; do SZ[$t:1]=$(stored $t); done
echo
echo "== 1. day 1: full backup of a ${S3_G} GiB image (a local sparse raw file) into a repository on $BACKEND ($L1, one run)"
echo
echo "| backup | s | MB/s of the image | client CPU s | $BACKEND CPU s | stored MB |"
echo "|---|---|---|---|---|---|"
row '`ferry backup disk.raw s3://ferry/repo::vm`' d1:ferry "$(MB "${SZ[ferry:1]}")"
row '`restic -r s3:URL/restic backup disk.raw` (encrypted, zstd auto)' d1:restic "$(MB "${SZ[restic:1]}")"

# --- 2. Day 2 ------------------------------------------------------------------------
NDIRTY=$(( (S3_G << 14) * DIRTY_PCT / 100 ))
qemu-nbd -t -f qcow2 --cache=unsafe -k "$W/dirty.sock" "$W/vm.qcow2" & p=$!
wait_sock "$W/dirty.sock"
$PY "$HERE/repo-dirty.py" "nbd+unix:///?socket=$W/dirty.sock" "$NDIRTY" 20 "$W/src/disk.raw"
kill -TERM $p; wait $p
qemu-nbd -t -r -B b0 -f qcow2 -k "$W/src.sock" "$W/vm.qcow2" 2>"$W/src.log" & pids+=($!)
wait_sock "$W/src.sock"
SRC="nbd+unix:///?socket=$W/src.sock"
L2=$(stamp)
# The snapshot b0 continues (day 1's), looked up before the backup is timed.
SINCE=$("$FERRY" repo list --json s3://ferry/repo | $PY -c 'import json,sys; print(json.load(sys.stdin)[-1]["id"])')
timed d2:ferry "$FERRY" backup --dirty-bitmap b0 --since "$SINCE" "$SRC" s3://ferry/repo::vm
timed d2:ferryf "$FERRY" backup "$SRC" s3://ferry/nobitmap::vm
timed d2:restic "${RR[@]}" backup "$W/src/disk.raw"
for t in ferry ferryf restic; do SZ[$t:2]=$(stored $t); done
grow() { [ -n "${SZ[$1:1]}" ] && [ -n "${SZ[$1:2]}" ] && MB $((SZ[$1:2] - SZ[$1:1])) || echo -; }
echo
echo "== 2. day 2: ${DIRTY_PCT}% of the 64 KiB granules changed ($NDIRTY, scattered) ($L2, one run)"
echo
echo "| backup | s | MB/s of the image | client CPU s | $BACKEND CPU s | stored MB added |"
echo "|---|---|---|---|---|---|"
row '`ferry backup --dirty-bitmap b0 --since ID URI s3://ferry/repo::vm` (qemu-nbd -r -B b0)' d2:ferry "$(grow ferry)"
row '`ferry backup URI s3://ferry/nobitmap::vm` without the bitmap (reads all, stores what is new)' d2:ferryf "$(grow ferryf)"
row '`restic backup disk.raw` (rereads the file)' d2:restic "$(grow restic)"

# --- 3. Restore ----------------------------------------------------------------------
declare -A SAME
L3=$(stamp)
rm -rf "$W/out"; mkdir -p "$W/out"
timed r:ferry "$FERRY" copy s3://ferry/repo::vm "$W/out/disk.raw"
cmp -s "$W/out/disk.raw" "$W/src/disk.raw" && SAME[ferry]=yes || SAME[ferry]=NO
rm -rf "$W/out"; mkdir -p "$W/out"
timed r:ferry0 "$FERRY" copy s3://ferry/repo::vm null:
timed r:restic "${RR[@]}" restore latest --target "$W/out"
cmp -s "$W/out$W/src/disk.raw" "$W/src/disk.raw" && SAME[restic]=yes || SAME[restic]=NO
rm -rf "$W/out"
echo
echo "== 3. restore day 2 from $BACKEND into a file in ${BENCH_DIR:-/var/tmp} ($L3, one run)"
echo
echo "| restore | s | MB/s of the image | client CPU s | $BACKEND CPU s | equals day 2 |"
echo "|---|---|---|---|---|---|"
row '`ferry copy s3://ferry/repo::vm out.raw`' r:ferry "${SAME[ferry]}"
row '`ferry copy s3://ferry/repo::vm null:` (reading only)' r:ferry0 -
row '`restic restore latest --target DIR`' r:restic "${SAME[restic]}"
echo
echo "borg: no S3 backend (a borg repository lives on a file system or behind SSH): no cells."
