#!/usr/bin/env bash
# The copy engine before and after a change, side by side: OLD and NEW ferry binaries
# (OLD built from another tree, e.g. `git archive main | tar -x -C /tmp/old` and
# `cargo build --release -p ferry` there) run the same copies in ROUNDS alternating
# rounds against one ferry serve (NEW's), over a Unix socket, data in /dev/shm:
#   read:  ferry serve file:img -> ferry copy URI null:
#   write: img -> ferry serve file:dst (sendfile payloads)
#   nbd -> file: ferry serve file:img -> a new file
# and a half-hole source (1 MiB data, 1 MiB hole, ...) to ferry serve. Before each write
# the destination is fallocated whole (writing new tmpfs pages is slow on this VM, and
# the half-hole copy punches holes). Medians of GiB/s and of the client's CPU seconds
# (user + system), NEW/OLD ratios. Run from the project root.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/lib.sh"
NEW=${NEW:-$PWD/target/release/ferry}
OLD=${OLD:?set OLD to the ferry binary to compare against}
SIZE_G=${SIZE_G:-2}
ROUNDS=${ROUNDS:-7}
CASES=${CASES:-0 1 2 3}  # which of the four below
W=$(mktemp -d /dev/shm/ce.XXXX) || exit 1
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$W"' EXIT
openssl enc -aes-128-ctr -pass pass:endpoints -nosalt -pbkdf2 </dev/zero 2>/dev/null | head -c $((SIZE_G<<30)) > "$W/img"
cp "$W/img" "$W/dst"
# Half holes: every other MiB is data.
truncate -s $((SIZE_G<<30)) "$W/holes"
for i in $(seq 0 2 $(( (SIZE_G<<10) - 1 ))); do
  dd if="$W/img" of="$W/holes" bs=1M skip="$i" seek="$i" count=1 conv=notrunc status=none
done
SR=$W/r.sock; SW=$W/w.sock
"$NEW" serve --unix "$SR" --read-only "file:$W/img" 2>/dev/null &
"$NEW" serve --unix "$SW" "file:$W/dst" 2>/dev/null &
wait_sock "$SR"; wait_sock "$SW"
RU="nbd+unix:///?socket=$SR"; WU="nbd+unix:///?socket=$SW"
cases=("read: nbd -> null:" "write: file -> nbd" "nbd -> new file" "half holes: file -> nbd")
# One run: "GiB/s client-CPU-seconds" (user + system of ferry copy, from GNU time).
meas() {
  local s e u k
  s=$(date +%s.%N)
  /usr/bin/time -o "$W/t" -f "%U %S" "$@" >/dev/null 2>&1 || { echo "0 0"; return; }
  e=$(date +%s.%N)
  read -r u k < "$W/t"; echo "$(echo "$SIZE_G / ($e - $s)" | bc -l) $(echo "$u + $k" | bc -l)"
}
run_case() { # binary case
  case $2 in
    0) meas "$1" copy "$RU" null: ;;
    1) fallocate -l $((SIZE_G<<30)) "$W/dst"; meas "$1" copy "$W/img" "$WU" ;;
    2) rm -f "$W/out"; meas "$1" copy "$RU" "$W/out" ;;
    3) fallocate -l $((SIZE_G<<30)) "$W/dst"; meas "$1" copy "$W/holes" "$WU" ;;
  esac
}
declare -A r=() cpus=()
for i in $(seq "$ROUNDS"); do
  for c in $CASES; do
    # Who goes first alternates too.
    order="old new"; [ $((i % 2)) = 0 ] && order="new old"
    for b in $order; do
      bin=$OLD; [ $b = new ] && bin=$NEW
      read -r g cpu <<< "$(run_case "$bin" $c)"
      r[$b$c]+="$g"$'\n'
      cpus[$b$c]+="$cpu"$'\n'
    done
  done
done
[ -e "$W/out" ] && { cmp -s "$W/img" "$W/out" && echo "nbd -> file: output equals source" || echo "nbd -> file: OUTPUT DIFFERS"; }
case " $CASES " in *" 3 "*) cmp -s "$W/holes" "$W/dst" && echo "half holes: destination equals source" || echo "half holes: DESTINATION DIFFERS" ;; esac
echo
echo "| $SIZE_G GiB, $ROUNDS alternating rounds | old GiB/s | new GiB/s | new/old | old client CPU s | new client CPU s | old rounds GiB/s | new rounds GiB/s |"
echo "|---|---|---|---|---|---|---|---|"
for c in $CASES; do
  o=$(echo "${r[old$c]}" | grep . | med); n=$(echo "${r[new$c]}" | grep . | med)
  oc=$(echo "${cpus[old$c]}" | grep . | med); nc=$(echo "${cpus[new$c]}" | grep . | med)
  echo "| ${cases[$c]} | $(printf %.2f "$o") | $(printf %.2f "$n") | $(printf %.3f "$(echo "$n / $o" | bc -l)") | $(printf %.2f "$oc") | $(printf %.2f "$nc") | $(echo "${r[old$c]}" | grep . | xargs printf '%.2f ') | $(echo "${r[new$c]}" | grep . | xargs printf '%.2f ') |"
done
