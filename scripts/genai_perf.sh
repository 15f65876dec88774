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
# shellcheck source=scripts/ensure_server.sh
source "$ROOT/scripts/ensure_server.sh"
ensure_server genai-perf-server.log

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
