#!/usr/bin/env bash
# Writes, file in /dev/shm -> each server's file export over a Unix socket: nbdcopy,
# qemu-img convert and ferry copy, medians of 3 (GiB/s). Run from the project root.
set -u
FERRY=${FERRY:-$PWD/target/release/ferry}
SIZE_G=${SIZE_G:-4}
W=$(mktemp -d /dev/shm/cw.XXXX)
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$W"' EXIT
openssl enc -aes-128-ctr -pass pass:peers -nosalt -pbkdf2 </dev/zero 2>/dev/null | head -c $((SIZE_G<<30)) > "$W/img"
cp "$W/img" "$W/dst"
S=$W/s.sock; URI="nbd+unix:///?socket=$S"
t() { local s e; s=$(date +%s.%N); "$@" >/dev/null 2>&1 || { echo FAIL; return; }; e=$(date +%s.%N); echo "$SIZE_G / ($e - $s)" | bc -l; }
med() { grep -v FAIL | sort -g | awk '{a[NR]=$1} END{printf "%.2f", a[int((NR+1)/2)]}'; }
echo "| server | write: nbdcopy GiB/s | write: qemu-img GiB/s | write: ferry copy GiB/s |"
echo "|---|---|---|---|"
for s in nbdkit qemu-nbd ferry; do
  rm -f "$S"
  case $s in
    nbdkit) nbdkit -U "$S" -f --exit-with-parent file "$W/dst" & ;;
    qemu-nbd) qemu-nbd -t -e 0 -f raw -k "$S" "$W/dst" & ;;
    ferry) "$FERRY" serve --unix "$S" "file:$W/dst" 2>/dev/null & ;;
  esac
  for i in $(seq 50); do [ -S "$S" ] && break; sleep 0.1; done
  declare -A r=()
  for i in 1 2 3; do
    r[n]+="$(t nbdcopy "$W/img" "$URI")"$'\n'
    r[q]+="$(t qemu-img convert -f raw -O raw -W -n -m 8 "$W/img" "$URI")"$'\n'
    r[f]+="$(t "$FERRY" copy "$W/img" "$URI")"$'\n'
  done
  kill $(jobs -p) 2>/dev/null; wait 2>/dev/null
  echo "| $s | $(echo "${r[n]}" | med) | $(echo "${r[q]}" | med) | $(echo "${r[f]}" | med) |"
done
