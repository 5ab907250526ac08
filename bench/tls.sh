#!/usr/bin/env bash
# TLS against plaintext, and ferry against nbdkit, in one run (issue 5's targets and
# seed 001's table). Run from the project root after `cargo build --release`; prints
# markdown tables. Compare ratios within this run, not figures across runs.
#
#   bench/tls.sh            # 4 GiB reads
#   SIZE_G=1 bench/tls.sh   # quicker
#
# Needs: nbdkit, libnbd-bin (nbdcopy), gnutls-bin (psktool), python3.
set -u
FERRY=${FERRY:-$PWD/target/release/ferry}
SIZE_G=${SIZE_G:-4}
W=$(mktemp -d /dev/shm/ferry-tls.XXXX) || exit 1
trap 'kill $(jobs -p) 2>/dev/null; wait 2>/dev/null; rm -rf "$W"' EXIT
[ -x "$FERRY" ] || { echo "build ferry first: cargo build --release"; exit 1; }

. "$(dirname "$0")/lib.sh"
json() { python3 -c "import json,sys; d=json.load(sys.stdin); print(round($1))"; }

psktool -u bench -p "$W/keys.psk" >/dev/null 2>&1
openssl enc -aes-128-ctr -pass pass:ferry -nosalt -pbkdf2 </dev/zero 2>/dev/null | head -c $((SIZE_G<<30)) > "$W/img"
Q="tls-psk-file=$W/keys.psk"
S=$W/s.sock

# start NAME TRANSPORT: a server on $S (unix) or port 10821 (tcp); sets $U.
start() {
  rm -f "$S"
  local tls=() k=() tcp=(-p 10821) unix=(-U "$S")
  case $1 in
    ferry-tls) tls=(--tls=require --tls-psk "$W/keys.psk") ;;
    nbdkit-tls) k=(--tls=require "--tls-psk=$W/keys.psk") ;;
  esac
  case $1 in
    ferry*) if [ "$2" = unix ]; then "$FERRY" serve -q "${tls[@]}" "${unix[@]}" "file:$W/img" & else "$FERRY" serve -q "${tls[@]}" "${tcp[@]}" "file:$W/img" & fi ;;
    nbdkit*) if [ "$2" = unix ]; then nbdkit -f "${k[@]}" -U "$S" file "$W/img" & else nbdkit -f "${k[@]}" -i 127.0.0.1 -p 10821 file "$W/img" & fi ;;
  esac
  local s=""; case $1 in *tls) s=s ;; esac
  if [ "$2" = unix ]; then wait_sock "$S"; U="nbd$s+unix://bench@/?socket=$S"; else wait_port 10821; U="nbd$s://bench@127.0.0.1:10821/"; fi
  [ -n "$s" ] && U="$U$( [ "$2" = unix ] && echo "&" || echo "?")$Q"
  [ -z "$s" ] && U=${U/bench@/}
}
stop() { kill $(jobs -p) 2>/dev/null; wait 2>/dev/null; }

echo "## Reads of a $SIZE_G GiB file export in /dev/shm to null: (GiB/s, median of 3)"
echo
echo "| server | client | transport | GiB/s |"
echo "|---|---|---|---|"
for tr in tcp unix; do
  for srv in ferry ferry-tls nbdkit-tls; do
    start $srv $tr
    [ $srv != nbdkit-tls ] && echo "| $srv | ferry copy | $tr | $(gibs "$FERRY" copy "$U" null:) |"
    echo "| $srv | nbdcopy | $tr | $(gibs nbdcopy "$U" null:) |"
    [ $srv = nbdkit-tls ] && echo "| $srv | ferry copy | $tr | $(gibs "$FERRY" copy "$U" null:) |"
    stop
  done
done
echo
echo "## 4 KiB random reads, ferry bench nbd, 1 connection x 64 in flight, 5 s (seed 001's table)"
echo
echo "| server | transport | IOPS | p99 us |"
echo "|---|---|---|---|"
for tr in tcp unix; do
  for srv in ferry ferry-tls nbdkit nbdkit-tls; do
    start $srv $tr
    r=$("$FERRY" bench nbd -C 1 -R 64 --duration 5 --span 1G --json "$U")
    echo "| $srv | $tr | $(echo "$r" | json 'd["iops"]') | $(echo "$r" | json 'd["latency_us"]["p99"]') |"
    stop
  done
done
