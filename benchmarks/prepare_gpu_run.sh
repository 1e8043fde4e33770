#!/usr/bin/env bash
# Fill the git-ignored third_party/ with what benchmarks/gpu_run.py needs on a GPU machine that has no network:
#   third_party/lomem/        the official LowMemoryBP package (github yyyyychen/LowMemoryBP: lomem/, setup.py, LICENSE)
#   third_party/wheels/       the liger-kernel 0.8.x and cut-cross-entropy wheels (pure Python; the GPU image lacks them)
#   third_party/pywheels/     the pinned peft, timm, bitsandbytes, galore-torch, apollo-torch and torchao wheels, and
#                             jsonschema with its dependencies (the training job checks each record it writes against
#                             experiments/record.schema.json), for the GPU machine's Python (GPU_PYTHON_VERSION,
#                             default 3.12; manylinux x86_64): install them
#                             there with `pip install --no-index --no-deps --target /tmp/site third_party/pywheels/*.whl`
#                             and PYTHONPATH=/tmp/site (the versions of .ci/requirements-cpu.txt)
#   third_party/PREPARED.txt  where each came from
#   third_party/COMMIT        the commit (and "dirty") of this checkout: machine.json's git commit on the GPU machine,
#                             whose copy of the tree may carry a stale .git
#
#   bash benchmarks/prepare_gpu_run.sh commit             # only third_party/COMMIT, again: right before each GPU run
#   bash benchmarks/prepare_gpu_run.sh                    # lomem from the local mirror /work/.mirror/yyyyychen+LowMemoryBP/repo
#   bash benchmarks/prepare_gpu_run.sh /path/to/LowMemoryBP          # ... or from a checkout / a git mirror
#   bash benchmarks/prepare_gpu_run.sh https://github.com/yyyyychen/LowMemoryBP   # ... or cloned from a URL
#
# Nothing here is committed (third_party/ is in .gitignore). Take it along with the device tool's carry: ["third_party"].
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${GPU_RUN_THIRD_PARTY:-$ROOT/third_party}"   # (another folder: pass --third-party to gpu_run.py too)
SRC="${1:-${LOWMEMBP_OFFICIAL_SRC:-/work/.mirror/yyyyychen+LowMemoryBP/repo}}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY=python3
LIGER_SPEC="${LIGER_SPEC:-liger-kernel>=0.8,<0.9}"
# the requirement of pyproject.toml's extra "cce"
CCE_SPEC="${CCE_SPEC:-$("$PY" -c 'import sys, tomllib
print(tomllib.load(open(sys.argv[1], "rb"))["project"]["optional-dependencies"]["cce"][0])' "$ROOT/pyproject.toml")}"

write_commit() {
  local sha dirty
  sha="$(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)"
  dirty="$(git -C "$ROOT" status --porcelain --untracked-files=no 2>/dev/null | head -n 1)"
  mkdir -p "$DEST"
  echo "$sha${dirty:+ dirty}" > "$DEST/COMMIT"
  echo "commit: $(cat "$DEST/COMMIT") -> $DEST/COMMIT"
}
if [ "${1:-}" = commit ]; then write_commit; exit 0; fi

mkdir -p "$DEST/wheels"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# --- the official lomem sources -------------------------------------------------------------------------------------
fetched_from=""
case "$SRC" in
  http://*|https://*|git@*)
    git clone --depth 1 --quiet "$SRC" "$tmp/repo"
    mkdir -p "$tmp/export"
    git -C "$tmp/repo" archive HEAD lomem setup.py LICENSE 2>"$tmp/archive.err" | tar -x -C "$tmp/export" \
      || { cat "$tmp/archive.err" >&2; exit 2; }
    fetched_from="$SRC @ $(git -C "$tmp/repo" rev-parse HEAD)";;
  *)
    [ -e "$SRC" ] || { echo "prepare_gpu_run: no LowMemoryBP sources at $SRC; pass a checkout, a git mirror or a URL" >&2; exit 2; }
    mkdir -p "$tmp/export"
    if [ -d "$SRC/lomem/csrc" ]; then                     # a work tree
      cp -r "$SRC/lomem" "$tmp/export/"; cp "$SRC/setup.py" "$SRC/LICENSE" "$tmp/export/" 2>/dev/null || true
      rev="$(git -C "$SRC" rev-parse --short HEAD 2>/dev/null || true)"
      fetched_from="$SRC (work tree${rev:+ @ $rev})"
    else                                                  # a bare repository / mirror
      # (a partial mirror may lack blobs outside these paths; git archive says so on stderr: shown only on failure)
      git -C "$SRC" archive HEAD lomem setup.py LICENSE 2>"$tmp/archive.err" | tar -x -C "$tmp/export" \
        || { cat "$tmp/archive.err" >&2; exit 2; }
      fetched_from="$SRC @ $(git -C "$SRC" rev-parse HEAD)"
    fi;;
