"""The `llm` model lets go of a request's response sender when it sends FINAL. Kept in a
reference cycle (the request's group <-> its rows), a sender waits for the cyclic collector,
which may run only at the stub's exit, after the Python backend has unmapped the sender's
shared memory: tritonserver 2.51's stub then segfaults in libc on its way out."""
import gc
import time
import weakref

from test_llm_model_cancel_race import Request, Sender, llm_model  # noqa: F401 (a fixture)

STREAM = {"input_ids": [[5, 6, 7]], "request_output_len": [[5]], "streaming": [[True]]}
WHOLE = {"input_ids": [[5, 6, 7]], "request_output_len": [[5]], "streaming": [[False]]}
BATCH = {"input_ids": [[5, 6, 7], [8, 9, 10]], "input_lengths": [[3], [3]], "request_output_len": [[4], [4]]}


def _freed(ref, timeout=5.0):
    deadline = time.monotonic() + timeout
    while ref() is not None and time.monotonic() < deadline:  # the sending thread's frame lets go
        time.sleep(0.01)
    return ref() is None


def test_the_sender_is_freed_at_final_without_the_cyclic_collector(llm_model):
    gc.collect()
    gc.disable()
    try:
        for inputs in (STREAM, WHOLE, BATCH):
            sender = Sender()
            llm_model.execute([Request(inputs, sender)])
            assert sender.done.wait(60) and sender.finals == 1
            assert sender.tokens() > 0 and all(r.error is None for r in sender.responses if r is not None)
            ref = weakref.ref(sender)
            del sender
            assert _freed(ref), f"{sorted(inputs)}: the sender outlived its FINAL (held by a reference cycle)"
    finally:
        gc.enable()
