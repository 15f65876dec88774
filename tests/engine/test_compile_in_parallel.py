"""layers/triton_support.compile_in_parallel, without a GPU: the warmups run inside Triton's
AsyncCompileMode with a pool of BACKEND_LIB_COMPILE_THREADS threads (a stand-in mode records
it here), a warmup that fails is skipped, and where nothing is gained (one thread, the
interpreter, a Triton without AsyncCompileMode) no warmup runs. The GPU side, that the launches
after it find their kernels compiled: tests/gpu/test_decode_gemv.py."""

import types

import pytest

from backend_lib import envs
from backend_lib.layers import triton_support


class _RecordingMode:
    """Triton's AsyncCompileMode as compile_in_parallel uses it: entered around the warmups."""
    entered = []

    def __init__(self, pool, *, ignore_errors=False):
        self.pool, self.ignore_errors = pool, ignore_errors

    def __enter__(self):
        _RecordingMode.entered.append(self)
        return self

    def __exit__(self, *exc):
        return False


@pytest.fixture
def fake_triton(monkeypatch):
    _RecordingMode.entered = []
    monkeypatch.setattr(triton_support, "triton", types.SimpleNamespace(AsyncCompileMode=_RecordingMode))
    monkeypatch.setattr(triton_support, "INTERPRET", False)
    return _RecordingMode


def test_warmups_run_in_the_mode_with_the_configured_pool(monkeypatch, fake_triton):
    monkeypatch.setenv(envs.COMPILE_THREADS_ENV, "3")
    ran = []

    def failing():
        ran.append("bad")
        raise RuntimeError("unsupported configuration")

    warmups = [lambda: ran.append(1), failing, lambda: ran.append(2)]
    assert triton_support.compile_in_parallel(warmups) == 2
    assert ran == [1, "bad", 2]
    (mode,) = fake_triton.entered
    assert mode.ignore_errors is True and mode.pool._max_workers == 3


@pytest.mark.parametrize("threads,interpret,has_mode", [("1", False, True), ("0", False, True),
                                                         ("4", True, True), ("4", False, False)])
def test_nothing_runs_where_nothing_is_gained(monkeypatch, fake_triton, threads, interpret, has_mode):
    monkeypatch.setenv(envs.COMPILE_THREADS_ENV, threads)
    monkeypatch.setattr(triton_support, "INTERPRET", interpret)
    if not has_mode:
        monkeypatch.setattr(triton_support, "triton", types.SimpleNamespace())
    ran = []
    assert triton_support.compile_in_parallel([lambda: ran.append(1)]) == 0
    assert ran == [] and fake_triton.entered == []


def test_the_thread_count_is_checked(monkeypatch):
    monkeypatch.delenv(envs.COMPILE_THREADS_ENV, raising=False)
    assert 1 <= envs.compile_threads() <= 16
    monkeypatch.setenv(envs.COMPILE_THREADS_ENV, "many")
    with pytest.raises(ValueError, match="BACKEND_LIB_COMPILE_THREADS='many': must be a whole number >= 0"):
        envs.compile_threads()
