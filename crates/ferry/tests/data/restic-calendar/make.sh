#!/bin/bash
# Makes restic-calendar.tar.gz: a restic repository (password "ferry-test") holding a
# synthetic calendar of snapshots of one small file, their times faked with
# `restic backup --time` in the Europe/Berlin zone: 400 days (one snapshot a day at a
# varying hour, a second one on some days), then 30 hourly ones, some tagged `keep` or
# `audit`. tests/retention.rs backs the same times up into ferry and compares both tools'
# `forget --dry-run` choices. Making it takes minutes (restic derives its key on every
# run), so the result is checked in; run this again to remake it.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export TZ=Europe/Berlin RESTIC_PASSWORD=ferry-test RESTIC_REPOSITORY=$work/repo
restic init -q
echo calendar > "$work/file"
touch -d '2024-01-01 00:00:00' "$work/file"
snap() { # TIME [TAG]
    local tag=()
    [ -n "${2:-}" ] && tag=(--tag "$2")
    restic backup -q --host calendar --time "$1" "${tag[@]}" "$work/file" >/dev/null
}
start=$(date -d '2024-10-20 00:00:00' +%s)
for i in $(seq 0 399); do
    day=$(date -d "@$((start + i * 86400 + 43200))" +%F)
    t="$day $(printf '%02d:%02d:00' $((i * 5 % 24)) $((i * 13 % 60)))"
    tag=
    [ $((i % 50)) -eq 7 ] && tag=keep
    [ $((i % 90)) -eq 44 ] && tag=audit
    snap "$t" "$tag"
    # A second snapshot later that day on some days: the daily rules keep the later one.
    [ $((i % 7)) -eq 3 ] && [ $((i * 5 % 24)) -lt 22 ] && snap "$day $(printf '%02d:59:59' $((i * 5 % 24 + 1)))"
done
# Then 30 hourly snapshots from the next day on.
last=$(date -d "@$((start + 400 * 86400 + 43200))" +%F)
for h in $(seq 0 29); do
    snap "$(date -d "$last 00:30:00 $h hours" '+%F %T')" "$([ "$h" -eq 5 ] && echo keep || true)"
done
tar -C "$work/repo" -czf "$here/restic-calendar.tar.gz" --sort=name --owner=0 --group=0 --mtime='2026-01-01' .
echo "made $here/restic-calendar.tar.gz"
