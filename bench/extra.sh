#!/usr/bin/env bash
# ferry's own side-by-side measurements, beyond ../shared/bench/compare.sh. Run from the
# project root after `cargo build --release`; prints markdown tables. Every figure in a
# table comes from this one run, so compare ratios within a table.
#
#   bench/extra.sh            # 4 GiB transfers
#   SIZE_G=1 bench/extra.sh   # quicker
#
# Needs: nbdkit, libnbd-bin (nbdcopy), qemu-utils, coreutils (sha256sum), cc.
set -u
FERRY=${FERRY:-$PWD/target/release/ferry}
SHARED=${SHARED:-$PWD/../shared/bench}
SIZE_G=${SIZE_G:-4}
W=$(mktemp -d /dev/shm/ferry-bench.XXXX) || exit 1
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$W"' EXIT
[ -x "$FERRY" ] || { echo "build ferry first: cargo build --release"; exit 1; }

. "$(dirname "$0")/lib.sh"

openssl enc -aes-128-ctr -pass pass:ferry -nosalt -pbkdf2 </dev/zero 2>/dev/null | head -c $((SIZE_G<<30)) > "$W/img"
cc -O2 -o "$W/rawsock" "$SHARED/rawsock.c"
raw() { for i in 1 2 3; do "$W/rawsock" "$@" | sed 's/.*: \([0-9.]*\) GiB.*/\1/'; done | med; }

echo "## Reads from a file export in /dev/shm to null: ($SIZE_G GiB, GiB/s, median of 3)"
echo
echo "raw ceiling: unix, 4 MiB SO_SNDBUF $(raw 0 1048576 1048576 8192 4194304); tcp loopback $(raw 1 1048576 262144 8192)"
echo
echo "| server | client | transport | GiB/s |"
echo "|---|---|---|---|"
S=$W/s.sock
for srv in ferry ferry-no-sendfile nbdkit qemu-nbd; do
  for tr in unix tcp; do
    rm -f "$S"
    case $srv-$tr in
      ferry-unix) "$FERRY" serve -q -U "$S" "file:$W/img" & ;;
      ferry-tcp) "$FERRY" serve -q -p 10811 "file:$W/img" & ;;
      ferry-no-sendfile-unix) "$FERRY" serve -q --no-sendfile -U "$S" "file:$W/img" & ;;
      ferry-no-sendfile-tcp) "$FERRY" serve -q --no-sendfile -p 10811 "file:$W/img" & ;;
      nbdkit-unix) nbdkit -f -U "$S" file "$W/img" & ;;
      nbdkit-tcp) nbdkit -f -p 10811 -i 127.0.0.1 file "$W/img" & ;;
      qemu-nbd-unix) qemu-nbd -t -e 8 -f raw -k "$S" "$W/img" & ;;
      qemu-nbd-tcp) qemu-nbd -t -e 8 -f raw -b 127.0.0.1 -p 10811 "$W/img" & ;;
    esac
    if [ $tr = unix ]; then wait_sock "$S"; U="nbd+unix:///?socket=$S"; else sleep 0.5; U="nbd://127.0.0.1:10811"; fi
    echo "| $srv | ferry copy | $tr | $(gibs "$FERRY" copy "$U" null:) |"
    echo "| $srv | nbdcopy | $tr | $(gibs nbdcopy "$U" null:) |"
    kill $(jobs -p) 2>/dev/null; wait 2>/dev/null
  done
done
echo
echo "## Writes from a file in /dev/shm to a file export ($SIZE_G GiB, GiB/s, median of 3)"
echo
echo "| server | client | GiB/s |"
echo "|---|---|---|"
cp "$W/img" "$W/dst"
for srv in ferry nbdkit qemu-nbd; do
  rm -f "$S"
  case $srv in
    ferry) "$FERRY" serve -q -U "$S" "file:$W/dst" & ;;
    nbdkit) nbdkit -f -U "$S" file "$W/dst" & ;;
    qemu-nbd) qemu-nbd -t -e 8 -f raw -k "$S" "$W/dst" & ;;
  esac
  wait_sock "$S"; U="nbd+unix:///?socket=$S"
  echo "| $srv | ferry copy | $(gibs "$FERRY" copy "$W/img" "$U") |"
  echo "| $srv | nbdcopy | $(gibs nbdcopy "$W/img" "$U") |"
  kill $(jobs -p) 2>/dev/null; wait 2>/dev/null