esac
[ -d "$tmp/export/lomem/csrc" ] || { echo "prepare_gpu_run: $SRC has no lomem/csrc" >&2; exit 2; }
rm -rf "$DEST/lomem" "$DEST/setup.py" "$DEST/LICENSE"
cp -r "$tmp/export/." "$DEST/"
echo "lomem: $(ls "$DEST/lomem/csrc" | wc -l) files in csrc from $fetched_from"

# --- the liger-kernel wheel (the newest 0.8.x pip finds; py3-none-any, so any Python 3.10+ takes it) ---------------
rm -f "$DEST"/wheels/liger_kernel-*.whl
"$PY" -m pip download --quiet --no-deps --only-binary=:all: "$LIGER_SPEC" -d "$DEST/wheels"
whl="$(ls "$DEST"/wheels/liger_kernel-*.whl)"
case "$(basename "$whl")" in
  *-py3-none-any.whl) ;;
  *) echo "prepare_gpu_run: $(basename "$whl") is not a pure-Python wheel; the GPU machine runs Python 3.12" >&2; exit 2;;
esac
echo "liger: $(basename "$whl")"

# --- the cut-cross-entropy wheel (method cce; py3-none-any) ---------------------------------------------------------
rm -f "$DEST"/wheels/cut_cross_entropy-*.whl
"$PY" -m pip download --quiet --no-deps --only-binary=:all: "$CCE_SPEC" -d "$DEST/wheels"
whl="$(ls "$DEST"/wheels/cut_cross_entropy-*.whl)"
case "$(basename "$whl")" in
  *-py3-none-any.whl) ;;
  *) echo "prepare_gpu_run: $(basename "$whl") is not a pure-Python wheel" >&2; exit 2;;
esac
echo "cce: $(basename "$whl")"

# --- the pinned library wheels for the GPU machine's Python (no network there; torch is the image's own) ----------
rm -rf "$DEST/pywheels" && mkdir -p "$DEST/pywheels"
pins=()
for pkg in peft timm bitsandbytes galore-torch apollo-torch torchao \
           jsonschema jsonschema-specifications referencing rpds-py attrs; do
  pin="$(grep -i "^${pkg}==" "$ROOT/.ci/requirements-cpu.txt" || true)"
  [ -n "$pin" ] || { echo "prepare_gpu_run: no pin for $pkg in .ci/requirements-cpu.txt" >&2; exit 2; }
  pins+=("$pin")
done
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "${GPU_PYTHON_VERSION:-3.12}" \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 \
  "${pins[@]}" -d "$DEST/pywheels"
echo "pywheels: $(cd "$DEST/pywheels" && ls | tr '\n' ' ')"

{ echo "prepared $(date -u '+%Y-%m-%d %H:%M:%S UTC') by benchmarks/prepare_gpu_run.sh"
  echo "lomem: $fetched_from"
  echo "wheels: $(cd "$DEST/wheels" && ls)"
  echo "pywheels: $(cd "$DEST/pywheels" && ls)"; } > "$DEST/PREPARED.txt"
write_commit
du -sh "$DEST" | awk '{print "third_party/: " $1 " (the device tool carries up to 64 MiB with the working tree)"}'
