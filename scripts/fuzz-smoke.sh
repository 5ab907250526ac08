#!/usr/bin/env bash
# Bounded fuzz smoke run of the cargo-fuzz targets (fuzz/fuzz_targets/*.rs): ferry-proto's
# server-side and client-side parsers, ferry-client's URI parser, the qcow2 format layer, and
# ferry-repo's backup repository objects (repo_format) and its local index cache's run files
# (repo_runs), and ferry-open's MBR and GPT partition tables (partitions, for ferry mount).
#
#   scripts/fuzz-smoke.sh [SECONDS_PER_TARGET]     (default 20)
#
# Works on a stable toolchain: with `--sanitizer none` cargo-fuzz passes no -Z flag
# (libFuzzer's coverage instrumentation uses stable -C flags), and ferry-proto and ferry-qcow2 are
# #![forbid(unsafe_code)], so AddressSanitizer would add little. Targets are built
# optimised with debug assertions and overflow checks on (cargo-fuzz's default).
#
# Each target starts from a fresh copy of fuzz/seeds/<target>/ in fuzz/corpus-run/
# (gitignored; fuzz/seeds is never written). Exits non-zero if any target crashes,
# panics, times out or runs out of memory; the input is then in
# fuzz/artifacts/<target>/ and `cargo fuzz run -s none <target> <file>` replays it.
set -euo pipefail

secs=${1:-20}
case $secs in '' | *[!0-9]*) echo "usage: $0 [SECONDS_PER_TARGET]" >&2; exit 2 ;; esac
cd "$(dirname "$0")/../fuzz"

if ! cargo fuzz --version >/dev/null 2>&1; then
    cargo install cargo-fuzz --locked
fi

flags=(--sanitizer none)
start=$SECONDS
cargo fuzz build "${flags[@]}"
echo "fuzz-smoke: build took $((SECONDS - start)) s"

failed=()
for target in $(cargo fuzz list); do
    corpus=corpus-run/$target
    rm -rf "$corpus"
    mkdir -p "$corpus"
    if [ -d "seeds/$target" ]; then
        cp seeds/"$target"/* "$corpus"/
    fi
    log=corpus-run/$target.log
    echo "fuzz-smoke: $target for ${secs}s from $(ls "$corpus" | wc -l) seeds"
    # -timeout: one input running 10 s is a hang; -rss_limit_mb: a runaway allocation.
    if cargo fuzz run "${flags[@]}" "$target" "$corpus" -- \
        -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -max_len=4096 \
        -print_final_stats=1 >"$log" 2>&1; then
        execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
        rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log")
        echo "fuzz-smoke: $target ok: ${execs:-?} executions (${rate:-?}/s), $(grep -m1 -E '^#[0-9]+[[:space:]]+DONE' "$log" | tr -s '[:space:]' ' ' || true)"
    else
        echo "fuzz-smoke: $target FAILED (full log: fuzz/$log):" >&2
        grep -E -A12 "panicked|ERROR: libFuzzer|deadly signal|SUMMARY|Test unit written|Base64" "$log" | head -60 >&2 || tail -40 "$log" >&2
        failed+=("$target")
    fi
done

echo "fuzz-smoke: total $((SECONDS - start)) s"
if [ ${#failed[@]} -ne 0 ]; then
    echo "fuzz-smoke: crashes in: ${failed[*]}" >&2
    exit 1
fi
