"""The glue of the sampler features: logprob tensors between the engine, `llm` and the text
routes (vllm_backend's `logprobs` JSON), and n > 1 on the text routes (fan-out, joining)."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from triton_glue.inputs import SamplingFields, TextRequest
from triton_glue.logprob_tensors import (RANK_WINDOW, Logprobs, sampled_logprobs, top_logprobs, vllm_logprobs_json)
from triton_glue.sequences import SequenceJoiner, fan_out
from triton_glue.bls import Chunk

sys.path.insert(0, str(Path(__file__).parent))
from pb_fakes import RecordingSender  # noqa: E402


def engine_dict(sampled, lp, top):
    """The engine's shape (backend_lib TokenLogprobs.as_dict): sampled first, then the top."""
    d = {sampled: lp}
    for t, v in top:
        d.setdefault(t, v)
    return d


def test_ranks_and_top_from_the_engine_dicts():
    top = [(10 + i, -0.1 * (i + 1)) for i in range(RANK_WINDOW)]
    in_top = engine_dict(12, -0.3, top)          # the 3rd likeliest
    greedy = engine_dict(10, -0.1, top)
    outside = engine_dict(99, -9.0, top)         # beyond the top 20
    ids, vals, ranks = top_logprobs([12, 10, 99], [in_top, greedy, outside], 2)
    assert ranks.tolist() == [[3, 1, RANK_WINDOW + 1]]
    assert ids.tolist() == [[[10, 11], [10, 11], [10, 11]]]
    assert np.allclose(vals, [[[-0.1, -0.2]] * 3])
    assert sampled_logprobs([12, 10, 99], [in_top, greedy, outside]).tolist() == \
        [[[pytest.approx(-0.3), pytest.approx(-0.1), -9.0]]]
    # a vocabulary smaller than N: padded
    ids, vals, _ = top_logprobs([1], [{1: -0.5, 0: -1.0}], 3)
    assert ids.tolist() == [[[1, 0, -1]]] and np.isneginf(vals[0, 0, 2])


def test_vllm_backend_logprobs_format():
    lp = Logprobs([5, 7], [-0.25, -1.5], [1, 2], [[5, 7], [3, 7]], [[-0.25, -2.0], [-0.5, -1.5]], -1.75)
    entries = lp.vllm_entries(lambda t: f"<{t}>")
    # vllm_backend's JSON: keys are the token ids (strings after json), 3 fields each, the
    # sampled token first; a top entry equal to the sampled one is not repeated
    got = json.loads(vllm_logprobs_json(entries))
    assert got == [{"5": {"logprob": -0.25, "rank": 1, "decoded_token": "<5>"},
                    "7": {"logprob": -2.0, "rank": 2, "decoded_token": "<7>"}},
                   {"7": {"logprob": -1.5, "rank": 2, "decoded_token": "<7>"},
                    "3": {"logprob": -0.5, "rank": 1, "decoded_token": "<3>"}}]
    assert vllm_logprobs_json(None) == b"null"
    # from llm's tensors, in pieces
    acc = Logprobs()
    acc.extend(Logprobs.from_outputs([5], {"output_log_probs": np.array([[[-0.25]]], np.float32),
                                          "cum_log_probs": np.array([[-0.25]], np.float32),
                                          "output_log_prob_ranks": np.array([[1]], np.int32)}.get))
    acc.extend(Logprobs.from_outputs([], {}.get))
    assert (acc.token_ids, acc.sampled, acc.ranks, acc.cumulative) == ([5], [-0.25], [1], -0.25)


def test_fan_out_derives_seeds_as_the_engine_does():
    req = TextRequest("hi", SamplingFields(n=3, seed=2**63 - 2))
    seqs = fan_out(req)
    assert [(s.sampling.n, s.sampling.seed, s.sequence_index, s.num_sequences) for s in seqs] == \
        [(1, 2**63 - 2, 0, 3), (1, 2**63 - 1, 1, 3), (1, 0, 2, 3)]
    assert fan_out(TextRequest("hi", SamplingFields())) == [TextRequest("hi", SamplingFields())]
    assert all(s.sampling.seed is None for s in fan_out(TextRequest("hi", SamplingFields(n=2))))


class _Pb:
    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1


def _chunk(text, final, reason=None):
    return Chunk(text, len(text), reason, 2, final)


@pytest.mark.parametrize("stream", [True, False])
def test_joiner_puts_n_sequences_in_every_response(stream):
    sender = RecordingSender()
    j = SequenceJoiner(_Pb, sender, 2, stream, lambda chunks, fins: ([c.text if c else "" for c in chunks], fins))
    a, b = j.sequence(), j.sequence()
    a.send((0, _chunk("x", False)))
    b.send((1, _chunk("y", True, "length")), flags=1)
    a.send((0, _chunk("z", True, "stop")), flags=1)
    a.send((0, _chunk("late", True, "stop")), flags=1)  # nothing after FINAL
    if stream:
        assert sender.sent == [((["x", ""], [None, None]), 0), ((["", "y"], [None, "length"]), 0),
                               ((["z", ""], ["stop", "length"]), 1)]
    else:
        assert sender.sent == [((["z", "y"], ["stop", "length"]), 1)]
    assert j.is_cancelled()  # closed: the other drivers stop


def test_joiner_ends_on_the_first_error():
    sender = RecordingSender()
    j = SequenceJoiner(_Pb, sender, 3, True, lambda chunks, fins: "resp")
    s = [j.sequence() for _ in range(3)]
    s[1].send("error response", flags=1)
    s[0].send((0, _chunk("x", True, "stop")), flags=1)
    assert sender.sent == [("error response", 1)]
