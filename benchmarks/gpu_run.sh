#!/usr/bin/env bash
# The one command of a GPU session (issue #12). With the device tool:
#   run(command="bash benchmarks/gpu_run.sh", carry=["third_party"], timeout_s=560)
# Writes results/gpu/ (every CSV, machine.json, summary.md, the logs) and, where the device tool's $OUT is set, packs
# it into $OUT/gpu_results.tgz (the tool brings back at most 8 files) and copies summary.md beside it.
# Back here: tar -xzf <files_at>/gpu_results.tgz -C results/   then commit results/gpu/.
# Extra arguments go to benchmarks/gpu_run.py (e.g. --budget-s 400, --parts fig1,llama).
set -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
DEST="${GPU_RUN_DEST:-results/gpu}"
PY="${PYTHON:-python3}"
mkdir -p "$DEST"
PYTHONUNBUFFERED=1 "$PY" benchmarks/gpu_run.py --out "$DEST" "$@" 2>&1 | tee "$DEST/run.log"
rc=${PIPESTATUS[0]}
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
  tar -czf "$OUT/gpu_results.tgz" -C "$(dirname "$DEST")" "$(basename "$DEST")"
  cp "$DEST/summary.md" "$OUT/summary.md" 2>/dev/null || true
fi
exit "$rc"
