"""Start-up tuning's kept picks (layers/tuning_cache.py): a second engine, or the next start,
takes the first one's picks without timing a candidate; whatever changes the kernel, the
card or the kernel's source tunes anew; a damaged or unwritable cache never stops an engine.
The timing itself needs CUDA (tests/gpu/test_decode_gemv.py): here it is replaced by a fake
that records which shapes were timed."""
from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from backend_lib import envs
from backend_lib.layers import decode_gemv as dg
from backend_lib.layers import skinny_gemm
from backend_lib.layers import tuning_cache as tc
from engine_helpers import set_env


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(envs.TUNING_CACHE_ENV, str(tmp_path / "picks"))
    monkeypatch.setattr(tc, "_loaded", {})
    return tmp_path / "picks"


def _new_process(monkeypatch):
    """What a restart sees: only the files."""
    monkeypatch.setattr(tc, "_loaded", {})


@pytest.fixture
def timed(monkeypatch):
    """Fake timing: the shapes timed, in order; each shape's winner is a candidate chosen by
    its output width (so that two shapes keep different picks), unfused for width 24."""
    log = []

    def time_candidates(reference, make_call, candidates, x, copies, what):
        log.append(what)
        n = copies[0][0].shape[0]
        times = {None: 1.0 if n == 24 else 50.0}
        times.update({c: 10.0 + i for i, c in enumerate(candidates)})
        times[candidates[n % len(candidates)]] = 5.0
        return times

    monkeypatch.setattr(skinny_gemm, "time_candidates", time_candidates)
    monkeypatch.setattr(skinny_gemm, "weight_copies", lambda w, b: [(w, b)])
    monkeypatch.setattr(dg, "compile_in_parallel", lambda calls: None)
    return log


def _cases():
    torch.manual_seed(0)
    ws = {n: torch.randn(n, 32) for n in (40, 24, 56)}
    return [(dg.ADD_RMSNORM, ws[40], None, None), (dg.PLAIN, ws[24], None, None), (dg.SILU_MUL, ws[56], None, None)]


def _table(**kw):
    return dg.DecodeGemv(num_layers=2, picks=tc.TuningCache.open("decode_gemv", torch.device("cpu"),
                                                                   dg._KERNEL_SOURCES), **kw)


def test_a_second_engine_and_a_restart_take_the_first_ones_picks(cache_dir, timed, monkeypatch):
    cases = _cases()
    first = _table()
    first.tune(cases)
    assert len(timed) == 3
    assert first.configs[dg.shape_key(dg.PLAIN, cases[1][1], None, False)] is None   # unfused won width 24
    want = dict(first.configs)
    assert sum(c is not None for c in want.values()) == 2

    second = _table()   # another engine of the same process
    second.tune(cases)
    assert len(timed) == 3 and second.configs == want and second.timings == {}

    _new_process(monkeypatch)
    [path] = list(cache_dir.iterdir())
    kept = json.loads(path.read_text())
    assert len(kept) == 3 and sum(e["pick"] == "unfused" for e in kept.values()) == 1
    third = _table()
    third.tune(cases)
    assert len(timed) == 3 and third.configs == want


def test_what_changes_the_kernel_tunes_again(cache_dir, timed, monkeypatch):
    cases = _cases()
    _table().tune(cases)
    _table(pdl=True).tune(cases)              # another kernel: launched with PDL
    assert len(timed) == 6
    _table(early_release=False).tune(cases[:1])   # the next kernel may launch only as this one exits
    assert len(timed) == 7
    monkeypatch.setenv(envs.DECODE_GEMV_SPLIT_K_ENV, "off")   # other candidates for PLAIN and SILU_MUL
    _table().tune(cases)
    assert timed[7:] == ["decode gemv " + str(dg.shape_key(p, w, b, False)) for p, w, b, _ in cases[1:]]
    bf16 = [(p, w.to(torch.bfloat16), b, h) for p, w, b, h in cases[:1]]
    _table().tune(bf16)
    assert len(timed) == 10


def test_another_card_or_kernel_source_has_a_file_of_its_own(cache_dir, timed, monkeypatch, tmp_path):
    cases = _cases()
    _table().tune(cases)
    edited = tmp_path / "decode_gemv.py"
    edited.write_text(open(dg._KERNEL_SOURCES[0]).read() + "\n# edited\n")
    monkeypatch.setattr(dg, "_KERNEL_SOURCES", (str(edited),) + dg._KERNEL_SOURCES[1:])
    _table().tune(cases)
    assert len(timed) == 6
    monkeypatch.setattr(tc, "device_tag", lambda device: "NVIDIA H200 sm90 132sms cuda12.8")
    _table().tune(cases)
    assert len(timed) == 9
    assert len(list(cache_dir.glob("decode_gemv-*.json"))) == 3


