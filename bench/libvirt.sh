#!/usr/bin/env bash
# A libvirt VM backed up day by day (issue 36): `ferry backup libvirt:DOMAIN REPO` against
# virtnbdbackup (Debian package) on the same VM, with the same data and the same day-2
# changes, in one run. Prints markdown tables.
#
#   bash bench/libvirt.sh          # as root, from the project root, after cargo build --release -p ferry
#   SIZE_G=1 DIRTY_PCT=2 BENCH_DIR=/dev/shm FERRY=target/release/ferry bash bench/libvirt.sh
#
# It starts its own libvirtd as crates/ferry/tests/libvirt.rs does: in the foreground, in a
# private mount namespace whose /etc/libvirt, /run/libvirt and /var/{lib,cache,log}/libvirt
# are directories of the run, with the qemu.conf a host without cgroups or systemd needs;
# KVM where /dev/kvm exists, TCG otherwise. One domain (128 MiB, no guest OS) with one
# virtio disk: a qcow2 image (64 KiB clusters) of SIZE_G GiB of bench/repo.sh's mixed data
# (bench/repo-image.py: 20% holes, 30% random, 35% text-like, 15% sparse binary).
#
# For each tool in turn, from the same day-1 image (the domain is started afresh on a copy):
# 1. Day 1: a full backup of the running domain (`ferry backup libvirt:DOM REPO` into a new
#    repository; `virtnbdbackup -l full -o DIR`, its default stream format, no compression).
# 2. Day 2: DIRTY_PCT % of the disk's 64 KiB granules changed through the running disk (a
#    4 KiB write of random bytes in each, at random granules, the same for both tools: the
#    HMP `qemu-io` command, bench/libvirt-day.py), then an incremental backup (`ferry backup
#    libvirt:DOM REPO` again; `virtnbdbackup -l inc`). Wall seconds and bytes added (du -sb
#    of the repository or the backup directory, after minus before).
# 3. Restore of the day-2 point and of the day-1 point: `ferry restore REPO::DOM@ID --to OUT`
#    (raw, and --format qcow2), `virtnbdrestore -i DIR -o OUT` (qcow2; `-u virtnbdbackup.0`
#    for day 1: the full alone). Each output is compared with what the disk held at that point
#    (cmp for raw, qemu-img compare for qcow2): a differing restore is a FAIL in its cell.
# 4. Where ferry's day-2 time goes: a day 3 (the same amount of change) backed up with every
#    virsh call timed (a virsh on PATH that logs each call's wall time, then runs the real
#    one): the libvirt part (domain XML, checkpoints, backup-begin, domjobabort, checkpoint
#    deletion) against the rest (the repository, the NBD reads, the snapshot). For
#    virtnbdbackup: the wall time of `virtnbdbackup -V` (Python start and imports) and of
#    its day 3 with `-v` (its own log's time stamps: the libvirt job start and the data).
#
# One run of each (a VM start per tool; the whole run takes a few minutes for 1 GiB). The
# machine is shared and noisy: compare within one run, as ratios.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
SIZE_G=${SIZE_G:-1}
DIRTY_PCT=${DIRTY_PCT:-2}
FERRY=$(realpath "${FERRY:-$HERE/../target/release/ferry}")
W=$(mktemp -d "${BENCH_DIR:-/dev/shm}/ferry-libvirt.XXXX") || exit 1
SIZE=$((SIZE_G << 30))
DOM=bench-vm
LVPID=
for t in libvirtd virsh qemu-system-x86_64 qemu-img virtnbdbackup virtnbdrestore unshare python3 openssl; do
  command -v "$t" >/dev/null || [ -x "/usr/sbin/$t" ] || {
    echo "$t is missing: apt-get install libvirt-daemon libvirt-daemon-driver-qemu libvirt-clients qemu-system-x86 virtnbdbackup"
    exit 1
  }
done
[ -x "$FERRY" ] || { echo "no ferry at $FERRY: cargo build --release -p ferry"; exit 1; }

