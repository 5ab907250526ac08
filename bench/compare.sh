#!/bin/bash
# `ferry compare` beside `qemu-img compare` on the same pairs of 1 GiB disks: dense
# (random bytes) and sparse (8 MiB of data in holes), raw against raw, raw against qcow2,
# a repository snapshot against a file; identical pairs and a pair that differs in the
# last MiB. Each pair runs RUNS times, page cache warm; the lowest wall time and the
# lowest CPU time (user + system, all threads) of each are printed, WALL/CPU in seconds:
# on a loaded machine the CPU time is the figure that compares.
#
#   bench/compare.sh [DIR] [RUNS]     (DIR: scratch, about 4.5 GB; default /tmp/compare-bench)
set -euo pipefail
dir=${1:-/tmp/compare-bench}
runs=${2:-3}
ferry=${FERRY:-$(dirname "$0")/../target/release/ferry}
mkdir -p "$dir"
cd "$dir"
if [ ! -e dense.qcow2 ]; then
    head -c 1G /dev/urandom >dense.raw
    cp dense.raw dense2.raw
    cp dense.raw dense-diff.raw
    printf 'x' | dd of=dense-diff.raw bs=1 seek=$((1024 * 1024 * 1024 - 4096)) conv=notrunc status=none
    truncate -s 1G sparse.raw
    dd if=dense.raw of=sparse.raw bs=1M count=8 seek=500 conv=notrunc status=none
    cp --sparse=always sparse.raw sparse2.raw
    qemu-img convert -O qcow2 dense.raw dense.qcow2
    qemu-img convert -O qcow2 sparse.raw sparse.qcow2
    rm -rf repo
    "$ferry" repo init repo >/dev/null
    "$ferry" -q backup dense.raw repo::dense
    "$ferry" -q backup sparse.raw repo::sparse
fi
best() { # "WALL/CPU": the best of $runs wall times and CPU times (user + system) of "$@"
    local bw= bc=
    for _ in $(seq "$runs"); do
        local out w c
        /usr/bin/time -o time.out -f '%e %U %S' "$@" >/dev/null 2>&1 || true
        out=$(tail -1 time.out)
        w=$(echo "$out" | cut -d' ' -f1)
        c=$(echo "$out" | awk '{ print $2 + $3 }')
        if [ -z "$bw" ] || [ "$(echo "$w < $bw" | bc)" = 1 ]; then bw=$w; fi
        if [ -z "$bc" ] || [ "$(echo "$c < $bc" | bc)" = 1 ]; then bc=$c; fi
    done
    printf '%.2f/%.2f' "$bw" "$bc"
}
echo "$(date -u +%FT%TZ) load: $(cut -d' ' -f1-3 /proc/loadavg)"
printf '%-34s %12s %12s\n' pair ferry qemu-img
for pair in "dense.raw dense2.raw" "dense.raw dense-diff.raw" "dense.raw dense.qcow2" "sparse.raw sparse2.raw" \
    "sparse.raw sparse.qcow2"; do
    set -- $pair
    printf '%-34s %12s %12s\n' "$1 $2" "$(best "$ferry" compare "$1" "$2")" "$(best qemu-img compare "$1" "$2")"
done
# A snapshot against a file: qemu-img reads the snapshot through ferry serve.
for name in dense sparse; do
    "$ferry" serve --fork -P serve.pid -U "$dir/s.sock" -r "repo::$name" >/dev/null
    printf '%-34s %12s %12s\n' "repo::$name $name.raw" "$(best "$ferry" compare "repo::$name" "$name.raw")" \
        "$(best qemu-img compare -f raw "nbd+unix:///?socket=$dir/s.sock" "$name.raw")"
    kill "$(cat serve.pid)"
    sleep 0.5
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
