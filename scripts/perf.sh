#!/usr/bin/env bash
# make perf: perf_analyzer in streaming mode (gRPC) against `ensemble` and `llm`, a bounded
# concurrency sweep with the input data in client/perf_data_*.json; prints its tables.
#
#   PERF_MODELS="ensemble llm"   PERF_CONCURRENCY="1 4 8"   PERF_REQUESTS=32 (per level)
#   GRPC_PORT (8001): a server already listening there is used; otherwise one is started on
#   free ports for the run and stopped afterwards.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
PA="$ROOT/build/bin/perf_analyzer"
[ -x "$PA" ] || bash scripts/install_triton.sh
[ -x "$PA" ] || { echo "perf_analyzer is not installed (scripts/install_triton.sh)" >&2; exit 1; }
MODELS="${PERF_MODELS:-ensemble llm}"
CONC="${PERF_CONCURRENCY:-1 4 8}"
REQS="${PERF_REQUESTS:-32}"
PORT="${GRPC_PORT:-8001}"
# shellcheck source=scripts/ensure_server.sh
source "$ROOT/scripts/ensure_server.sh"
ensure_server perf-server.log

for m in $MODELS; do
  data="client/perf_data_${m}.json"
  [ -f "$data" ] || { echo "no input data $data" >&2; exit 1; }
  for c in $CONC; do
    echo "=== $m, concurrency $c"
    timeout 300 "$PA" -m "$m" -u "127.0.0.1:$PORT" -i grpc --streaming --input-data "$data" \
      --concurrency-range "$c" --request-count "$REQS" | sed -n '/^Request concurrency/,$p'
  done
done
