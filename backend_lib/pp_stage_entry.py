"""Where a pipeline stage process (pipeline.py, spawned) starts: it arms the watch on stage 0
first, then imports the stage's code. Torch-free on purpose: a spawned process imports the
module of its target before it runs it, and importing torch takes seconds (6-10 s on a loaded
2-core box), during which a stage whose stage 0 had died would otherwise live on."""
from __future__ import annotations

from .process_lifetime import die_with_process


def stage_process_main(stage0_pid: int, *worker_args) -> None:
    # Once running, a stage sees stage 0 go through its connections; before they exist
    # (importing torch, loading the model, the 120 s rendezvous) nothing else would end it.
    die_with_process(stage0_pid, "pp-stage-watch")
    from .pipeline import worker_main

    worker_main(*worker_args)
