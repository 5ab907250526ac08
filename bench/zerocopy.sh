#!/usr/bin/env bash
# Document 002: ferry serve --zerocopy=off|auto|on over TCP loopback, in alternating
# rounds. Each run reads SIZE_G GiB of AES-CTR data from a file export in /dev/shm
# with `ferry copy nbd://127.0.0.1:PORT null:`; prints the client's wall time
# (throughput), the server's user and sys CPU (GNU time around `ferry serve`), and the
# zero-copy part of the server's `--stats` total.
#   SIZE_G=4 ROUNDS=3 bench/zerocopy.sh
set -u
SIZE_G=${SIZE_G:-4}; ROUNDS=${ROUNDS:-3}
FERRY=${FERRY:-$PWD/target/release/ferry}
W=$(mktemp -d /dev/shm/zerocopy.XXXX) || exit 1
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$W"' EXIT
openssl enc -aes-128-ctr -pass pass:ferry -nosalt -pbkdf2 </dev/zero 2>/dev/null | head -c $((SIZE_G<<30)) > "$W/img"
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
echo "| round | mode | GiB/s | server user s | server sys s | client sys s | zero-copy sends | copied by the kernel |"
echo "|---|---|---|---|---|---|---|---|"
for r in $(seq "$ROUNDS"); do
  for mode in off auto on; do
    /usr/bin/time -f "%U %S" -o "$W/server.time" \
      "$FERRY" serve --stats --port "$PORT" --zerocopy="$mode" "file:$W/img" 2> "$W/server.log" &
    tpid=$!
    for i in $(seq 100); do grep -q "listening" "$W/server.log" 2>/dev/null && break; sleep 0.05; done
    /usr/bin/time -f "%e %S" -o "$W/client.time" "$FERRY" copy -q "nbd://127.0.0.1:$PORT" null:
    kill -TERM "$(pgrep -P "$tpid")"; wait "$tpid"
    read -r wall csys < "$W/client.time"; read -r suser ssys < "$W/server.time"
    zc=$(grep "total:" "$W/server.log" | sed -n 's/.*zero-copy: [0-9]* bytes in \([0-9]*\) sendmsg, \([0-9]*\) copied.*/\1 \2/p')
    set -- ${zc:-0 0}
    echo "| $r | $mode | $(python3 -c "print(round($SIZE_G/$wall, 2))") | $suser | $ssys | $csys | $1 | $2 |"
  done
done
