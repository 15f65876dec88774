"""bench/kernels.py runs end to end on CPU (its smoke mode: a scaled-down 0.5B checkpoint
written by write_random_model, loaded through the safetensors path, profiled decode steps)."""
import json

from bench import kernels


def test_kernel_bench_cpu_smoke(tmp_path, capsys):
    out = tmp_path / "out"
    assert kernels.main(["--model-dir", str(tmp_path / "models"), "--out-dir", str(out),
                         "--warmup", "2", "--steps", "3"]) == 0
    md = (out / "kernels.md").read_text()
    assert "CPU ops (nested; smoke run) per decode step:" in md and "over 2 layers" in md
    # Every projection is one F.linear (the fused q/k/v and gate/up): 4 per layer + the LM head.
    row = next(line for line in md.splitlines() if line.startswith("| `aten::linear` |"))
    assert float(row.split("|")[2]) == 2 * 4 + 1, row
    res = json.loads((out / "kernels.json").read_text())
    assert res["census"]["steps"] == 3 and res["census"]["kernels_per_step"] > 100
    assert (out / "kernels_trace.json").stat().st_size > 0
    assert "## Kernels of one decode step" in capsys.readouterr().out
