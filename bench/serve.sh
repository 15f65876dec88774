#!/usr/bin/env bash
# bench/serve.py on the lent GPU machine, which has no network and no Triton: unpack the carried
# bundle .gpu_triton/ (built by bench/gpu_bundle.sh; git-ignored) and point bench/serve.py at it.
#
#   bash bench/serve.sh [bench.serve arguments]     (device `run`, carry [".gpu_triton"];
#                                                    logs, serve.json and serve.md under $OUT)
#   default arguments: --preset qwen2.5-0.5b --device cuda
#
# The bundle: tritonserver.tar.xz (tritonserver 2.51, the Python backend, its cp312 stub and
# libraries from the nvidia-pytriton 0.7.0 wheel, a fallback libpython3.12), numpy 1.26.4 for
# the stub (with numpy >= 2 it returns EMPTY tensors; see below) and the perf_analyzer wheel.
#   BUNDLE=.gpu_triton  WORK=/tmp/bench_serve  PY=python3  NO_NUMPY_PIN=1 (skip the pin)
#   PA=<perf_analyzer> (instead of the bundled one)
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export OUT="${OUT:-$ROOT/build/serve_out}"
mkdir -p "$OUT"
BUNDLE="${BUNDLE:-$ROOT/.gpu_triton}"
PY="${PY:-python3}"
W="${WORK:-/tmp/bench_serve}"
mkdir -p "$W"
log() { echo "[serve.sh $(date +%T)] $*"; }
[ -d "$BUNDLE" ] || { log "no bundle at $BUNDLE (bash bench/gpu_bundle.sh; carry it)"; exit 1; }

log "host: $(ldd --version 2>&1 | head -1); $($PY -V 2>&1); $(nvidia-smi -L 2>/dev/null | head -1)"
$PY -c "import torch, numpy; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'numpy', numpy.__version__)"

# ---- numpy < 2 for the stub ----------------------------------------------------------------
# The stub's embedded Python ignores PYTHONPATH; it takes its prefix (and site-packages) from
# the `python3` first on PATH, which triton_glue.launch makes the directory of the Python that
# runs bench.serve. So: a venv over $PY (its site-packages through a .pth when $PY is itself a
# venv, as the H200's /opt/torch/.venv is) whose own site-packages holds numpy 1.26 and comes
# first; bench.serve runs from it (the in-process engine then uses the same numpy).
if [ -z "${NO_NUMPY_PIN:-}" ]; then
  V="$W/venv"
  if [ ! -x "$V/bin/python" ]; then
    $PY -m venv --without-pip --system-site-packages "$V" || exit 1
    SP="$("$V/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    $PY -c 'import sys, sysconfig; p = sysconfig.get_paths()
if sys.prefix != sys.base_prefix: print(p["purelib"]); print(p["platlib"])' > "$SP/_base_venv.pth"
    tar -C "$SP" -xJf "$BUNDLE"/numpy-*.tar.xz || exit 1
  fi
  if "$V/bin/python" -c "import numpy, torch; print('stub numpy', numpy.__version__, numpy.__file__); torch.from_numpy(numpy.zeros(2))"; then
    PY="$V/bin/python"
  else
    log "WARNING: numpy 1.26 does not work with this torch: not pinned (responses carry EMPTY tensors: errors)"
  fi
fi

# ---- tritonserver ---------------------------------------------------------------------------
TH="$W/triton"
[ -x "$TH/pytriton/tritonserver/bin/tritonserver" ] || { mkdir -p "$TH" && tar -C "$TH" -xJf "$BUNDLE/tritonserver.tar.xz"; } || exit 1
export TRITONSERVER="$TH/pytriton/tritonserver/bin/tritonserver"
export TRITON_BACKEND_DIR="$TH/pytriton/tritonserver/backends"
# the wheel's libraries (hashed names: no clash with torch's)
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$TH/nvidia_pytriton.libs"
STUB="$TRITON_BACKEND_DIR/python/triton_python_backend_stub"
LIBDIR="$($PY -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR") or "")')"
if LD_LIBRARY_PATH="$LIBDIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ldd "$STUB" | grep "libpython.*not found"; then
  log "no libpython3.12.so.1.0 in $LIBDIR: using the bundled one"
  export LD_LIBRARY_PATH="$TH/libpython${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
case "$("$TRITONSERVER" --help 2>&1)" in *--model-repository*) ;; *) false ;; esac \
  || { log "tritonserver does not run"; ldd "$TRITONSERVER" | grep "not found"; exit 1; }

# ---- perf_analyzer --------------------------------------------------------------------------
if [ -z "${PA:-}" ]; then  # PA=<perf_analyzer>: use that one instead
  mkdir -p "$W/pa" && $PY -m zipfile -e "$BUNDLE"/perf_analyzer-*.whl "$W/pa" && chmod +x "$W/pa/perf_analyzer/bin/perf_analyzer"
  PA_BIN="$W/pa/perf_analyzer/bin/perf_analyzer"
  PA_LD=""
  if ldd "$PA_BIN" | grep -q "not found"; then  # libssl/libcrypto 3: the server bundle has them
    mkdir -p "$W/pa/lib"
    ln -sf "$TH"/nvidia_pytriton.libs/libssl-*.so.3 "$W/pa/lib/libssl.so.3"
    ln -sf "$TH"/nvidia_pytriton.libs/libcrypto-*.so.3 "$W/pa/lib/libcrypto.so.3"
    PA_LD="$W/pa/lib:"
  fi
  cat > "$W/perf_analyzer" <<SH
#!/usr/bin/env bash
LD_LIBRARY_PATH="$PA_LD\${LD_LIBRARY_PATH:-}" exec "$PA_BIN" "\$@"
SH
  chmod +x "$W/perf_analyzer"
  export PA="$W/perf_analyzer"
fi
"$PA" --version 2>/dev/null | head -1

[ $# -gt 0 ] || set -- --preset qwen2.5-0.5b --device cuda
log "python -m bench.serve $*"
$PY -m bench.serve --model-dir "$W/models" "$@" 2>&1 | tee "$OUT/serve.log"
exit "${PIPESTATUS[0]}"
