#!/usr/bin/env bash
# GPU bundle runner, written by `cargo xtask gpu-bundle`. Needs bash, coreutils (timeout) and a GPU; no Rust.
#
#   ./run.sh [OUTDIR] [STEP]...
#
# OUTDIR: where bundle.log, steps/<step>.log and summary.json go (default, also for an empty first
# argument: $OUT, else ./bundle-out). STEP: run only these steps (names as in steps.tsv; `./run.sh --list`
# lists them). Every step runs even after a failure; summary.json is rewritten after each step.
set -u
BUNDLE="$(cd "$(dirname "$0")" && pwd)"
export BUNDLE
if [ "${1:-}" = "--list" ]; then
  cut -f1 "$BUNDLE/steps.tsv"
  exit 0
fi
OUTDIR="${1:-${OUT:-$PWD/bundle-out}}"
[ $# -gt 0 ] && shift
mkdir -p "$OUTDIR/steps"
OUTDIR="$(cd "$OUTDIR" && pwd)"
export OUTDIR
LOG="$OUTDIR/bundle.log"
SUMMARY="$OUTDIR/summary.json"
# The executables travel packed (bin.tar.xz keeps the bundle under its size limit); unpack them once.
if [ ! -d "$BUNDLE/bin" ] && [ -f "$BUNDLE/bin.tar.xz" ]; then
  tar -C "$BUNDLE" -xJf "$BUNDLE/bin.tar.xz" || { echo "run.sh: cannot unpack $BUNDLE/bin.tar.xz (needs tar and xz)" >&2; exit 2; }
fi
export PATH="$BUNDLE/bin:$PATH"
export TF_BUNDLE_DIR="$BUNDLE"
export RUST_BACKTRACE=1

json_escape() {
  local s="$1"
  s="${s//\\/\\\\}"; s="${s//\"/\\\"}"; s="${s//$'\t'/\\t}"; s="${s//$'\n'/\\n}"; s="${s//$'\r'/\\r}"
  printf '%s' "$s"
}

wanted() {
  [ ${#SELECTED[@]} -eq 0 ] && return 0
  local s
  for s in "${SELECTED[@]}"; do [ "$s" = "$1" ] && return 0; done
  return 1
}

SELECTED=("$@")
for s in "${SELECTED[@]}"; do
  if ! cut -f1 "$BUNDLE/steps.tsv" | grep -qxF -- "$s"; then
    echo "run.sh: unknown step '$s'; known steps:" >&2
    cut -f1 "$BUNDLE/steps.tsv" >&2
    exit 2
  fi
done

ENTRIES=()
PASSED=0
FAILED=0
TOTAL_START=$(date +%s.%N)
write_summary() {
  local now total
  now=$(date +%s.%N)
  total=$(awk -v a="$TOTAL_START" -v b="$now" 'BEGIN { printf "%.3f", b - a }')
  {
    printf '{\n  "bundle": "%s",\n  "host": "%s",\n  "steps": [\n' "$(json_escape "$BUNDLE")" "$(json_escape "$(hostname)")"
    local i
    for i in "${!ENTRIES[@]}"; do
      [ "$i" -gt 0 ] && printf ',\n'
      printf '    %s' "${ENTRIES[$i]}"
    done
    printf '\n  ],\n  "totals": {"steps": %d, "passed": %d, "failed": %d, "seconds": %s}\n}\n' \
      $((PASSED + FAILED)) "$PASSED" "$FAILED" "$total"
  } > "$SUMMARY.tmp" && mv "$SUMMARY.tmp" "$SUMMARY"
}

{
  echo "=== bundle run $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || true
} >> "$LOG"

while IFS=$'\t' read -r NAME TIMEOUT COMMAND; do
  [ -z "$NAME" ] && continue
  wanted "$NAME" || continue
  echo "=== step $NAME (timeout ${TIMEOUT}s): $COMMAND" | tee -a "$LOG"
  START=$(date +%s.%N)
  STEP_LOG="$OUTDIR/steps/$NAME.log"
  ( cd "$BUNDLE" && timeout --kill-after=10 "$TIMEOUT" bash -c "$COMMAND" ) > "$STEP_LOG" 2>&1 < /dev/null
  CODE=$?
  cat "$STEP_LOG" >> "$LOG"
  END=$(date +%s.%N)
  SECONDS_TAKEN=$(awk -v a="$START" -v b="$END" 'BEGIN { printf "%.3f", b - a }')
  if [ "$CODE" -eq 0 ]; then
    STATUS=pass; PASSED=$((PASSED + 1))
  else
    STATUS=fail; FAILED=$((FAILED + 1))
  fi
  NOTE=""
  [ "$CODE" -eq 124 ] || [ "$CODE" -eq 137 ] && NOTE="timed out after ${TIMEOUT}s"
  ENTRIES+=("$(printf '{"name": "%s", "command": "%s", "exit_code": %d, "seconds": %s, "status": "%s", "note": "%s"}' \
    "$(json_escape "$NAME")" "$(json_escape "$COMMAND")" "$CODE" "$SECONDS_TAKEN" "$STATUS" "$(json_escape "$NOTE")")")
  if [ "$STATUS" = fail ]; then
    echo "--- last lines of $NAME:"
    tail -n 40 "$STEP_LOG"
  fi
  echo "=== step $NAME: $STATUS (exit $CODE, ${SECONDS_TAKEN}s) $NOTE" | tee -a "$LOG"
  write_summary
done < "$BUNDLE/steps.tsv"

write_summary
echo "=== $PASSED passed, $FAILED failed; log: $LOG; summary: $SUMMARY" | tee -a "$LOG"
echo "$PASSED passed, $FAILED failed"
[ "$FAILED" -eq 0 ]
