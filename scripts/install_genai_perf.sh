#!/usr/bin/env bash
# Install genai-perf (PyPI `genai-perf`) into its OWN venv, build/genai-venv by default.
#
#   scripts/install_genai_perf.sh         (`make genai-perf` calls it; idempotent)
#   GENAI_VENV=build/genai-venv  GENAI_PERF_VERSION=0.0.16  PYTHON=python3
#
# genai-perf pulls numpy 2, pandas 3, transformers 5, pyarrow, plotly, kaleido (~950 MB); the
# project venv (.venv) must keep numpy<2 for Triton's Python-backend stub, so the two never
# share site-packages. genai-perf itself is offline-capable: give it a local tokenizer folder
# (--tokenizer models/tiny-llama) and HF_HUB_OFFLINE=1. It runs `perf_analyzer` from PATH:
# put build/bin (the wrapper from scripts/install_triton.sh) first; scripts/genai_perf.sh does.
# Offline machines may carry the wheels in ./.whl (used as --find-links).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
GV="${GENAI_VENV:-$ROOT/build/genai-venv}"
VERSION="${GENAI_PERF_VERSION:-0.0.16}"
STAMP="$GV/.genai-perf-$VERSION"

if [ -f "$STAMP" ] && [ -x "$GV/bin/genai-perf" ]; then
  echo "genai-perf $VERSION already in $GV"
else
  t0=$SECONDS
  rm -rf "$GV"
  "$PYTHON" -m venv "$GV"
  PIP_EXTRA=()
  [ -d "$ROOT/.whl" ] && PIP_EXTRA=(--find-links "$ROOT/.whl")
  # (the grep drops pip's notes about absent file:// extra indexes in this machine's pip.conf)
  set +e
  "$GV/bin/python" -m pip install -q "${PIP_EXTRA[@]}" "genai-perf==$VERSION" 2>&1 \
    | grep -v "is ignored: it is neither a file nor a directory"
  rc=${PIPESTATUS[0]}
  set -e
  if [ "$rc" -ne 0 ] || [ ! -x "$GV/bin/genai-perf" ]; then
    echo "cannot install genai-perf==$VERSION into $GV (no index reachable? carry wheels in ./.whl)" >&2
    rm -rf "$GV"
    exit 1
  fi
  touch "$STAMP"
  echo "genai-perf $VERSION installed into $GV in $((SECONDS - t0)) s"
fi
HF_HUB_OFFLINE=1 "$GV/bin/genai-perf" --version 2>/dev/null | tail -1 || true
[ -x "$ROOT/build/bin/perf_analyzer" ] \
  || echo "WARNING: build/bin/perf_analyzer is missing (scripts/install_triton.sh); genai-perf needs it" >&2
echo "genai-perf: $GV/bin/genai-perf"
