#!/usr/bin/env bash
# 4 KiB random reads on one connection, 64 in flight (issue 4's IOPS target), in
# alternating rounds: ferry serve memory:1G against nbdkit's memory plugin, each first
# filled with 1 GiB of AES-CTR data, all measured with the same client (ferry bench nbd).
# FERRY_BASE=/path/to/an/older/ferry adds that build as a third server (A/B of a change).
#
#   bench/iops-rounds.sh [ROUNDS]      (default 5; prints "round server IOPS p99_us")
set -u
FERRY=${FERRY:-$PWD/target/release/ferry}
ROUNDS=${1:-5}
W=$(mktemp -d /dev/shm/ferry-iops.XXXX) || exit 1
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$W"' EXIT
[ -x "$FERRY" ] || { echo "build ferry first: cargo build --release"; exit 1; }
openssl enc -aes-128-ctr -pass pass:iops -nosalt -pbkdf2 </dev/zero 2>/dev/null | head -c 1G > "$W/1g"
servers="ferry nbdkit"; [ -n "${FERRY_BASE:-}" ] && servers="ferry ferry-base nbdkit"
S=$W/s.sock
for r in $(seq "$ROUNDS"); do
  for v in $servers; do
    rm -f "$S"
    case $v in
      ferry) "$FERRY" serve -q -U "$S" memory:1G & ;;
      ferry-base) "$FERRY_BASE" serve -q -U "$S" memory:1G & ;;
      nbdkit) nbdkit -f -U "$S" memory 1G & ;;
    esac
    P=$!
    for i in $(seq 100); do [ -S "$S" ] && break; sleep 0.05; done
    U="nbd+unix:///?socket=$S"
    "$FERRY" copy "$W/1g" "$U" >/dev/null
    "$FERRY" bench nbd -C 1 -R 64 --duration 5 --json "$U" |
      python3 -c "import json,sys; d=json.load(sys.stdin); print($r, '$v', round(d['iops']), round(d['latency_us']['p99']))"
    kill $P; wait $P 2>/dev/null
  done
done
