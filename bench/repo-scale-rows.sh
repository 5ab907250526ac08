#!/usr/bin/env bash
# The command rows of one kept large repository with one ferry binary (issue 35, fifth round):
# peak RSS and wall time of each step, in the order a fleet meets them: the first backup on a
# host (its index cache built), the same again, a restore, hash, check, gc beside four backups
# (bench/repo-gc-concurrent.sh, with its second gc and restores), the first backup after those
# gcs, a forget + gc of the small disk and the backup after it, check again. Run it with two
# binaries on the same freshly built repository (one after the other, rebuilding in between)
# to compare them.
#
#   F=target/release/ferry TAG=new DIR=/tmp/scale10m bash bench/repo-scale-rows.sh
#
# DIR is a directory kept by `bench/repo-scale.sh --keep DIR` (DIR/repo, DIR/state,
# DIR/cache); the small disk (64 MiB of AES-CTR bytes) is made as DIR/small.raw. Writes
# DIR/rows-TAG.md (the table) and DIR/rows-TAG.log. It leaves one snapshot of the small disk
# (named small) in the repository; repo-gc-concurrent.sh removes its own.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
F=$(realpath "${F:?F: the ferry binary}"); TAG=${TAG:?TAG: a name for the output files}
DIR=${DIR:-/tmp/scale10m}; R=$DIR/repo
[ -d "$R" ] || { echo "$R: no repository there (bench/repo-scale.sh --keep $DIR makes one)"; exit 1; }
export FERRY_STATE_DIR=$DIR/state FERRY_CACHE_DIR=$DIR/cache
O=$DIR/rows-$TAG.md; L=$DIR/rows-$TAG.log
[ -f "$DIR/small.raw" ] || openssl enc -aes-128-ctr -pass pass:small10m -nosalt -pbkdf2 </dev/zero 2>/dev/null | head -c 64M >"$DIR/small.raw"
stamp() { echo "$(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"; }
row() { # LABEL CMD...
  local label=$1 t m rc; shift
  echo "== $label: $* ($(stamp))" >>"$L"
  /usr/bin/time -f '%e %M' -o "$DIR/t.$$" "$@" >>"$L" 2>&1; rc=$?
  read -r t m < <(tail -1 "$DIR/t.$$")
  echo "| $label | $rc | $t | $((m / 1000)) | $(stamp) |" | tee -a "$O"
}
{ echo "# rows of $R, $TAG, $("$F" --version | head -1), $(date -u +%F)"
  echo "| step | exit | s | peak MB | at |"; echo "|---|---|---|---|---|"; } >"$O"
row "repo list" "$F" repo list "$R"
row "backup small.raw (64 MiB), first" "$F" backup --json "$DIR/small.raw" "$R::small"
row "the same again (warm)" "$F" backup --json "$DIR/small.raw" "$R::small"
row "copy REPO::small" "$F" copy -q "$R::small" "$DIR/out.raw"
cmp -s "$DIR/small.raw" "$DIR/out.raw" && echo "restore byte-exact" >>"$O" || echo "RESTORE DIFFERS" >>"$O"
rm -f "$DIR/out.raw"
row "hash REPO::small" "$F" hash "$R::small"
row "repo check" "$F" repo check "$R"
FERRY=$F OUT=$DIR/gcc-$TAG.md BENCH_DIR=$DIR/gccw bash "$HERE/repo-gc-concurrent.sh" "$R" >>"$L" 2>&1
echo "repo-gc-concurrent.sh exit $?" >>"$O"
cat "$DIR/gcc-$TAG.md" >>"$O"
row "backup small.raw, first after the gcs" "$F" backup --json "$DIR/small.raw" "$R::small"
row "the same again (warm)" "$F" backup --json "$DIR/small.raw" "$R::small"
ids=$("$F" repo list --json "$R" | python3 -c 'import json,sys; print(" ".join(s["id"] for s in json.load(sys.stdin) if s["name"]=="small"))')
# shellcheck disable=SC2086
"$F" repo forget "$R" $ids >>"$L" 2>&1
row "forget small + repo gc" "$F" repo gc "$R"
row "backup small.raw, first after that gc" "$F" backup --json "$DIR/small.raw" "$R::small"
row "repo check, at the end" "$F" repo check "$R"
echo "done $(stamp)" >>"$O"