cleanup() {
  if [ -n "$LVPID" ]; then
    for d in $(virsh -c "$URI" -q list --name 2>/dev/null); do virsh -c "$URI" -q destroy "$d" >/dev/null 2>&1; done
    kill "$LVPID" 2>/dev/null
    wait "$LVPID" 2>/dev/null
  fi
  rm -rf "$W"
}
trap cleanup EXIT

# The daemon.
D=$W/lv
mkdir -p "$D"/{etc,run,lib,cache,log,sock} "$W/tmp" "$W/day"
printf 'user = "root"\ngroup = "root"\ncgroup_controllers = [ ]\nnamespaces = [ ]\nsecurity_driver = "none"\nstdio_handler = "file"\n' >"$D/etc/qemu.conf"
printf 'unix_sock_dir = "%s"\nauth_unix_rw = "none"\nlog_outputs = "2:stderr"\n' "$D/sock" >"$D/libvirtd.conf"
mounts=
for m in etc:/etc/libvirt run:/run/libvirt lib:/var/lib/libvirt cache:/var/cache/libvirt log:/var/log/libvirt; do
  mounts+="mkdir -p ${m#*:} && mount --bind $D/${m%%:*} ${m#*:} && "
done
unshare -m --propagation private sh -c "${mounts}exec libvirtd -f $D/libvirtd.conf -p $D/pid" >"$D/libvirtd.log" 2>&1 &
LVPID=$!
URI="qemu:///system?socket=$D/sock/libvirt-sock"
export LIBVIRT_DEFAULT_URI=$URI TMPDIR=$W/tmp
for _ in $(seq 300); do virsh -q version >/dev/null 2>&1 && break; sleep 0.1; done
virsh -q version >/dev/null 2>&1 || { echo "libvirtd did not start:"; cat "$D/libvirtd.log"; exit 1; }
KIND=qemu
[ -e /dev/kvm ] && KIND=kvm

# The data: day 1 (disk.raw, base.qcow2), day 2 and day 3 (the raw twins and the commands).
python3 "$HERE/repo-image.py" "$W/disk.raw" "$SIZE"
qemu-img convert -f raw -O qcow2 -o cluster_size=64k "$W/disk.raw" "$W/base.qcow2"
cp --sparse=always "$W/disk.raw" "$W/day2.raw"
python3 "$HERE/libvirt-day.py" "$DOM" "$SIZE" "$DIRTY_PCT" 2 "$W/day" "$W/day2.raw" >"$W/day2.virsh"
cp --sparse=always "$W/day2.raw" "$W/day3.raw"
python3 "$HERE/libvirt-day.py" "$DOM" "$SIZE" "$DIRTY_PCT" 3 "$W/day" "$W/day3.raw" >"$W/day3.virsh"
rm -f "$W/day3.raw"
WRITES=$(wc -l <"$W/day2.virsh")

# A fresh domain on a copy of day 1.
fresh() {
  virsh -q destroy "$DOM" >/dev/null 2>&1
  virsh -q undefine "$DOM" --checkpoints-metadata >/dev/null 2>&1
  cp --sparse=always "$W/base.qcow2" "$W/vm.qcow2"
  cat >"$W/dom.xml" <<EOF
<domain type='$KIND'><name>$DOM</name><memory unit='MiB'>128</memory><vcpu>1</vcpu>
<os><type arch='x86_64' machine='pc'>hvm</type></os><features><acpi/></features><devices>
<disk type='file' device='disk'><driver name='qemu' type='qcow2'/><source file='$W/vm.qcow2'/>
<target dev='vda' bus='virtio'/></disk></devices></domain>
EOF
  virsh -q define "$W/dom.xml" >/dev/null && virsh -q start "$DOM" >/dev/null || { echo "cannot start $DOM"; exit 1; }
}
# Applies a day's writes through the running disk.
day() {
  virsh -q <"$W/$1.virsh" >"$W/$1.out" 2>&1
  if grep -q -i error "$W/$1.out"; then echo "the writes of $1 failed:"; head "$W/$1.out"; exit 1; fi
}
now() { date +%s.%N; }
since() { printf "%.2f" "$(echo "$(now) - $1" | bc -l)"; }
size() { du -sb "$1" | cut -f1; }
mb() { printf "%.1f" "$(echo "$1 / 1000000" | bc -l)"; }
# timed NAME CMD...: runs CMD, its output in $W/NAME.log; T is its wall seconds, or FAIL.
timed() {
  local n=$1 s
  shift
  s=$(now)
  if "$@" >"$W/$n.log" 2>&1; then T=$(since "$s"); else T=FAIL; echo "$n failed:" >&2; tail -5 "$W/$n.log" >&2; fi
}
# same RESTORED EXPECTED: "same" when the image (raw or qcow2) holds EXPECTED's bytes.
same() {
  [ -f "$1" ] || { echo "FAIL (no $1)"; return; }
  if qemu-img compare -q -F raw "$1" "$2" >/dev/null 2>&1; then echo same; else echo "FAIL (differs)"; fi
}

