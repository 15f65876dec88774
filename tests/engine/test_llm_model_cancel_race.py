"""The `llm` model (model_repository/llm/1/model.py) on the engine process, without Triton: a
stand-in triton_python_backend_utils, requests and response senders. A cancellation (or an
unload's abort-all) that lands while execute is still adding the request must still end it
early: the abort must not reach the engine before the request does (and be lost). One execute()
call's requests reach the engine in one message."""
import importlib.util
import json
import sys
import threading
import time
from pathlib import Path

import pytest

from llm_model_fakes import Request, Sender, fake_pb_utils
from test_async_engine import KW

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def llm_model(path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("TRITON_HTTP_PORT", raising=False)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake_pb_utils())
    spec = importlib.util.spec_from_file_location("llm_model_under_test", ROOT / "model_repository/llm/1/model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    params = dict(KW, model_path=path, cancel_poll_ms=5, engine_process="on")
    cfg = {"name": "llm", "parameters": {k: {"string_value": str(v)} for k, v in params.items()}}
    m = mod.TritonPythonModel()
    m.initialize({"model_config": json.dumps(cfg), "model_name": "llm", "model_version": "1",
                  "model_instance_name": "llm_0", "model_repository": str(ROOT / "model_repository/llm")})
    yield m
    m.finalize()


def _slow_adds(m, seconds):
    """add_request takes `seconds` before it reaches the engine (a long prompt's checks and
    transfer, or the earlier rows of a batch request)."""
    real = m.engine.add_request

    def slow(*a, **kw):
        time.sleep(seconds)
        return real(*a, **kw)

    m.engine.add_request = slow


def _long_request(sender):
    return Request({"input_ids": [[5, 6, 7]], "request_output_len": [[400]], "streaming": [[True]]}, sender)


def test_cancel_seen_while_the_request_is_being_added_still_aborts_it(llm_model):
    _slow_adds(llm_model, 0.3)
    sender = Sender(cancelled=True)  # the client gave up at once: the first poll sees it
    llm_model.execute([_long_request(sender)])
    assert sender.done.wait(60)
    assert sender.finals == 1 and sender.responses[-1].error.code == "CANCELLED"
    assert sender.tokens() < 100, f"the cancelled request ran on ({sender.tokens()} tokens streamed)"


def test_unload_abort_while_a_request_is_being_added_still_aborts_it(llm_model):
    _slow_adds(llm_model, 0.3)
    sender = Sender()
    t = threading.Thread(target=llm_model.execute, args=([_long_request(sender)],))
    t.start()
    time.sleep(0.1)  # execute is adding the request
    llm_model._stop_serving("unload requested")
    t.join(10)
    assert sender.done.wait(60)
    assert sender.finals == 1
    assert sender.tokens() < 100, f"the request ran on past the unload's abort ({sender.tokens()} tokens)"


def test_a_batch_row_the_engine_refuses_ends_the_request_with_its_reason(llm_model):
    """A [B, ...] request whose row 2 the engine refuses after rows 0-1 were added (e.g. it
    stopped being healthy meanwhile): the rows in the engine are aborted and the one FINAL
    response carries the refusal's message, not a 'request cancelled' the client never asked for."""
    real = llm_model.engine.add_request
    calls = []

    def refuse_third(*a, **kw):
        calls.append(a[0])
        if len(calls) == 3:
            raise RuntimeError("engine is not healthy: stand-in refusal")
        return real(*a, **kw)

    llm_model.engine.add_request = refuse_third
    sender = Sender()
    llm_model.execute([Request({"input_ids": [[5, 6, 7], [8, 9, 10], [11, 12, 13]],
                                "input_lengths": [[3], [3], [3]], "request_output_len": [[400], [400], [400]],
                                "streaming": [[True], [True], [True]]}, sender)])
    assert sender.done.wait(60)
    assert len(calls) == 3 and sender.finals == 1
    err = sender.responses[-1].error
    assert err is not None and "batch row 2" in err.message and "stand-in refusal" in err.message, err.message
    assert err.code != "CANCELLED"
    assert sender.tokens() < 300


def test_one_execute_reaches_the_engine_as_one_message(llm_model):
    """Six requests in one execute() (Triton's dynamic batch): one write to the engine core,
    holding their six ADDs, and each request streams its tokens and one FINAL."""
    writes = []
    real_send = llm_model.engine._send

    def counting_send(cmds, timeout=None):
        writes.append([c[0] for c in cmds])
        return real_send(cmds, timeout)

    llm_model.engine._send = counting_send
    senders = [Sender() for _ in range(6)]
    llm_model.execute([Request({"input_ids": [[5 + i, 6, 7]], "request_output_len": [[8]], "streaming": [[True]],
                                "ignore_eos": [[True]]}, s) for i, s in enumerate(senders)])
    assert writes[0] == ["add"] * 6
    for s in senders:
        assert s.done.wait(60)
        assert s.finals == 1 and s.tokens() == 8


def test_a_bls_cancel_that_overtakes_its_request_aborts_it_on_arrival(llm_model):
    """A BLS caller (the tensorrt_llm proxy's stop, a deadline) can send its cancel while its
    exec() is still delivering the request: the cancel, for a key llm has not seen yet, must
    not be lost."""
    control = Sender()
    llm_model.execute([Request({"cancel_request_id": [["bls-early"]]}, control, "bls-early-cancel")])
    assert control.done.wait(10) and control.finals == 1
    sender = Sender()
    llm_model.execute([Request({"input_ids": [[5, 6, 7]], "request_output_len": [[400]], "streaming": [[True]]},
                               sender, "bls-early")])
    assert sender.done.wait(60)
    assert sender.finals == 1 and sender.tokens() < 100, f"ran on ({sender.tokens()} tokens streamed)"
    # a later request under another key runs to its end
    other = Sender()
    llm_model.execute([Request({"input_ids": [[5, 6, 7]], "request_output_len": [[20]], "streaming": [[True]]},
                               other, "bls-later")])
    assert other.done.wait(60) and other.tokens() == 20
