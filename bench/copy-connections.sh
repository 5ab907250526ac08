#!/usr/bin/env bash
# ferry copy's default connection count (issue 28) against fixed ones: ferry serve of
# pattern:SIZE_G G (data everywhere, no holes, nothing on disk) on a Unix socket, copied to
# null: with the default -C and with -C 2 (the default before issue 28 on two cores), 4, 8 and 16, in ROUNDS rounds (the -C values
# alternating inside each round). Prints each run's GiB/s from --stats and the median per
# column. Run from the project root after `cargo build --release -p ferry`.
set -u
FERRY=${FERRY:-$PWD/target/release/ferry}
SIZE_G=${SIZE_G:-8}
ROUNDS=${ROUNDS:-3}
W=$(mktemp -d /tmp/ferry-conns.XXXX) || exit 1
cleanup() { kill $(jobs -p) 2>/dev/null; wait 2>/dev/null; rm -rf "$W"; }
trap cleanup EXIT
"$FERRY" serve -q -U "$W/s.sock" "pattern:${SIZE_G}G" &
for i in $(seq 100); do [ -S "$W/s.sock" ] && break; sleep 0.05; done
URI="nbd+unix:///?socket=$W/s.sock"
echo "cores: $(nproc); load: $(cut -d' ' -f1-3 /proc/loadavg); ferry: $("$FERRY" --version)"
cols=(default 2 4 8 16)
for r in $(seq "$ROUNDS"); do
  for c in "${cols[@]}"; do
    opt=(); [ "$c" = default ] || opt=(-C "$c")
    line=$("$FERRY" copy --stats "${opt[@]}" "$URI" null: 2>&1 | grep -o '([0-9.]* GiB/s) over [0-9]*')
    gib=$(echo "$line" | grep -o '[0-9.]* GiB' | cut -d' ' -f1)
    echo "round $r -C $c: $line"
    echo "$gib" >>"$W/$c"
  done
done
printf '| -C |'; for c in "${cols[@]}"; do printf ' %s |' "$c"; done; echo
printf '|---|'; for c in "${cols[@]}"; do printf -- '---|'; done; echo
printf '| GiB/s, median of %s |' "$ROUNDS"
for c in "${cols[@]}"; do printf ' %s |' "$(sort -g "$W/$c" | awk '{a[NR]=$1} END{print a[int((NR+1)/2)]}')"; done; echo
