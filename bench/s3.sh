#!/usr/bin/env bash
# ferry and boto3 on S3, side by side in one run: Ceph's radosgw on a throwaway
# single-node cluster (scripts/ceph-cluster with CEPH_RGW=1: one monitor, one memstore
# OSD and radosgw, on the same cores as the clients; plain HTTP on 127.0.0.1).
# Data: SIZE_G GiB (default 4) of AES-CTR bytes in S3_DIR (default /var/tmp: a disk, since
# the memstore OSD holds the objects in memory).
#   upload:   ferry copy FILE s3://bench/up      vs  boto3 upload_file   (a new object each time)
#   download: ferry copy s3://bench/src OUT      vs  boto3 download_file (OUT in S3_DIR,
#             compared with the source by cmp)
# boto3 with its default TransferConfig (8 MiB parts, 10 threads) and client settings (since
# botocore 1.36 a CRC32 of each part is sent); ferry with its defaults (an MD5 of each part).
# FERRY_EXTRA="-C 8" adds a column: ferry copy with those options too.
# FERRY_BASE=/path/to/other/ferry adds a column: that binary (e.g. main's, to compare a
# change with what it changes, in the same run).
# Medians of 3 rounds; the order of the tools rotates each round. MB/s: 10^6 bytes/s.
# A second table gives the CPU seconds of each run: the client's (user+sys) and the
# cluster's (radosgw, the OSD and the monitor) over the same time, from /proc.
# Needs radosgw and boto3: apt-get install radosgw python3-boto3 (or pip install boto3).
# Run from the project root after `cargo build --release -p ferry`.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/lib.sh"
FERRY=${FERRY:-$PWD/target/release/ferry}
SIZE_G=${SIZE_G:-4}
PY=${PYTHON:-python3}
read -r -a EXTRA <<<"${FERRY_EXTRA:-}"
BASE=${FERRY_BASE:-}
[ -z "$BASE" ] || [ -x "$BASE" ] || { echo "FERRY_BASE=$BASE is not an executable" >&2; exit 1; }
[ -x "$FERRY" ] || { echo "no ferry binary at $FERRY: cargo build --release -p ferry, or set FERRY" >&2; exit 1; }
command -v radosgw >/dev/null || { echo "radosgw is not installed: apt-get install radosgw" >&2; exit 1; }
"$PY" -c 'import boto3' 2>/dev/null || { echo "$PY has no boto3: apt-get install python3-boto3 (or pip install boto3)" >&2; exit 1; }

W=$(mktemp -d "${S3_DIR:-/var/tmp}/s3b.XXXX") || exit 1
C=$(mktemp -d "/tmp/s3b-cluster.XXXX") || { rm -rf "$W"; exit 1; }
rmdir "$C"
cleanup() {
  "$HERE/../scripts/ceph-cluster" stop "$C"
  rm -rf "$W"
}
trap cleanup EXIT
# Room for the source object and one upload (memstore keeps every byte in memory).
out=$(CEPH_RGW=1 CEPH_MEMSTORE_BYTES=$(((SIZE_G * 2 + 4) << 30)) "$HERE/../scripts/ceph-cluster" start "$C") || exit 1
export CEPH_CONF=$C/ceph.conf
AWS_ENDPOINT_URL=$(sed -n 's/^RGW_ENDPOINT=//p' <<<"$out")
AWS_ACCESS_KEY_ID=$(sed -n 's/^AWS_ACCESS_KEY_ID=//p' <<<"$out")
AWS_SECRET_ACCESS_KEY=$(sed -n 's/^AWS_SECRET_ACCESS_KEY=//p' <<<"$out")
export AWS_ENDPOINT_URL AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY AWS_REGION=us-east-1

openssl enc -aes-128-ctr -pass pass:s3 -nosalt -pbkdf2 </dev/zero 2>/dev/null | head -c $((SIZE_G << 30)) >"$W/img"

