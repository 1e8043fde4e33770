#!/usr/bin/env bash
# The one command of a GPU run, from the repository root on the GPU machine, with third_party/ (filled by
# benchmarks/prepare_gpu_run.sh) beside the checkout; the parts share --budget-s (default 480 s). The pinned library
# wheels of third_party/pywheels/ (peft, timm, bitsandbytes, galore-torch, apollo-torch, torchao; jsonschema and its
# dependencies, for the records), where present, are installed first into a folder put on PYTHONPATH (no network
# needed; torch stays the machine's own).
# Writes results/gpu/ (every CSV, machine.json, summary.md, the logs) and, where $OUT names a folder, packs
# it into $OUT/gpu_results.tgz (one file to carry back) and copies summary.md beside it.
# Unpack elsewhere with: tar -xzf gpu_results.tgz -C results/   (docs/gpu-run.md describes every file).
# Extra arguments go to benchmarks/gpu_run.py (e.g. --budget-s 400, --parts fig1,llama).
set -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
DEST="${GPU_RUN_DEST:-results/gpu}"
PY="${PYTHON:-python3}"
mkdir -p "$DEST"
if compgen -G "third_party/pywheels/*.whl" >/dev/null; then
  SITE="${TMPDIR:-/tmp}/lowmembp_site"
  "$PY" -m pip install -q --no-index --no-deps --target "$SITE" --upgrade third_party/pywheels/*.whl \
    && export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" \
    || echo "gpu_run.sh: installing third_party/pywheels failed; the machine's own packages are used" >&2
fi
PYTHONUNBUFFERED=1 "$PY" benchmarks/gpu_run.py --out "$DEST" "$@" 2>&1 | tee "$DEST/run.log"
rc=${PIPESTATUS[0]}
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
  tar -czf "$OUT/gpu_results.tgz" -C "$(dirname "$DEST")" "$(basename "$DEST")"
  cp "$DEST/summary.md" "$OUT/summary.md" 2>/dev/null || true
fi
exit "$rc"
