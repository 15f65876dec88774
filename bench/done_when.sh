#!/usr/bin/env bash
# The GPU runs that issues 12 and 13's "done when" lists ask for, one part per device call
# (each sized for the device's 600 s a command from a cold Triton cache; the parts' H100 runs
# are in bench/RESULTS.md, twenty-sixth and twenty-seventh sessions). On the lent GPU, from the
# repository root, with `carry` empty (.gpu_triton is tracked):
#
#   bash bench/done_when.sh decode     # issue 12: both shapes, batches 1/8/64/256, beside the weight roofline
#                                      #           (PRESETS / BATCHES narrow it for a short budget, e.g.
#                                      #           PRESETS=llama-3-8b BATCHES=1: the 8B target alone, at most 280 s)
#   bash bench/done_when.sh hf         # issue 12: HF generate, static cache, compiled, batch 1, 0.5B shape
#   bash bench/done_when.sh hf8b       # issue 12: the same for the Llama-3-8B shape (a call of its own)
#   bash bench/done_when.sh census     # issue 12: one 0.5B batch-1 step's kernels (torch profiler)
#   bash bench/done_when.sh serve      # issue 13: 0.5B through Triton / in-process / steady, c64 + c256,
#                                      #           greedy + top_p, and the 512-request burst async vs sync
#   bash bench/done_when.sh serve8b    # issue 13: Llama-3-8B through Triton at 64 streams
#
# Logs and JSON under $OUT (default build/done_when). Each part prints its table at the end.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-$ROOT/build/done_when}"
mkdir -p "$OUT"
PY="${PY:-python3}"
part="${1:-}"
nvidia-smi -L 2>/dev/null
case "$part" in
  decode)
    for preset in ${PRESETS:-qwen2.5-0.5b llama-3-8b}; do
      timeout 280 "$PY" -m bench.decode --device cuda --impls async --timeline '' --batches "${BATCHES:-1,8,64,256}" \
        --preset "$preset" --out "$OUT/decode_$preset.json" > "$OUT/decode_$preset.log" 2>&1
      rc=$?
      # the tuner's pick for each projection (share of the copy bandwidth), then the table
      grep "decode gemv" "$OUT/decode_$preset.log"
      grep -v "^\s*$" "$OUT/decode_$preset.log" | grep -v "decode gemv" | tail -16
      echo "decode $preset rc=$rc"
    done ;;
  hf|hf8b)
    # the 8B shape alone in its call: its engine's start (142-175 s with a cold Triton cache)
    # and HF's compile (over 170 s) did not both fit in half a call
    if [ "$part" = hf ]; then preset=qwen2.5-0.5b; limit=290; else preset=llama-3-8b; limit=580; fi
    timeout "$limit" "$PY" -m bench.decode --device cuda --impls async,hf --hf-compile --timeline '' --batches 1 \
      --preset "$preset" --out "$OUT/hf_$preset.json" 2>&1 | grep -v "^\s*$" | grep -v "decode gemv" | tail -12
    echo "hf $preset rc=${PIPESTATUS[0]}" ;;
  census)
    timeout 580 "$PY" -m bench.kernels --device cuda --no-gemm --no-tpot --preset qwen2.5-0.5b \
      --out-dir "$OUT/census" 2>&1 | tail -40
    echo "census rc=${PIPESTATUS[0]}" ;;
  serve)
    timeout 590 bash bench/serve.sh --preset qwen2.5-0.5b --device cuda --engine large --workloads fixed \
      --point-timeout 60 --start-timeout 150 --concurrency 64,256 --samplings greedy,top_p \
      --parts inproc,triton,burst --rounds 16 --time-budget 450 --out-dir "$OUT/serve" > "$OUT/serve.log" 2>&1
    echo "serve rc=$?"; cat "$OUT/serve/serve.md" 2>/dev/null || tail -40 "$OUT/serve.log" ;;
  serve8b)
    timeout 590 bash bench/serve.sh --preset llama-3-8b --device cuda --engine large --workloads fixed \
      --point-timeout 90 --start-timeout 240 --concurrency 64 --samplings greedy --parts inproc,triton \
      --rounds 8 --time-budget 500 --out-dir "$OUT/serve8b" > "$OUT/serve8b.log" 2>&1
    echo "serve8b rc=$?"; cat "$OUT/serve8b/serve.md" 2>/dev/null || tail -40 "$OUT/serve8b.log" ;;
  *)
    sed -n '2,15p' "${BASH_SOURCE[0]}"
    exit 2 ;;
esac
