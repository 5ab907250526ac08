#!/usr/bin/env bash
# Writes, file in /dev/shm -> each server's file export over a Unix socket: nbdcopy,
# qemu-img convert and ferry copy, medians of 3 (GiB/s), with the raw Unix-socket
# ceiling (../shared/bench/rawsock.c, 4 MiB buffers, median of 3) before and after.
# Then ferry copy into ferry serve with and without sendfile on the client, in ROUNDS
# alternating rounds. Run from the project root.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/lib.sh"
FERRY=${FERRY:-$PWD/target/release/ferry}
SIZE_G=${SIZE_G:-4}
ROUNDS=${ROUNDS:-5}
W=$(mktemp -d /dev/shm/cw.XXXX) || exit 1
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$W"' EXIT
cc -O2 -o "$W/rawsock" "$HERE/../../shared/bench/rawsock.c"
raw() { for i in 1 2 3; do "$W/rawsock" 0 4194304 4194304 4096 4194304 | sed 's/.*: \([0-9.]*\) GiB.*/\1/'; done | med; }
openssl enc -aes-128-ctr -pass pass:peers -nosalt -pbkdf2 </dev/zero 2>/dev/null | head -c $((SIZE_G<<30)) > "$W/img"
cp "$W/img" "$W/dst"
S=$W/s.sock; URI="nbd+unix:///?socket=$S"
echo "raw Unix socket ceiling before: $(raw) GiB/s"
echo
echo "| server | write: nbdcopy GiB/s | write: qemu-img GiB/s | write: ferry copy GiB/s |"
echo "|---|---|---|---|"
for s in nbdkit qemu-nbd ferry; do
  rm -f "$S"
  case $s in
    nbdkit) nbdkit -U "$S" -f --exit-with-parent file "$W/dst" & ;;
    qemu-nbd) qemu-nbd -t -e 0 -f raw -k "$S" "$W/dst" & ;;
    ferry) "$FERRY" serve --unix "$S" "file:$W/dst" 2>/dev/null & ;;
  esac
  wait_sock "$S"
  echo "| $s | $(gibs nbdcopy "$W/img" "$URI") | $(gibs qemu-img convert -f raw -O raw -W -n -m 8 "$W/img" "$URI") | $(gibs "$FERRY" copy "$W/img" "$URI") |"
  kill $(jobs -p) 2>/dev/null; wait 2>/dev/null
done
echo
echo "raw Unix socket ceiling after: $(raw) GiB/s"
echo
# sendfile on and off, alternating rounds (one round: raw, then each once).
rm -f "$S"
"$FERRY" serve --unix "$S" "file:$W/dst" 2>/dev/null &
wait_sock "$S"
declare -A r=()
names=("raw socket" "ferry copy (sendfile, default)" "ferry copy --no-sendfile")
for i in $(seq "$ROUNDS"); do
  r[0]+="$("$W/rawsock" 0 4194304 4194304 4096 4194304 | sed 's/.*: \([0-9.]*\) GiB.*/\1/')"$'\n'
  r[1]+="$(echo "$SIZE_G / $(secs "$FERRY" copy "$W/img" "$URI")" | bc -l)"$'\n'
  r[2]+="$(echo "$SIZE_G / $(secs "$FERRY" copy --no-sendfile "$W/img" "$URI")" | bc -l)"$'\n'
done
rawm=$(echo "${r[0]}" | grep . | med)
echo "| into ferry serve ($ROUNDS rounds) | median GiB/s | of raw | rounds |"
echo "|---|---|---|---|"
for k in 0 1 2; do
  m=$(echo "${r[$k]}" | grep . | med)
  echo "| ${names[$k]} | $(printf %.2f "$m") | $(printf %.0f%% "$(echo "100 * $m / $rawm" | bc -l)") | $(echo "${r[$k]}" | grep . | xargs printf '%.2f ' ) |"
done
cmp -s "$W/img" "$W/dst" && echo "destination equals source" || echo "DESTINATION DIFFERS"