echo "## libvirt domain, ${SIZE_G} GiB disk, day 2 = ${DIRTY_PCT}% of its 64 KiB granules ($WRITES writes of 4 KiB)"
echo
echo "$(date -u '+%Y-%m-%d %H:%M UTC'), load $(cut -d' ' -f1-3 /proc/loadavg), $KIND, $(libvirtd --version | head -1), $(qemu-system-x86_64 --version | head -1), virtnbdbackup $(virtnbdbackup -V 2>&1 | tail -1)"
echo

# virtnbdbackup.
fresh
V=$W/vnb
timed vfull virtnbdbackup -U "$URI" -d "$DOM" -l full -o "$V" -S "$W/tmp" -f "$W/tmp/vnb.sock" -n
VFULL=$T VFULLB=$(size "$V")
day day2
timed vinc virtnbdbackup -U "$URI" -d "$DOM" -l inc -o "$V" -S "$W/tmp" -f "$W/tmp/vnb.sock" -n
VINC=$T VINCB=$(($(size "$V") - VFULLB))
timed vrest2 virtnbdrestore -U "$URI" -i "$V" -o "$W/vr2" -f "$W/tmp/vnr.sock" -n
VREST2=$T VSAME2=$(same "$(ls "$W"/vr2/*.qcow2 2>/dev/null | head -1)" "$W/day2.raw")
timed vrest1 virtnbdrestore -U "$URI" -i "$V" -o "$W/vr1" -u virtnbdbackup.0 -f "$W/tmp/vnr.sock" -n
VREST1=$T VSAME1=$(same "$(ls "$W"/vr1/*.qcow2 2>/dev/null | head -1)" "$W/disk.raw")
rm -rf "$W/vr1" "$W/vr2"
# Day 3, with its own log: the job's start and the data.
day day3
s=$(now)
virtnbdbackup -U "$URI" -d "$DOM" -l inc -o "$V" -S "$W/tmp" -f "$W/tmp/vnb.sock" -n -v >"$W/vinc3.log" 2>&1
VINC3=$(since "$s")
s=$(now)
virtnbdbackup -V >/dev/null 2>&1
VSTART=$(since "$s")
rm -rf "$V"

