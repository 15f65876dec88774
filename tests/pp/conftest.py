"""Pipeline parallelism on CPU (gloo): PP=2/3 vs PP=1 token identity over a seeded churny
workload (pp_workload.py), no object collectives on the token path, rounds with no sampled
rows, worker death -> errors (not a hang).

Stage processes are spawned, so each PP engine costs a few seconds to start: engines are
module-scoped and shared by the workloads (the chunk budget is switched on the live
scheduler between workloads; it only changes how steps are packed, never the tokens).
"""
from __future__ import annotations

import pytest

from backend_lib import LLMEngine
from pp_workload import _cfg, reference_factory


@pytest.fixture(scope="module")
def reference(tiny_llama_path):
    """The PP=1 engine's outputs of a seeded workload: reference(seed)."""
    return reference_factory(LLMEngine(_cfg(tiny_llama_path)))