def test_a_kept_pick_this_tree_no_longer_tries_is_tuned_again(cache_dir, timed, monkeypatch):
    cases = _cases()[:1]
    _table().tune(cases)
    [path] = list(cache_dir.iterdir())
    kept = json.loads(path.read_text())
    [entry] = kept.values()
    entry["pick"] = {"block_n": 3, "block_k": 7, "num_warps": 4, "split_k": 1, "ahead": 1}
    path.write_text(json.dumps(kept))
    _new_process(monkeypatch)
    table = _table()
    table.tune(cases)
    assert len(timed) == 2 and table.configs[dg.shape_key(*cases[0][:3], False)] in dg.CANDIDATES + dg.NORM_AHEAD_CANDIDATES


def test_off_times_every_start_and_writes_nothing(cache_dir, timed, monkeypatch):
    monkeypatch.setenv(envs.TUNING_CACHE_ENV, "off")
    _table().tune(_cases())
    _table().tune(_cases())
    assert len(timed) == 6 and not cache_dir.exists()


def test_a_damaged_file_is_tuned_over_and_rewritten(cache_dir, timed, monkeypatch, caplog):
    _table().tune(_cases())
    [path] = list(cache_dir.iterdir())
    path.write_text("{ not json")
    _new_process(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="backend_lib"):
        _table().tune(_cases())
    assert len(timed) == 6 and "unreadable" in caplog.text
    assert len(json.loads(path.read_text())) == 3


def test_an_unwritable_folder_keeps_the_picks_in_memory(tmp_path, timed, monkeypatch, caplog):
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setenv(envs.TUNING_CACHE_ENV, str(blocker / "picks"))   # a folder below a file
    monkeypatch.setattr(tc, "_loaded", {})
    with caplog.at_level(logging.WARNING, logger="backend_lib"):
        _table().tune(_cases())
    assert caplog.text.count("not written") == 1   # once, not once a shape
    _table().tune(_cases())
    assert len(timed) == 3


def test_two_processes_keep_each_others_picks(cache_dir, timed, monkeypatch):
    """Both read the (empty) folder before either wrote: the second one's write keeps the first one's pick."""
    cases = _cases()
    first_process, second_process = {}, {}
    monkeypatch.setattr(tc, "_loaded", second_process)
    second = _table()
    assert second.picks.get("anything", dg.CANDIDATES) is tc.MISS   # it has read the folder
    monkeypatch.setattr(tc, "_loaded", first_process)
    _table().tune(cases[:1])
    monkeypatch.setattr(tc, "_loaded", second_process)
    second.tune(cases[1:])
    [path] = list(cache_dir.iterdir())
    assert len(json.loads(path.read_text())) == 3
    assert not list(cache_dir.glob("*.tmp"))


def test_interpreted_timings_and_unreadable_sources_keep_apart(cache_dir, timed, monkeypatch, caplog):
    _table().tune(_cases())
    monkeypatch.setenv(envs.TRITON_INTERPRET_ENV, "1")
    _table().tune(_cases())
    assert len(timed) == 6 and len(list(cache_dir.iterdir())) == 2
    monkeypatch.delenv(envs.TRITON_INTERPRET_ENV)
    monkeypatch.setattr(dg, "_KERNEL_SOURCES", dg._KERNEL_SOURCES + ("/nonexistent/kernel.py",))
    with caplog.at_level(logging.WARNING, logger="backend_lib"):
        table = _table()
    assert table.picks.path is None and "kernel sources unreadable" in caplog.text
    table.tune(_cases())
    assert len(timed) == 9


@pytest.mark.parametrize("raw,xdg,want", [
    (None, None, "~/.cache/backend_lib/tuning"), ("", None, "~/.cache/backend_lib/tuning"),
    (None, "/var/cache/u", "/var/cache/u/backend_lib/tuning"), ("off", "/var/cache/u", None), ("OFF", None, None),
    ("0", None, None), ("false", None, None), ("/srv/picks", "/var/cache/u", "/srv/picks"),
    ("~/picks", None, "~/picks"), ("rel/picks", None, os.path.abspath("rel/picks")),
    (None, "relative/cache", "~/.cache/backend_lib/tuning")])
def test_the_folder_switch(monkeypatch, raw, xdg, want):
    set_env(monkeypatch, envs.TUNING_CACHE_ENV, raw)
    set_env(monkeypatch, "XDG_CACHE_HOME", xdg)
    assert envs.tuning_cache_dir() == (None if want is None else os.path.expanduser(want))
