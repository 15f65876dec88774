"""A closed engine gives back what it holds once its last reference goes, with no garbage
collection: the engine freezes the heap it starts with (gc.freeze, for short step-loop
pauses), and the cyclic collector never looks at a frozen object again, so whatever close()
leaves in a reference cycle stays allocated for the life of the process. On CUDA that is the
weights, the KV cache and the graphs' pools: bench.decode's fifth Llama-3-8B engine found
14 GiB free on an 80 GB H100."""
from __future__ import annotations

import gc
import weakref

import pytest

from engine_helpers import greedy, make_engine


@pytest.mark.parametrize("graphs", ["stand-in graphs", "eager"])
def test_closed_engine_frees_runner_model_and_kv_cache(path, graphs):
    try:
        refs = _run_and_close(path, graphs)
        gc.collect()   # frozen objects are not looked at: only what close() released can go
        assert [name for name, ref in refs.items() if ref() is not None] == []
    finally:
        gc.unfreeze()


def _run_and_close(path, graphs) -> dict:
    """Weak references to what an engine held, once it has run, been closed and dropped."""
    eng = make_engine(path, async_token_handoff="on", cuda_graph_mixed=True)
    if graphs == "stand-in graphs":   # the decode and mixed graphs hold the runner's programs, as on CUDA
        eng.runner.use_stand_in_graphs()
        gc.freeze()   # frozen with the engine, as CUDA graphs are (captured while the engine starts)
    out = eng.generate([[5, 6, 7], [9, 10, 11, 12]], greedy(6, ignore_eos=True))
    assert [len(o.token_ids) for o in out] == [6, 6]
    held = {"engine": eng, "runner": eng.runner, "model": eng.runner.model, "scheduler": eng.scheduler,
            "k cache of layer 0": eng.runner.kv_caches[0][0], "a weight": next(eng.runner.model.parameters()),
            "decode graphs": eng.runner.decode_graphs}
    refs = {name: weakref.ref(obj) for name, obj in held.items() if obj is not None}
    eng.close()
    return refs
