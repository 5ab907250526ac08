# shellcheck shell=bash
# Shared by ferry's bench scripts (source it; needs $SIZE_G for gibs).
# med: median of numbers on stdin. secs CMD...: wall seconds of one run (FAIL if it
# fails). med3: median of 3 runs. gibs: SIZE_G GiB over the median time, in GiB/s.
med() { sort -g | awk '{a[NR]=$1} END{print a[int((NR+1)/2)]}'; }
secs() { local s e; s=$(date +%s.%N); "$@" >/dev/null 2>&1 || { echo FAIL; return; }; e=$(date +%s.%N); echo "$e - $s" | bc -l; }
med3() { for i in 1 2 3; do secs "$@"; done | grep -v FAIL | med; }
gibs() { local t; t=$(med3 "$@"); [ -z "$t" ] && { echo fail; return; }; printf "%.2f" "$(echo "$SIZE_G / $t" | bc -l)"; }
wait_sock() { for i in $(seq 100); do [ -S "$1" ] && return; sleep 0.05; done; }
wait_port() { for i in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/$1) 2>/dev/null && return; sleep 0.05; done; }
# qcow2_images DIR GIB: DIR/data.raw (GIB GiB of AES-CTR bytes), DIR/data.qcow2 (the same,
# all allocated) and DIR/half.qcow2 (every other MiB of it, the rest unallocated); 64 KiB
# clusters, made by qemu-img.
qcow2_images() {
  openssl enc -aes-128-ctr -pass pass:qcow2 -nosalt -pbkdf2 </dev/zero 2>/dev/null | head -c $(($2<<30)) > "$1/data.raw"
  qemu-img convert -f raw -O qcow2 "$1/data.raw" "$1/data.qcow2"
  truncate -s $(($2<<30)) "$1/half.raw"
  for i in $(seq 0 2 $(( ($2<<10) - 1 ))); do
    dd if="$1/data.raw" of="$1/half.raw" bs=1M skip="$i" seek="$i" count=1 conv=notrunc status=none
  done
  qemu-img convert -f raw -O qcow2 "$1/half.raw" "$1/half.qcow2"; rm -f "$1/half.raw"
}
# rbd_setup NAME MEMSTORE_GIB: a throwaway Ceph cluster (scripts/ceph-cluster, CEPH_CONF
# exported) and $W/img, SIZE_G GiB of AES-CTR bytes in $RBD_DIR (default /dev/shm: for
# 4 GiB, a disk directory such as /var/tmp, since the memstore OSD holds the images in
# memory too); sets W and C, and stops
# the cluster, the script's jobs and $W on exit. Needs HERE (the bench directory).
rbd_setup() {
  W=$(mktemp -d "${RBD_DIR:-/dev/shm}/$1.XXXX") || exit 1
  C=$(mktemp -d "/tmp/$1-cluster.XXXX") || { rm -rf "$W"; exit 1; }
  rmdir "$C"
  trap rbd_cleanup EXIT
  CEPH_MEMSTORE_BYTES=$(($2 << 30)) "$HERE/../scripts/ceph-cluster" start "$C" >/dev/null || exit 1
  export CEPH_CONF=$C/ceph.conf
  openssl enc -aes-128-ctr -pass pass:rbd -nosalt -pbkdf2 </dev/zero 2>/dev/null | head -c $((SIZE_G << 30)) >"$W/img"
}
rbd_cleanup() {
  kill $(jobs -p) 2>/dev/null
  wait 2>/dev/null
  "$HERE/../scripts/ceph-cluster" stop "$C"
  rm -rf "$W"
}
# install_pkg COMMAND PACKAGE: PACKAGE from the system's package sources (apt-get; needs root
# or sudo) when COMMAND is missing; a note when it cannot be installed.
install_pkg() { # COMMAND PACKAGE
  command -v "$1" >/dev/null && return
  local sudo=
  [ "$(id -u)" = 0 ] || sudo="sudo -n"
  echo "installing $2 with apt-get"
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q "$2" >/dev/null 2>&1 ||
    { $sudo apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q "$2" >/dev/null 2>&1; } ||
    echo "note: could not install $2: its cells will say FAIL"
}