# boto3 OP ARGS: one call of boto3, in a process of its own as ferry is.
boto3() {
  "$PY" - "$@" <<'EOF'
import sys, boto3
s3 = boto3.client("s3")
op = sys.argv[1]
if op == "mb":
    s3.create_bucket(Bucket=sys.argv[2])
elif op == "up":
    s3.upload_file(sys.argv[2], sys.argv[3], sys.argv[4])
elif op == "down":
    s3.download_file(sys.argv[2], sys.argv[3], sys.argv[4])
elif op == "rm":
    s3.delete_object(Bucket=sys.argv[2], Key=sys.argv[3])
elif op == "size":
    print(s3.head_object(Bucket=sys.argv[2], Key=sys.argv[3])["ContentLength"])
EOF
}
# Deletes an object and gives its data back to the OSD at once (radosgw's garbage
# collector would wait; the cluster sets rgw gc obj min wait = 0).
rm_object() {
  boto3 rm bench "$1" >/dev/null 2>&1
  radosgw-admin gc process --include-all >/dev/null 2>&1
}

boto3 mb bench || { echo "cannot create bucket bench at $AWS_ENDPOINT_URL" >&2; exit 1; }
boto3 up "$W/img" bench src || { echo "cannot upload the source object" >&2; exit 1; }

echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), SIZE_G=$SIZE_G, load: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "$(ceph --version | cut -d' ' -f1-3), boto3 $("$PY" -c 'import boto3, botocore; print(boto3.__version__ + ", botocore " + botocore.__version__)'), $("$FERRY" --version 2>/dev/null | head -1)"

