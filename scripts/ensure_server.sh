# Sourced by scripts/perf.sh and scripts/genai_perf.sh: use the tritonserver listening on gRPC
# port $PORT, or start one on free ports for the run (stopped on exit). Needs ROOT, VENV, PY,
# PORT; sets PORT (gRPC) and SERVER_PID. $1: log file name under build/.
SERVER_PID=""
_stop_server() { [ -n "$SERVER_PID" ] && kill "$SERVER_PID" 2>/dev/null && wait "$SERVER_PID" 2>/dev/null || true; }
trap _stop_server EXIT

_ready() { curl -sf "http://127.0.0.1:$1/v2/health/ready" >/dev/null 2>&1; }

ensure_server() {
  if "$PY" - "$PORT" <<'PY'
import socket, sys
s = socket.socket(); s.settimeout(1)
sys.exit(0 if s.connect_ex(("127.0.0.1", int(sys.argv[1]))) == 0 else 1)
PY
  then
    echo "using the server on gRPC port $PORT"
    return
  fi
  local hp mp log="$ROOT/build/$1"
  read -r hp PORT mp < <("$PY" -c "
import socket
ss=[socket.socket() for _ in range(3)]
[s.bind(('127.0.0.1',0)) for s in ss]
print(*[s.getsockname()[1] for s in ss])")
  mkdir -p "$ROOT/build"
  echo "starting tritonserver (HTTP $hp, gRPC $PORT; log $log)"
  HTTP_PORT=$hp GRPC_PORT=$PORT METRICS_PORT=$mp PATH="$VENV/bin:$PATH" \
    "$PY" -m triton_glue.launch serve > "$log" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 1 300); do
    _ready "$hp" && return
    kill -0 "$SERVER_PID" 2>/dev/null || { tail -30 "$log"; exit 1; }
    sleep 1
  done
  echo "server not ready" >&2; tail -30 "$log"; exit 1
}
