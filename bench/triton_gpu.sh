#!/usr/bin/env bash
# TPOT through Triton (perf_analyzer --streaming against `llm`) vs in-process (AsyncEngine), on
# the lent H200, with a Qwen2.5-0.5B-shaped random-weight bf16 engine (load_format dummy,
# async_token_handoff auto); prompt 256, output 128, greedy, ignore_eos; concurrency 1 and 64.
#
#   bash bench/triton_gpu.sh          (on the device; logs and results under $OUT)
#
# The device has no network and no Triton: the carried bundle .gpu_triton/ (git-ignored; see
# bench/RESULTS.md "Through Triton on the H200" for how it is built) holds
#   tritonserver.tar.xz        tritonserver 2.51 + the Python backend + the cp312 stub and the
#                              libraries of the nvidia-pytriton 0.7.0 wheel (stripped), plus a
#                              fallback libpython3.12.so.1.0 (used only if the system has none)
#   numpy-1.26.4-cp312.tar.xz  numpy < 2 for the stub (with numpy >= 2 it returns EMPTY tensors)
#   perf_analyzer-*.whl        perf_analyzer 2.60 (glibc >= 2.38)
# Each Triton run starts tritonserver on a temporary copy of model_repository/llm whose
# parameters are bench/triton_gpu.py's ENGINE_PARAMS (the in-process run uses the same), once
# per stream_coalesce mode in $COALESCE_MODES.
#
# Knobs (defaults for the H200): COALESCE_MODES="off auto"  CONCURRENCY="1 64"
#   REQS_C1=32  ROUNDS=4 (requests at concurrency c>1: c*ROUNDS)  PY=python3  WORK=/tmp/triton_gpu
#   For a CPU smoke test of the script itself: BENCH_DEVICE=cpu BENCH_DTYPE=float32
#   BENCH_SHAPE_OVERRIDES='{"num_hidden_layers":2,...}' TRITON_HOME=<site-packages> PA=<perf_analyzer>
#   TRITON_BACKEND_DIR=<backends with the stub> NO_NUMPY_PIN=1
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/build/triton_gpu_out}"
mkdir -p "$OUT"
BUNDLE="${BUNDLE:-$ROOT/.gpu_triton}"
PY="${PY:-python3}"
W="${WORK:-/tmp/triton_gpu}"
MODES="${COALESCE_MODES:-off auto}"
CONC="${CONCURRENCY:-1 64}"
REQS_C1="${REQS_C1:-32}"
ROUNDS="${ROUNDS:-4}"
HP="${HTTP_PORT:-18000}"; GP="${GRPC_PORT:-18001}"; MP="${METRICS_PORT:-18002}"
RESULTS="$OUT/results.json"
rm -f "$RESULTS"
mkdir -p "$W"
log() { echo "[triton_gpu $(date +%T)] $*"; }

log "host: $(ldd --version 2>&1 | head -1); $($PY -V 2>&1); $(nvidia-smi -L 2>/dev/null | head -1)"
$PY -c "import torch, numpy, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'numpy', numpy.__version__, 'transformers', transformers.__version__)"

# ---- numpy < 2 for the stub (PYTHONPATH reaches the stub's embedded Python) -----------------
if [ -z "${NO_NUMPY_PIN:-}" ]; then
  mkdir -p "$W/site" && tar -C "$W/site" -xJf "$BUNDLE"/numpy-*.tar.xz || exit 1
  OLD_PP="${PYTHONPATH:-}"
  export PYTHONPATH="$W/site${PYTHONPATH:+:$PYTHONPATH}"
  if ! $PY -c "import numpy, torch, transformers; print('stub numpy', numpy.__version__); torch.from_numpy(numpy.zeros(2))"; then
    log "WARNING: numpy 1.26 does not work with this torch: not pinned (responses carry EMPTY tensors; timings still hold)"
    export PYTHONPATH="$OLD_PP"
  fi
fi

# ---- tritonserver ---------------------------------------------------------------------------
TH="${TRITON_HOME:-}"
if [ -z "$TH" ]; then
  TH="$W/triton"
  [ -x "$TH/pytriton/tritonserver/bin/tritonserver" ] || { mkdir -p "$TH" && tar -C "$TH" -xJf "$BUNDLE/tritonserver.tar.xz"; } || exit 1
  export TRITON_BACKEND_DIR="$TH/pytriton/tritonserver/backends"
fi
export TRITONSERVER="$TH/pytriton/tritonserver/bin/tritonserver"
# the wheel's libraries (hashed names: no clash with torch's), for a stub copied elsewhere
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$TH/nvidia_pytriton.libs"
STUB="${TRITON_BACKEND_DIR:-$TH/pytriton/tritonserver/backends}/python/triton_python_backend_stub"
LIBDIR="$($PY -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR") or "")')"
if LD_LIBRARY_PATH="$LIBDIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ldd "$STUB" | grep "libpython.*not found"; then
  log "no libpython3.12.so.1.0 in $LIBDIR: using the bundled one"
  export LD_LIBRARY_PATH="$TH/libpython${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
