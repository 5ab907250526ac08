#!/usr/bin/env bash
# Offsite copies (issue 37): `ferry repo copy` beside `restic copy`, in one run, on the same
# image. Prints a markdown table.
#
#   bash bench/repo-copy.sh       # from the project root, after cargo build --release -p ferry
#   SIZE_G=1 DIRTY_PCT=2 BENCH_DIR=/var/tmp bash bench/repo-copy.sh
#
# The image: bench/repo-image.py's (SIZE_G GiB: holes, random, text-like and sparse
# binary-like 1 MiB regions). Day 1: backed up into a ferry repository and a restic
# repository (both encrypted; ferry also unencrypted), then each copied into a second,
# empty repository of its kind: `ferry repo copy A B` (B encrypted under another
# passphrase; and an unencrypted A into an unencrypted B), `restic -r B copy --from-repo A`
# (B made with `init --copy-chunker-params`, so that its chunks deduplicate with A's, as
# restic's documentation says to). Day 2: DIRTY_PCT % of the 64 KiB granules get a 4 KiB
# write of random bytes (seeded), each tool backs the image up again, and copies again.
# Wall seconds and peak RSS (/usr/bin/time) of each copy, and the bytes the destination
# grew by (du -sb). One run each: note the machine's load beside the figures.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HERE")
FERRY=${FERRY:-$ROOT/target/release/ferry}
SIZE_G=${SIZE_G:-1}
DIRTY_PCT=${DIRTY_PCT:-2}
W=${BENCH_DIR:-/tmp}/repo-copy.$$
mkdir -p "$W"
trap 'chmod -R u+w "$W"; rm -rf "$W"' EXIT
export FERRY_STATE_DIR=$W/state FERRY_CACHE_DIR=$W/cache RESTIC_CACHE_DIR=$W/restic-cache
unset FERRY_PASSWORD FERRY_PASSWORD_FILE FERRY_TO_PASSWORD FERRY_TO_PASSWORD_FILE RESTIC_PASSWORD
SIZE=$((SIZE_G << 30))
python3 "$HERE/repo-image.py" "$W/disk.raw" "$SIZE"
printf 'source words\n' > "$W/pw1"
printf 'offsite words\n' > "$W/pw2"
chmod 600 "$W/pw1" "$W/pw2"

# timed NAME CMD...: wall seconds and peak RSS (MiB) of CMD into $W/NAME.time.
timed() {
  local name=$1
  shift
  /usr/bin/time -f "%e %M" -o "$W/$name.time" "$@" > "$W/$name.out" 2> "$W/$name.err" \
    || { cat "$W/$name.err" >&2; exit 1; }
}
size_of() { du -sb "$1" | cut -f1; }
row() { # row LABEL NAME GROWTH
  read -r secs kb < "$W/$2.time"
  printf '| %s | %s | %d | %.1f |\n' "$1" "$secs" $((kb / 1024)) "$(echo "$3 / 1048576" | bc -l)"
}

ferry_init() { "$FERRY" repo init "$@" > /dev/null; }
ferry_init --encrypt --password-file "$W/pw1" "$W/fa"
ferry_init --encrypt --password-file "$W/pw2" "$W/fb"
ferry_init "$W/pa"
ferry_init "$W/pb"
restic_a() { restic -r "$W/ra" --password-file "$W/pw1" "$@"; }
restic_b() { restic -r "$W/rb" --password-file "$W/pw2" "$@"; }
restic_a init > /dev/null 2>&1
restic_b init --from-repo "$W/ra" --from-password-file "$W/pw1" --copy-chunker-params > /dev/null 2>&1

backups() {
  FERRY_PASSWORD_FILE=$W/pw1 "$FERRY" backup -q "$W/disk.raw" "$W/fa::vm" > /dev/null
  "$FERRY" backup -q "$W/disk.raw" "$W/pa::vm" > /dev/null
  restic_a backup -q "$W/disk.raw" > /dev/null
}
copies() { # copies DAY
  local fb pb rb
  fb=$(size_of "$W/fb") pb=$(size_of "$W/pb") rb=$(size_of "$W/rb")
  timed "ferry-$1" "$FERRY" repo copy "$W/fa" "$W/fb" --password-file "$W/pw1" --to-password-file "$W/pw2"
  timed "plain-$1" "$FERRY" repo copy "$W/pa" "$W/pb"
  timed "restic-$1" restic -r "$W/rb" --password-file "$W/pw2" copy --from-repo "$W/ra" \
    --from-password-file "$W/pw1"
  echo "| **day $1** | | | |"
  row "ferry repo copy (encrypted → encrypted, another key)" "ferry-$1" $(($(size_of "$W/fb") - fb))
  row "ferry repo copy (unencrypted → unencrypted)" "plain-$1" $(($(size_of "$W/pb") - pb))
  row "restic copy (encrypted → encrypted)" "restic-$1" $(($(size_of "$W/rb") - rb))
}

echo "image: $SIZE_G GiB (bench/repo-image.py), day 2: $DIRTY_PCT % of the 64 KiB granules; load before: $(cut -d' ' -f1-3 /proc/loadavg); $(nproc) cores"
echo
echo "| copy | seconds | peak RSS MiB | destination grew MiB |"
echo "|---|---|---|---|"
backups
copies 1
python3 - "$W/disk.raw" "$DIRTY_PCT" <<'EOF'
import os, random, sys
path, pct = sys.argv[1], float(sys.argv[2])
g, size = 65536, os.path.getsize(path)
rnd = random.Random(37)
fd = os.open(path, os.O_WRONLY)
for o in rnd.sample(range(size // g), int(size // g * pct / 100)):
    os.pwrite(fd, rnd.randbytes(4096), o * g)
os.close(fd)
EOF
backups
copies 2
echo
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
# Each copy restores as its source does: the destination's latest equals the image.
want=$("$FERRY" hash "$W/disk.raw" | cut -d' ' -f1)
got=$(FERRY_PASSWORD_FILE=$W/pw2 "$FERRY" hash "$W/fb::vm" | cut -d' ' -f1)
[ "$want" = "$got" ] || { echo "the copy's hash $got is not the image's $want" >&2; exit 1; }