# ferry.
fresh
R=$W/repo
"$FERRY" repo init "$R" >/dev/null || exit 1
R0=$(size "$R")
point() { sed -n 's/.*"point":"\([0-9a-f]*\)".*/\1/p' "$W/$1.log"; }
timed ffull "$FERRY" backup --json "libvirt:$DOM" "$R"
FFULL=$T FFULLB=$(($(size "$R") - R0)) P1=$(point ffull)
day day2
timed finc "$FERRY" backup --json "libvirt:$DOM" "$R"
FINC=$T FINCB=$(($(size "$R") - R0 - FFULLB)) P2=$(point finc)
timed frest2 "$FERRY" restore "$R::$DOM@${P2:0:12}" --to "$W/fr2"
FREST2=$T FSAME2=$(same "$W/fr2/$DOM-vda.raw" "$W/day2.raw")
rm -rf "$W/fr2"
timed frest2q "$FERRY" restore "$R::$DOM@${P2:0:12}" --to "$W/fr2" --format qcow2
FREST2Q=$T FSAME2Q=$(same "$W/fr2/$DOM-vda.qcow2" "$W/day2.raw")
rm -rf "$W/fr2"
timed frest1 "$FERRY" restore "$R::$DOM@${P1:0:12}" --to "$W/fr1" --format qcow2
FREST1=$T FSAME1=$(same "$W/fr1/$DOM-vda.qcow2" "$W/disk.raw")
rm -rf "$W/fr1"
# Day 3, every virsh call timed.
mkdir -p "$W/bin"
cat >"$W/bin/virsh" <<EOF
#!/bin/sh
s=\$(date +%s.%N); $(command -v virsh) "\$@"; rc=\$?; e=\$(date +%s.%N)
echo "\$s \$e \$*" >>"$W/virsh-calls"; exit \$rc
EOF
chmod +x "$W/bin/virsh"
day day3
s=$(now)
PATH=$W/bin:$PATH "$FERRY" backup "libvirt:$DOM" "$R" >"$W/finc3.log" 2>&1 || echo "ferry's day 3 failed" >&2
FINC3=$(since "$s")
CALLS=$(wc -l <"$W/virsh-calls")
VIRSH=$(awk '{t += $2 - $1} END {printf "%.2f", t}' "$W/virsh-calls")

ratio() { case "$1$2" in *FAIL*) echo -;; *) printf "%.1fx" "$(echo "$1 / $2" | bc -l)";; esac; }
echo "| | virtnbdbackup | ferry | virtnbdbackup / ferry |"
echo "|---|---|---|---|"
echo "| day 1 (full): s | $VFULL | $FFULL | $(ratio "$VFULL" "$FFULL") |"
echo "| day 1: MB stored | $(mb "$VFULLB") | $(mb "$FFULLB") | $(ratio "$VFULLB" "$FFULLB") |"
echo "| day 2 (incremental): s | $VINC | $FINC | $(ratio "$VINC" "$FINC") |"
echo "| day 2: MB added | $(mb "$VINCB") | $(mb "$FINCB") | $(ratio "$VINCB" "$FINCB") |"
echo "| restore of day 2: s (qcow2) | $VREST2 ($VSAME2) | $FREST2Q ($FSAME2Q) | $(ratio "$VREST2" "$FREST2Q") |"
echo "| restore of day 2: s (ferry raw) | | $FREST2 ($FSAME2) | |"
echo "| restore of day 1: s (qcow2) | $VREST1 ($VSAME1) | $FREST1 ($FSAME1) | $(ratio "$VREST1" "$FREST1") |"
echo
echo "Where day 3's time goes (the same amount of change as day 2):"
echo
echo "| | s |"
echo "|---|---|"
echo "| ferry day 3, all | $FINC3 |"
echo "| ferry: $CALLS virsh calls (libvirt) | $VIRSH |"
echo "| ferry: the rest (repository, NBD reads, snapshot) | $(printf "%.2f" "$(echo "$FINC3 - $VIRSH" | bc -l)") |"
echo "| virtnbdbackup day 3 (with -v), all | $VINC3 |"
echo "| virtnbdbackup -V (Python start and imports) | $VSTART |"
echo
echo "ferry's virsh calls on day 3 (s, call):"
echo
awk '{d = $2 - $1; $1 = $2 = ""; sub(/^ *-c [^ ]* -q /, ""); printf "    %.3f %s\n", d, substr($0, 1, 60)}' "$W/virsh-calls"
echo
echo "virtnbdbackup's day-3 log (time stamps):"
echo
grep -E "Starting|backup job|Backup of disk|Saved|Finished|checkpoint|Redefin" "$W/vinc3.log" | cut -c1-140 | sed 's/^/    /'