case "$("$TRITONSERVER" --help 2>&1)" in *--model-repository*) ;; *) false ;; esac || { log "tritonserver does not run"; ldd "$TRITONSERVER" | grep "not found"; exit 1; }

# ---- perf_analyzer --------------------------------------------------------------------------
PA="${PA:-}"
if [ -z "$PA" ]; then
  mkdir -p "$W/pa" && $PY -m zipfile -e "$BUNDLE"/perf_analyzer-*.whl "$W/pa" && chmod +x "$W/pa/perf_analyzer/bin/perf_analyzer"
  PA="$W/pa/perf_analyzer/bin/perf_analyzer"
  if ldd "$PA" | grep "not found"; then  # libssl/libcrypto 3: the server bundle has them
    mkdir -p "$W/pa/lib"
    ln -sf "$TH"/nvidia_pytriton.libs/libssl-*.so.3 "$W/pa/lib/libssl.so.3"
    ln -sf "$TH"/nvidia_pytriton.libs/libcrypto-*.so.3 "$W/pa/lib/libcrypto.so.3"
    PA_LD="$W/pa/lib"
  fi
fi

# ---- model config + input data --------------------------------------------------------------
$PY -m bench.triton_gpu write-model "$W/model" || exit 1
$PY -m bench.triton_gpu input-data "$W/input.json" || exit 1

ready() { $PY - "$1" <<'PY'
import sys, urllib.request
try:
    sys.exit(0 if urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/v2/health/ready", timeout=2).status == 200 else 1)
except Exception:
    sys.exit(1)
PY
}

SPID=""
stop_server() {
  [ -n "$SPID" ] || return 0
  kill "$SPID" 2>/dev/null
  for _ in $(seq 1 60); do kill -0 "$SPID" 2>/dev/null || break; sleep 0.5; done
  kill -9 "$SPID" 2>/dev/null; wait "$SPID" 2>/dev/null; SPID=""
}
trap stop_server EXIT

for mode in $MODES; do
  log "== Triton, stream_coalesce=$mode"
  $PY -m bench.triton_gpu make-repo "$W/repo_$mode" "$W/model" --set "stream_coalesce=$mode" > "$OUT/params_$mode.txt" || exit 1
  SLOG="$OUT/server_$mode.log"
  t0=$(date +%s)
  HTTP_PORT=$HP GRPC_PORT=$GP METRICS_PORT=$MP TRITON_OPEN_RESTRICTED_APIS=1 \
    $PY -m triton_glue.launch serve --model-repository "$W/repo_$mode" > "$SLOG" 2>&1 &
  SPID=$!
  ok=""
  for _ in $(seq 1 240); do
    if ready "$HP"; then ok=1; break; fi
    kill -0 "$SPID" 2>/dev/null || break
    grep -q -E "failed to load|error while loading shared" "$SLOG" && break
    sleep 1
  done
  if [ -z "$ok" ]; then log "server not ready"; tail -40 "$SLOG"; stop_server; continue; fi
  log "server ready in $(( $(date +%s) - t0 )) s"
  for c in $CONC; do
    n=$REQS_C1; [ "$c" -gt 1 ] && n=$((c * ROUNDS))
    wu=$c; [ "$wu" -lt 4 ] && wu=4
    prof="$W/prof_${mode}_c$c.json"
    log "perf_analyzer: concurrency $c, $n requests (+$wu warm-up)"
    timeout 150 env LD_LIBRARY_PATH="${PA_LD:-}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$PA" -m llm \
      -u "127.0.0.1:$GP" -i grpc --streaming --input-data "$W/input.json" --concurrency-range "$c" \
      --request-count "$n" --warmup-request-count "$wu" --measurement-interval 120000 \
      --profile-export-file "$prof" > "$W/pa_${mode}_c$c.txt" 2>&1
    rc=$?
    sed -n '/^\*\*\* Measurement Settings/,$p' "$W/pa_${mode}_c$c.txt" | grep -v '^ *$' | head -40
    [ $rc -eq 0 ] || { log "perf_analyzer rc=$rc"; tail -20 "$W/pa_${mode}_c$c.txt"; }
    [ -f "$prof" ] && $PY -m bench.triton_gpu parse "$prof" --label "Triton gRPC stream_coalesce=$mode" --out "$RESULTS"
  done
  grep -E "\[llm\]|rror" "$SLOG" | head -5
  stop_server
done

log "== in-process AsyncEngine, same engine parameters"
$PY -m bench.triton_gpu inproc "$W/model" --concurrency "$(echo $CONC | tr ' ' ',')" --requests "$REQS_C1" \
  --rounds "$ROUNDS" --out "$W/inproc.json" 2>&1 | grep -v "^$"
$PY - "$W/inproc.json" "$RESULTS" <<'PY'
import json, sys, pathlib
a = json.loads(pathlib.Path(sys.argv[1]).read_text()) if pathlib.Path(sys.argv[1]).exists() else []
p = pathlib.Path(sys.argv[2]); b = json.loads(p.read_text()) if p.exists() else []
p.write_text(json.dumps(a + b, indent=1))
PY
log "== summary"
$PY -m bench.triton_gpu table "$RESULTS" | tee "$OUT/summary.md"
