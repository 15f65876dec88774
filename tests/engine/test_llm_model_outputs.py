"""The `llm` model sends the outputs a request asked for (Triton's requested outputs), not
every output it declares: Triton would drop the others, after the stub paid to build and send
them (bench/sender_cost.py). A request that names none gets all of them, as before."""
import pytest

from test_llm_model_cancel_race import Request, Sender, llm_model  # noqa: F401 (a fixture)


class NamingRequest(Request):
    def __init__(self, inputs, sender, outputs):
        super().__init__(inputs, sender)
        self._outputs = outputs

    def requested_output_names(self):
        return list(self._outputs)


def _run(model, request, sender):
    model.execute([request])
    assert sender.done.wait(60)
    assert sender.finals == 1
    return [r for r in sender.responses if r is not None]


INPUTS = {"input_ids": [[5, 6, 7]], "request_output_len": [[6]], "streaming": [[True]]}


@pytest.mark.parametrize("asked, expected", [
    (None, ["output_ids", "sequence_length", "prefix_ids", "finish_reason"]),
    ([], ["output_ids", "sequence_length", "prefix_ids", "finish_reason"]),
    (["output_ids"], ["output_ids"]),
    (["output_ids", "finish_reason"], ["output_ids", "finish_reason"]),
    (["output_ids", "sequence_length"], ["output_ids", "sequence_length"]),
])
def test_responses_hold_the_requested_outputs(llm_model, asked, expected):
    sender = Sender()
    req = Request(INPUTS, sender) if asked is None else NamingRequest(INPUTS, sender, asked)
    responses = _run(llm_model, req, sender)
    names = [[t.name() for t in r.output_tensors] for r in responses]
    assert all(n == expected for n in names), names
    tokens = [t for r in responses for t in r.output_tensors[0].as_numpy().reshape(-1).tolist()]
    assert len(tokens) == 6
    if "finish_reason" in expected:
        reasons = [t.as_numpy().reshape(-1)[0] for r in responses for t in r.output_tensors
                   if t.name() == "finish_reason"]
        assert reasons[-1] == b"length" and all(x == b"" for x in reasons[:-1])


def test_same_tokens_whatever_was_asked(llm_model):
    got = []
    for asked in (None, ["output_ids"]):
        sender = Sender()
        req = Request(INPUTS, sender) if asked is None else NamingRequest(INPUTS, sender, asked)
        responses = _run(llm_model, req, sender)
        got.append([t for r in responses for t in r.output_tensors[0].as_numpy().reshape(-1).tolist()])
    assert got[0] == got[1] and len(got[0]) == 6
