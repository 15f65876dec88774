#!/usr/bin/env bash
# make serve: tritonserver on model_repository/ in the foreground, under the supervisor of
# triton_glue/supervisor.py (Ctrl-C stops it within TRITON_EXIT_TIMEOUT_SECS + 2 s, leaving
# no stub process and no /dev/shm region behind; a second Ctrl-C kills at once).
#
#   HTTP_PORT=8000 GRPC_PORT=8001 METRICS_PORT=8002   ports (these defaults)
#   TRITON_BIND_ADDRESS=127.0.0.1                     listen address (0.0.0.0: all interfaces)
#   HTTP_MAX_BODY_BYTES=16777216                      larger HTTP bodies get 413 (0: no limit)
#   MODEL_PATH=/path/to/checkpoint                    another local Llama/Qwen checkpoint
#   TOKENIZER_PATH=/path/to/tokenizer                 its tokenizer, when it lives elsewhere
#   LLM_PARAM_<name>=value                            an llm model parameter (README), e.g.
#                                                     LLM_PARAM_max_num_seqs=32
#   OPENAI_PORT=9000                                  the OpenAI-compatible frontend (openai_frontend/,
#                                                     /v1/...); OPENAI_PORT=off: none
#   TRITON_ACCESS_KEY=secret                          unlocks the restricted APIs
#                                                     (model-repository, shared-memory, logging)
#                                                     with header `triton-access-key: secret`
#   TRITON_OPEN_RESTRICTED_APIS=1                     opt in: leave those APIs open
#   extra tritonserver arguments after --, e.g.  scripts/serve.sh -- --log-verbose=1
#
# Model control is off (no remote load/unload). Without Docker this runs the tritonserver
# bundled in the venv's nvidia-pytriton wheel; `make serve-docker` runs the NGC image instead.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${VENV:-$ROOT/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  make setup
fi
if ! "$VENV/bin/python" -m triton_glue.launch check >/dev/null 2>&1; then
  bash scripts/install_triton.sh
fi
if [ -z "${MODEL_PATH:-}" ] && [ ! -f models/tiny-llama/config.json ]; then
  make model
fi
export PATH="$VENV/bin:$PATH"
[ "${1:-}" = "--" ] && shift
echo "tritonserver: HTTP ${HTTP_PORT:-8000}, gRPC ${GRPC_PORT:-8001}, metrics ${METRICS_PORT:-8002}; model ${MODEL_PATH:-models/tiny-llama}" >&2
if [ "${OPENAI_PORT:-9000}" != "off" ]; then
  # beside the server; it exits when the server process does (--exit-with-parent)
  OPENAI_PARENT_PID=$$ "$VENV/bin/python" -m openai_frontend --exit-with-parent &
fi
exec "$VENV/bin/python" -m triton_glue.launch serve -- "$@"
