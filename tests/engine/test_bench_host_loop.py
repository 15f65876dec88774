"""bench/host_loop.py's before/after mode on CPU: --churn steps (prefill chunks admitted every
step, through the no-math mixed program), --repeat pairs with their medians, and --sections."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_compare_with_churn_and_repeat(tmp_path):
    before = tmp_path / "before"
    before.mkdir()
    # "before" is this checkout's backend_lib too: the mode, not a difference, is under test
    subprocess.run(f"git -C {ROOT} archive HEAD backend_lib | tar -x -C {before}", shell=True, check=True)
    out = tmp_path / "host_loop.json"
    r = subprocess.run([sys.executable, "-m", "bench.host_loop", "--batches", "4,8", "--churn", "2", "--steps", "8",
                        "--warmup", "2", "--max-model-len", "128", "--compare", str(before), "--repeat", "2",
                        "--sections", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert len(res["pairs"]) == 2
    for pair in res["pairs"]:
        assert str(before) in pair["before"]["backend"] and str(ROOT) in pair["after"]["backend"]
        for side in ("before", "after"):
            rows = pair[side]["rows"]
            assert [row["batch"] for row in rows] == [4, 8]
            # two requests retired and two admitted before each timed step: the batch stays full
            # and every step carries their prefill chunks
            assert all(row["tokens_per_step"] >= row["batch"] - 2 and row["host_us"] > 0 for row in rows)
            for row in rows:  # --sections: every step admits, so it hashes, packs and replays a mixed graph
                sec = row["sections_us"]
                assert sec["block hashing"] > 0 and sec["mixed pack"] > 0 and sec["mixed graph replay"] > 0
                assert sec["decode graph replay"] == 0
                assert sum(sec.values()) < row["host_mean_us"]  # parts of the timed phases
    table = r.stdout[r.stdout.index("2 pairs, alternating order"):].splitlines()
    assert [line.split(" | ")[0] for line in table[3:5]] == ["| 4", "| 8"]
    assert all(len(line.split(" | ")[1].split()) == 2 for line in table[3:5])  # a ratio per pair
    head = next(i for i, line in enumerate(r.stdout.splitlines()) if line.startswith("after, sections"))
    assert r.stdout.splitlines()[head + 1] == ("| batch | block hashing | table plan | mixed pack | table apply "
                                               "| decode graph replay | mixed graph replay |")




def test_set_gives_every_engine_a_config_field(tmp_path):
    """--set FIELD=VALUE reaches the engine typed (2 sequences at most: a batch of 4 runs 2
    rows a step), also the engines of the modes run in child processes (--lookahead 1,2); a
    name that is no EngineConfig field, or a value not of its type, is refused by name."""
    out = tmp_path / "host_loop.json"
    r = subprocess.run([sys.executable, "-m", "bench.host_loop", "--batches", "4", "--steps", "6", "--warmup", "2",
                        "--max-model-len", "256", "--set", "max_num_seqs=2", "--lookahead", "1,2", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    modes = json.loads(out.read_text())
    assert sorted(m["lookahead"] for m in modes.values()) == [1, 2]
    assert [(row["batch"], row["tokens_per_step"]) for m in modes.values() for row in m["rows"]] == [(4, 2)] * 2
    for arg, why in (("max_num_tokens=40", ""), ("max_num_seqs=x", " (parameter 'max_num_seqs': cannot parse 'x' as int)")):
        bad = subprocess.run([sys.executable, "-m", "bench.host_loop", "--set", arg],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert bad.returncode == 2, bad.stderr
        assert f"'{arg}': must be FIELD=VALUE with an EngineConfig field" in bad.stderr
        assert why in bad.stderr
