"""Only the engine core runs torch. Every Python stub of the shared server (the tokenizer
stubs, the BLS routes, the engine-process `llm`) is torch-free: torch would cost each one
seconds of start-up and ~250 MB, and every full garbage collection there would walk its
objects (README, "engine_process")."""
from __future__ import annotations

from . import procs
from .test_metrics_unload import engine_cores


def test_no_stub_loads_torch(server):
    stubs = procs.stubs(server.proc.pid)
    assert {p.stub_model for p in stubs} >= {"llm", "preprocessing", "postprocessing", "llm_bls", "vllm_model"}
    assert [(p.stub_model, p.pid) for p in stubs if procs.maps_library(p.pid, "libtorch")] == []
    cores = engine_cores(server)
    assert len(cores) == 1 and procs.maps_library(cores[0].pid, "libtorch_cpu")
