#!/usr/bin/env bash
# ferry's backup repository on a many-core machine: backup, restore, verify and serving
# of an 8 GiB image (1/4 random, 1/2 log-like text, 1/4 holes), on 2 cores (taskset) and on
# all, on a host with no packages (../shared/devbench's bundle).
#   cargo build --release -p ferry
#   ../shared/devbench/make-bundle.sh /tmp/bundle target/release/ferry
#   strip /tmp/bundle/bin/ferry; gcc -O2 -static -o /tmp/bundle/bin/mkmix bench/mkmix.c
#   (on the host) OUT=/tmp/out BUNDLE=/path/to/bundle bash bench/repo-devbench.sh
# MB/s are bytes of the disk (holes included) per second; results in $OUT/results.txt.
set -u
B=${BUNDLE:-$PWD/devbundle}; F=$B/wrap/ferry; NC=$B/wrap/nbdcopy
W=/dev/shm/fw; rm -rf $W; mkdir -p $W
SIZE=$((8 << 30))
R=$OUT/results.txt
echo "host: $(nproc) cpus, $(awk '/MemTotal/{print int($2/1048576)" GiB"}' /proc/meminfo); $(date -u)" | tee $R
grep -m1 'model name' /proc/cpuinfo | tee -a $R
$B/bin/mkmix $SIZE $W/mix.raw || { echo mkmix failed; exit 1; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN{printf "%.2f", b-a}'; }
cell() { # NAME BYTES CMD...
  local name=$1 bytes=$2; shift 2
  local s=$(date +%s.%N); "$@" >>$OUT/out.log 2>>$OUT/err.log; local rc=$?; local e=$(date +%s.%N)
  local t=$(secs $s $e)
  echo "$CPUS | $name | $t s | $(awk -v b=$bytes -v t=$t 'BEGIN{printf "%.0f", b/t/1e6}') MB/s | rc=$rc" | tee -a $R
}
export FERRY_PASSWORD=device-bench-passphrase
for CPUS in 0-1 all; do
  if [ $CPUS = all ]; then TS=""; else command -v taskset >/dev/null || { echo "no taskset: 2-core cells skipped" | tee -a $R; continue; }; TS="taskset -c $CPUS"; fi
  r=$W/r-$CPUS
  $TS $F repo init $r >>$OUT/out.log 2>&1
  cell "backup (8 GiB disk, 6 GiB data)" $SIZE $TS $F backup $W/mix.raw $r::d
  cell "restore to null:" $SIZE $TS $F copy $r::d null:
  cell "restore to a file" $SIZE $TS $F copy $r::d $W/out.raw
  cmp $W/mix.raw $W/out.raw && echo "$CPUS | restored file equals the image" | tee -a $R
  rm -f $W/out.raw
  cell "verify (read every pack)" $SIZE $TS $F repo verify $r
  cell "hash from the index" $SIZE $TS $F hash $r::d
  $TS $F serve -r --unix $W/s.sock $r::d >>$OUT/out.log 2>&1 & sp=$!
  for i in $(seq 100); do [ -S $W/s.sock ] && break; sleep 0.1; done
  cell "nbdcopy from ferry serve REPO::d to null:" $SIZE $TS $NC "nbd+unix:///?socket=$W/s.sock" null:
  kill $sp; wait $sp 2>/dev/null; rm -f $W/s.sock
  e=$W/e-$CPUS
  $TS $F repo init --encrypt $e >>$OUT/out.log 2>&1
  cell "backup, encrypted repository" $SIZE $TS $F backup $W/mix.raw $e::d
  cell "restore to null:, encrypted" $SIZE $TS $F copy $e::d null:
  du -sh $r $e | tee -a $R
  rm -rf $r $e
done
rm -rf $W