done
rm -f "$W/dst"
echo
echo "## 4 KiB random I/O, one client (ferry bench nbd), 5 s each"
echo
echo "| server | connections x in flight | read IOPS | write IOPS | read p99 us |"
echo "|---|---|---|---|---|"
head -c 1G "$W/img" > "$W/1g"
for srv in ferry-memory nbdkit-memory ferry-file nbdkit-file qemu-nbd-file; do
  rm -f "$S"
  case $srv in
    ferry-memory) "$FERRY" serve -q -U "$S" memory:1G & ;;
    nbdkit-memory) nbdkit -f -U "$S" memory 1G & ;;
    ferry-file) "$FERRY" serve -q -U "$S" "file:$W/1g" & ;;
    nbdkit-file) nbdkit -f -U "$S" file "$W/1g" & ;;
    qemu-nbd-file) qemu-nbd -t -e 8 -f raw -k "$S" "$W/1g" & ;;
  esac
  wait_sock "$S"; U="nbd+unix:///?socket=$S"
  case $srv in *memory) "$FERRY" copy "$W/1g" "$U" >/dev/null 2>&1 ;; esac
  for c in 1 2; do
    r=$("$FERRY" bench nbd -C $c -R 64 --duration 5 --json "$U")
    w=$("$FERRY" bench nbd -C $c -R 64 --duration 5 --read-percent 0 --json "$U")
    ri=$(echo "$r" | python3 -c 'import json,sys; print(round(json.load(sys.stdin)["iops"]))')
    rp=$(echo "$r" | python3 -c 'import json,sys; print(round(json.load(sys.stdin)["latency_us"]["p99"]))')
    wi=$(echo "$w" | python3 -c 'import json,sys; print(round(json.load(sys.stdin)["iops"]))')
    echo "| $srv | $c x 64 | $ri | $wi | $rp |"
  done
  kill $(jobs -p) 2>/dev/null; wait 2>/dev/null
done
echo
echo "## blkhash (sha256, 64 KiB blocks) of a random image in /dev/shm (s, median of 3)"
echo
head -c 2G "$W/img" > "$W/2g"; rm -f "$W/img"
truncate -s 100G "$W/sparse"; dd if="$W/1g" of="$W/sparse" bs=1M seek=51200 conv=notrunc status=none
echo "| input | ferry hash | sha256sum |"
echo "|---|---|---|"
echo "| 2 GiB random | $(printf %.2f "$(med3 "$FERRY" hash "$W/2g")") | $(printf %.2f "$(med3 sha256sum "$W/2g")") |"
echo "| 1 GiB random | $(printf %.2f "$(med3 "$FERRY" hash "$W/1g")") | |"
echo "| 100 GiB sparse, 1 GiB data | $(printf %.2f "$(med3 "$FERRY" hash "$W/sparse")") | |"
echo
echo "## Grouped replies (documents 001 and 004): 4 KiB random reads from memory:, 1 connection x 64, 5 s"
echo
echo "| transport | --send-batch | IOPS | read p99 us | server writev per request | iovecs per writev |"
echo "|---|---|---|---|---|---|"
for tr in unix tcp; do
  for batch in 0 64K; do
    rm -f "$S"
    if [ $tr = unix ]; then
      "$FERRY" serve --stats --send-batch $batch -U "$S" memory:1G 2>"$W/stats.log" & wait_sock "$S"; U="nbd+unix:///?socket=$S"
    else
      "$FERRY" serve --stats --send-batch $batch -p 10811 memory:1G 2>"$W/stats.log" & sleep 0.5; U="nbd://127.0.0.1:10811"
    fi
    "$FERRY" copy "$W/1g" "$U" >/dev/null 2>&1
    r=$("$FERRY" bench nbd -C 1 -R 64 --duration 5 --json "$U")
    kill $(jobs -p) 2>/dev/null; wait 2>/dev/null
    line=$(grep 'total:' "$W/stats.log")
    req=$(echo "$line" | sed 's/.*total: \([0-9]*\) requests.*/\1/')
    wv=$(echo "$line" | sed 's/.* in \([0-9]*\) writev.*/\1/')
    iov=$(echo "$line" | sed 's/.*writev (\([0-9.]*\) iovecs each).*/\1/')
    ri=$(echo "$r" | python3 -c 'import json,sys; print(round(json.load(sys.stdin)["iops"]))')
    rp=$(echo "$r" | python3 -c 'import json,sys; print(round(json.load(sys.stdin)["latency_us"]["p99"]))')
    echo "| $tr | $batch | $ri | $rp | $(echo "scale=3; $wv / $req" | bc -l) | $iov |"
  done
done
