#!/usr/bin/env bash
# fio's 4 KiB random I/O column of compare.sh swings by +-20% from run to run on this
# machine, more than the gap between servers. This runs it in alternating rounds, so
# each server gets the same conditions: ferry, ferry --send-batch 0, nbdkit, qemu-nbd.
#   bench/fio-rounds.sh [randwrite|randread] [ROUNDS]
set -u
RW=${1:-randwrite}; ROUNDS=${2:-3}
FERRY=${FERRY:-$PWD/target/release/ferry}
W=$(mktemp -d /dev/shm/fio-rounds.XXXX) || exit 1; S=$W/s.sock
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$W"' EXIT
openssl enc -aes-128-ctr -pass pass:ferry -nosalt -pbkdf2 </dev/zero 2>/dev/null | head -c $((2<<30)) > "$W/img"
iops() { fio --name=j --ioengine=nbd --uri="nbd+unix:///?socket=$S" --rw="$RW" --bs=4k --iodepth=64 --size=2G \
  --runtime=5 --time_based --output-format=json 2>/dev/null | sed -n '/^{/,$p' |
  python3 -c "import json,sys; j=json.load(sys.stdin)['jobs'][0]; print(round(j['write']['iops']+j['read']['iops']))"; }
echo "| round | ferry | ferry --send-batch 0 | nbdkit | qemu-nbd |"
echo "|---|---|---|---|---|"
for r in $(seq "$ROUNDS"); do
  row="| $r"
  for srv in ferry ferry0 nbdkit qemu-nbd; do
    rm -f "$S"
    case $srv in
      ferry) "$FERRY" serve -q -U "$S" "file:$W/img" & ;;
      ferry0) "$FERRY" serve -q --send-batch 0 -U "$S" "file:$W/img" & ;;
      nbdkit) nbdkit -f -U "$S" file "$W/img" & ;;
      qemu-nbd) qemu-nbd -t -e 8 -f raw -k "$S" "$W/img" & ;;
    esac
    for i in $(seq 100); do [ -S "$S" ] && break; sleep 0.05; done
    row="$row | $(iops)"
    kill $(jobs -p) 2>/dev/null; wait 2>/dev/null
  done
  echo "$row |"
done
