#!/usr/bin/env bash
# make genai-perf: a short genai-perf profile (streaming, gRPC, offline) against the
# vllm_backend interface (`vllm_model`, --backend vllm) and the TensorRT-LLM interface
# (`ensemble`, --backend tensorrtllm); prints genai-perf's tables. Artifacts: out/genai-perf/.
#
#   GENAI_MODELS="vllm_model:vllm ensemble:tensorrtllm"   model:backend pairs
#   GENAI_CONCURRENCY=2  GENAI_REQUESTS=16  GENAI_ISL=16  GENAI_OSL=8
#   GRPC_PORT (8001): a server already listening there is used; otherwise one is started on
#   free ports for the run and stopped afterwards.
#   TOKENIZER (models/tiny-llama): a local tokenizer folder; nothing is downloaded.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
GV="${GENAI_VENV:-$ROOT/build/genai-venv}"
GP="$GV/bin/genai-perf"
[ -x "$GP" ] || bash scripts/install_genai_perf.sh
[ -x "$ROOT/build/bin/perf_analyzer" ] || bash scripts/install_triton.sh
[ -x "$ROOT/build/bin/perf_analyzer" ] || { echo "perf_analyzer is not installed (scripts/install_triton.sh)" >&2; exit 1; }
PAIRS="${GENAI_MODELS:-vllm_model:vllm ensemble:tensorrtllm}"
CONC="${GENAI_CONCURRENCY:-2}"
REQS="${GENAI_REQUESTS:-16}"
ISL="${GENAI_ISL:-16}"
OSL="${GENAI_OSL:-8}"
TOKENIZER="${TOKENIZER:-$ROOT/models/tiny-llama}"
OUT="${GENAI_OUT:-$ROOT/out/genai-perf}"
PORT="${GRPC_PORT:-8001}"
SERVER_PID=""
cleanup() { [ -n "$SERVER_PID" ] && kill "$SERVER_PID" 2>/dev/null && wait "$SERVER_PID" 2>/dev/null || true; }
trap cleanup EXIT

ready() { curl -sf "http://127.0.0.1:$1/v2/health/ready" >/dev/null 2>&1; }
if "$PY" - "$PORT" <<'PY'
import socket, sys
s = socket.socket(); s.settimeout(1)
sys.exit(0 if s.connect_ex(("127.0.0.1", int(sys.argv[1]))) == 0 else 1)
PY
then
  echo "using the server on gRPC port $PORT"
else
  read -r HP PORT MP < <("$PY" -c "
import socket
ss=[socket.socket() for _ in range(3)]
[s.bind(('127.0.0.1',0)) for s in ss]
print(*[s.getsockname()[1] for s in ss])")
  mkdir -p "$ROOT/build"
  LOG="$ROOT/build/genai-perf-server.log"
  echo "starting tritonserver (HTTP $HP, gRPC $PORT; log $LOG)"
  HTTP_PORT=$HP GRPC_PORT=$PORT METRICS_PORT=$MP PATH="$VENV/bin:$PATH" \
    "$PY" -m triton_glue.launch serve > "$LOG" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 1 300); do ready "$HP" && break; kill -0 "$SERVER_PID" 2>/dev/null || { tail -30 "$LOG"; exit 1; }; sleep 1; done
  ready "$HP" || { echo "server not ready" >&2; tail -30 "$LOG"; exit 1; }
fi

# offline: local tokenizer, no hub; perf_analyzer = our wrapper (glibc shim where needed)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PATH="$ROOT/build/bin:$PATH" COLUMNS="${COLUMNS:-150}"
for pair in $PAIRS; do
  m="${pair%%:*}"; backend="${pair##*:}"
  echo "=== genai-perf: $m (--backend $backend), concurrency $CONC, $REQS requests"
  timeout 600 "$GP" profile -m "$m" --backend "$backend" --endpoint-type kserve --streaming \
    -u "127.0.0.1:$PORT" \
    --tokenizer "$TOKENIZER" --num-dataset-entries "$REQS" \
    --synthetic-input-tokens-mean "$ISL" --synthetic-input-tokens-stddev 0 \
    --output-tokens-mean "$OSL" --output-tokens-mean-deterministic \
    --concurrency "$CONC" --request-count "$REQS" --warmup-request-count 2 --random-seed 0 \
    --artifact-dir "$OUT/$m"
done
echo "artifacts (inputs.json, profile_export*.json/.csv): $OUT"
