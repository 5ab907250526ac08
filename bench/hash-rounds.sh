#!/usr/bin/env bash
# ferry hash against blksum (blkhash project) and sha256sum, in alternating rounds so each
# tool gets the same conditions on a shared machine. Prints a markdown table of wall times
# per round, the medians of wall and of CPU time (user + system), and checks that ferry's
# and blksum's digests agree.
#   BLKSUM=/path/to/blksum bench/hash-rounds.sh [ROUNDS]
# Inputs, in /dev/shm: 2 GiB and 1 GiB of AES-CTR data, and a 100 GiB sparse file holding
# that 1 GiB at offset 50 GiB. (blksum is not timed on the sparse file: it reads the holes,
# 10-25 s here.)
set -u
ROUNDS=${1:-5}
FERRY=${FERRY:-$PWD/target/release/ferry}
BLKSUM=${BLKSUM:-blksum}
[ -x "$FERRY" ] || { echo "build ferry first: cargo build --release"; exit 1; }
command -v "$BLKSUM" >/dev/null || { echo "blksum not found: set BLKSUM"; exit 1; }
W=$(mktemp -d /dev/shm/hash-rounds.XXXX) || exit 1
trap 'rm -rf "$W"' EXIT
openssl enc -aes-128-ctr -pass pass:ferry -nosalt -pbkdf2 </dev/zero 2>/dev/null | head -c $((2<<30)) > "$W/2g"
head -c 1G "$W/2g" > "$W/1g"
truncate -s 100G "$W/sparse"
dd if="$W/1g" of="$W/sparse" bs=1M seek=$((50<<10)) conv=notrunc status=none

# Wall seconds, then CPU seconds (user + system), of one run.
secs() { local TIMEFORMAT='%3R %3U %3S' t; t=$( { time "$@" >/dev/null 2>&1; } 2>&1 ) || { echo "FAIL FAIL"; return; }
  echo "$t" | awk '{printf "%.3f %.3f", $1, $2 + $3}'; }
med() { sort -g | awk '{a[NR]=$1} END{print a[int((NR+1)/2)]}'; }

for f in 2g 1g sparse; do
  a=$("$FERRY" hash "$W/$f" | cut -d' ' -f1); b=$("$BLKSUM" "$W/$f" | cut -d' ' -f1)
  [ "$a" = "$b" ] && echo "digest $f: $a (ferry = blksum)" || echo "DIGESTS DIFFER on $f: ferry $a, blksum $b"
done
echo
cols="blksum-2g ferry-2g sha256sum-2g blksum-1g ferry-1g ferry-sparse"
echo "| round | blksum 2 GiB | ferry 2 GiB | sha256sum 2 GiB | blksum 1 GiB | ferry 1 GiB | ferry 100 GiB sparse |"
echo "|---|---|---|---|---|---|---|"
for r in $(seq "$ROUNDS"); do
  row="| $r"
  for c in $cols; do
    tool=${c%%-*}; f=$W/${c#*-}
    case $tool in
      blksum) t=$(secs "$BLKSUM" "$f") ;;
      ferry) t=$(secs "$FERRY" hash "$f") ;;
      sha256sum) t=$(secs sha256sum "$f") ;;
    esac
    echo "${t% *}" >> "$W/t-$c"; echo "${t#* }" >> "$W/cpu-$c"; row="$row | ${t% *}"
  done
  echo "$row |"
done
row="| median"; cpu="| CPU s (median)"
for c in $cols; do row="$row | $(med < "$W/t-$c")"; cpu="$cpu | $(med < "$W/cpu-$c")"; done
echo "$row |"
echo "$cpu |"
b=$(med < "$W/t-blksum-2g"); f=$(med < "$W/t-ferry-2g"); one=$(med < "$W/t-ferry-1g"); sp=$(med < "$W/t-ferry-sparse")
printf "\nferry is %.2fx faster than blksum on 2 GiB; sparse 100 GiB / plain 1 GiB = %.2f\n" \
  "$(echo "$b / $f" | bc -l)" "$(echo "$sp / $one" | bc -l)"