# The CPU seconds (user + system) radosgw, the OSD and the monitor have used so far.
tick=$(getconf CLK_TCK)
server_cpu() {
  local t=0 f p st
  for f in "$C"/run/*.pid; do
    p=$(cat "$f")
    read -r -a st <"/proc/$p/stat" 2>/dev/null || continue
    t=$((t + st[13] + st[14]))
  done
  echo "scale=2; $t / $tick" | bc -l
}
# timed CMD...: "WALL CLIENT SERVER" seconds of one run (FAIL if it fails): the wall time,
# the client's user+system CPU (its children included), and the cluster's CPU meanwhile.
timed() {
  local b out rc
  b=$(server_cpu)
  out=$({ TIMEFORMAT='%R %U %S'; time "$@" >/dev/null 2>&1; } 2>&1) && rc=0 || rc=1
  [ $rc = 0 ] || { echo FAIL; return; }
  read -r wall u s <<<"$out"
  echo "$wall $(echo "$u + $s" | bc -l) $(echo "$(server_cpu) - $b" | bc -l)"
}

declare -A T CU SV
order=(ferry boto3)
tools=(ferry boto3)
((${#EXTRA[@]})) && order=(ferry ferryx boto3) tools=(ferry ferryx boto3)
[ -n "$BASE" ] && order=("${order[@]}" ferryb) tools=(ferry ferryb "${tools[@]:1}")
for round in 1 2 3; do
  for t in "${order[@]}"; do
    case $t in
    ferry) up=("$FERRY" copy "$W/img" s3://bench/up) down=("$FERRY" copy s3://bench/src "$W/out") ;;
    ferryx) up=("$FERRY" copy "${EXTRA[@]}" "$W/img" s3://bench/up) down=("$FERRY" copy "${EXTRA[@]}" s3://bench/src "$W/out") ;;
    ferryb) up=("$BASE" copy "$W/img" s3://bench/up) down=("$BASE" copy s3://bench/src "$W/out") ;;
    boto3) up=(boto3 up "$W/img" bench up) down=(boto3 down bench src "$W/out") ;;
    esac
    rm_object up
    read -r u cu sv <<<"$(timed "${up[@]}")"
    T[$t,up]+="$u "
    [ "$u" = FAIL ] || { CU[$t,up]+="$cu "; SV[$t,up]+="$sv "; }
    if [ "$u" = FAIL ]; then
      echo "$t: upload FAILED (exit status non-zero)"
    elif [ "$(boto3 size bench up)" != $((SIZE_G << 30)) ]; then
      echo "$t: the uploaded object has the wrong size!"
    fi
    rm_object up
    rm -f "$W/out"
    read -r d cu sv <<<"$(timed "${down[@]}")"
    T[$t,down]+="$d "
    [ "$d" = FAIL ] || { CU[$t,down]+="$cu "; SV[$t,down]+="$sv "; }
    if [ "$d" = FAIL ]; then
      echo "$t: download FAILED (exit status non-zero)"
    elif ! cmp -s "$W/out" "$W/img"; then
      echo "$t: the downloaded file differs from the source!"
    fi
    rm -f "$W/out"
  done
  order=("${order[@]:1}" "${order[0]}")
done

# ferry's upload read back by boto3 and compared byte for byte (the downloads above
# compare boto3's upload of src, read by each tool).
rm_object up
if "$FERRY" copy "$W/img" s3://bench/up >/dev/null 2>&1 && boto3 down bench up "$W/out"; then
  cmp -s "$W/out" "$W/img" || echo "ferry's upload, read by boto3, differs from the source!"
else
  echo "ferry's upload read back by boto3: FAILED"
fi
rm -f "$W/out"

t_of() { echo ${T[$1]} | tr ' ' '\n' | grep -v FAIL | med; }
mbs() { printf "%.0f" "$(echo "($SIZE_G * 1073741824 / 1000000) / $1" | bc -l)"; }
label() { case $1 in ferry) echo "ferry copy" ;; ferryx) echo "ferry copy ${EXTRA[*]}" ;; ferryb) echo "ferry copy (FERRY_BASE)" ;; boto3) echo "boto3" ;; esac; }
echo
head="| $SIZE_G GiB to and from radosgw (median of 3) |"
rule="|---|"
for t in "${tools[@]}"; do
  head+=" $(label $t) s | MB/s |"
  rule+="---|---|"
  [ $t = boto3 ] || { head+=" $(label $t) / boto3 (speed) |"; rule+="---|"; }
done
echo "$head"
echo "$rule"
for dir in up down; do
  row="| $([ $dir = up ] && echo "upload: file -> s3://bench/up" || echo "download: s3://bench/src -> file") |"
  b=$(t_of boto3,$dir)
  for t in "${tools[@]}"; do
    v=$(t_of $t,$dir)
    if [ -z "$v" ]; then row+=" fail | |"; else row+=" $(printf %.2f "$v") | $(mbs "$v") |"; fi
    if [ $t != boto3 ]; then
      if [ -n "$v" ] && [ -n "$b" ]; then row+=" $(printf %.2f "$(echo "$b / $v" | bc -l)") |"; else row+=" |"; fi
    fi
  done
  echo "$row"
done
echo
for t in "${tools[@]}"; do echo "all runs (s), $(label $t): up ${T[$t,up]}| down ${T[$t,down]}"; done
echo
# Where the CPU went: the two cores are shared by the client and the cluster.
# Client CPU per GiB moved, and as a share of boto3's in the same direction.
echo "| CPU seconds (user+sys), median of 3 | client | client s/GiB | client / boto3's | radosgw + OSD + monitor | total |"
echo "|---|---|---|---|---|---|"
for dir in up down; do
  cb=$(echo ${CU[boto3,$dir]:-} | tr ' ' '\n' | med)
  for t in "${tools[@]}"; do
    c=$(echo ${CU[$t,$dir]:-} | tr ' ' '\n' | med)
    v=$(echo ${SV[$t,$dir]:-} | tr ' ' '\n' | med)
    [ -n "$c" ] && [ -n "$v" ] || continue
    share=""
    [ -n "$cb" ] && [ "$(echo "$cb > 0" | bc -l)" = 1 ] && share=$(printf %.2f "$(echo "$c / $cb" | bc -l)")
    printf "| %s, %s | %.1f | %.2f | %s | %.1f | %.1f |\n" "$dir" "$(label $t)" "$c" "$(echo "$c / $SIZE_G" | bc -l)" \
      "$share" "$v" "$(echo "$c + $v" | bc -l)"
  done
done
