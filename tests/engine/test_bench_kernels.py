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


def test_critical_path_splits_overlapping_kernels_into_disjoint_shares():
    # (name, µs, start): b starts under a (PDL) and ends 3 µs after it; c lies inside b;
    # d starts after a 1 µs gap, which counts to d (its launch); the shares sum to the span.
    seq = [("a", 5.0, 0.0), ("b", 6.0, 2.0), ("c", 1.0, 4.0), ("d", 2.0, 9.0)]
    assert kernels.critical_path(seq) == [5.0, 3.0, 0.0, 3.0]
    assert kernels.critical_path([]) == []
