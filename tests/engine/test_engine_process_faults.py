"""EngineProcessClient under faults the happy-path tests do not reach: an engine loop that dies
while its clean-up (LLMEngine.close: pipeline stages, process groups) is slow, a core that stops
reading its socket (stopped, or stuck holding its GIL), a client built on a thread that exits,
and stats() once the core is gone."""
import os
import signal
import textwrap
import threading
import time

import pytest

from backend_lib import EngineConfig, EngineProcessClient
from backend_lib.engine import EngineStats
from engine_helpers import greedy
from test_async_engine import KW, _wait


@pytest.fixture(autouse=True)
def _single_thread_core(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the core is a fresh process


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


SLOW_CLOSE = textwrap.dedent("""
    # Loaded by the engine core only (this folder is on its PYTHONPATH): LLMEngine.close() is
    # slow, as a pipeline's stage shutdown or a process group's teardown can be.
    import os, time
    import backend_lib.engine as _e
    _close = _e.LLMEngine.close
    def _slow_close(self):
        time.sleep(float(os.environ["TEST_CORE_CLOSE_DELAY_S"]))
        _close(self)
    _e.LLMEngine.close = _slow_close
""")


def test_engine_death_fails_requests_before_the_core_cleans_up(path, tmp_path, monkeypatch):
    """The loop died: every request ends with its error output at once, as in-process, not
    after the core's clean-up (which may take long, or hang)."""
    (tmp_path / "sitecustomize.py").write_text(SLOW_CLOSE)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("TEST_CORE_CLOSE_DELAY_S", "60")
    c = EngineProcessClient(EngineConfig(model_path=path, **KW), fault_after_steps=12)
    try:
        outs, done = [], threading.Event()

        def cb(out):
            outs.append(out)
            if out.finished:
                done.set()

        c.add_request("a", [5, 6, 7], greedy(400, ignore_eos=True), callback=cb)
        t0 = time.monotonic()
        assert done.wait(30), "the request got no final output while the core cleaned up"
        assert time.monotonic() - t0 < 20
        assert outs[-1].error == "engine failed: RuntimeError('injected engine fault after 12 steps')"
        assert str(outs[-1].finish_reason) == "error" and sum(o.finished for o in outs) == 1
        assert not c.is_healthy()
        with pytest.raises(RuntimeError, match="not healthy"):
            c.add_request("late", [5], greedy(3))
    finally:
        c.shutdown(timeout=5)
    assert not _alive(c.pid)
