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
  LOG="$ROOT/build/perf-server.log"
  echo "starting tritonserver (HTTP $HP, gRPC $PORT; log $LOG)"
  HTTP_PORT=$HP GRPC_PORT=$PORT METRICS_PORT=$MP PATH="$VENV/bin:$PATH" \
    "$PY" -m triton_glue.launch serve > "$LOG" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 1 300); do ready "$HP" && break; kill -0 "$SERVER_PID" 2>/dev/null || { tail -30 "$LOG"; exit 1; }; sleep 1; done
  ready "$HP" || { echo "server not ready" >&2; tail -30 "$LOG"; exit 1; }
fi

for m in $MODELS; do
  data="client/perf_data_${m}.json"
  [ -f "$data" ] || { echo "no input data $data" >&2; exit 1; }
  for c in $CONC; do
    echo "=== $m, concurrency $c"
    timeout 300 "$PA" -m "$m" -u "127.0.0.1:$PORT" -i grpc --streaming --input-data "$data" \
      --concurrency-range "$c" --request-count "$REQS" | sed -n '/^Request concurrency/,$p'
  done
done
