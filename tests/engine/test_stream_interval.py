"""stream_interval (SGLang's): a running request's tokens go out with its first token, then in
chunks of `stream_interval`, and at its end. The tokens are HF's greedy continuation either
way; a stop that fires inside a chunk ends the request at the stop with the held tokens in its
final output; an abort delivers what was held; logprobs stay one per token."""
import random

import pytest

from backend_lib import SamplingParams
from engine_helpers import EOS, Spec, expected_from_reference, hf_greedy, make_engine, random_prompt, run_specs


def _chunks(eng, rid, prompt, params):
    """The sizes of a request's outputs, and its tokens."""
    eng.add_request(rid, prompt, params)
    sizes, tokens, final = [], [], None
    while eng.has_unfinished():
        for o in eng.step():
            sizes.append(len(o.new_token_ids))
            tokens += o.new_token_ids
            assert o.num_output_tokens == len(tokens)
            if o.finished:
                final = o
    return sizes, tokens, final


@pytest.mark.parametrize("async_mode", ["on", "off"])
def test_tokens_go_out_first_then_in_chunks_then_at_the_end(tiny_llama_path, async_mode):
    path = str(tiny_llama_path)
    prompt = random_prompt(random.Random(3), 30)
    ref = hf_greedy(path, prompt, 14)
    eng = make_engine(path, stream_interval=4, async_token_handoff=async_mode)
    sizes, tokens, final = _chunks(eng, "r", prompt, SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True))
    assert tokens == ref and str(final.finish_reason) == "length"
    assert sizes == [1, 4, 4, 4, 1]
    # a stop id inside a chunk: the request ends right there, the held tokens in its final output
    stop = ref[6]
    assert ref.index(stop) == 6
    sizes, tokens, final = _chunks(eng, "s", prompt, SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True,
                                                                 stop_token_ids=[stop]))
    assert tokens == ref[:7] and str(final.finish_reason) == "stop" and sizes == [1, 4, 2]
    # logprobs: one per token, in the same chunks
    eng.add_request("l", prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert [len(o.new_token_ids) for o in outs] == [1, 4, 1]
    assert [len(o.new_logprobs) for o in outs] == [1, 4, 1]
    assert [t for o in outs for t in o.new_token_ids] == ref[:6]
    assert all(t in lp for o in outs for t, lp in zip(o.new_token_ids, o.new_logprobs))


def test_a_workload_with_stops_aborts_and_preemption_equals_hf(tiny_llama_path):
    """Staggered arrivals, EOS and stop ids that fire mid-chunk, aborts while tokens are held,
    a pool small enough to preempt: every finished request is HF's continuation cut at its
    stop, every aborted one a prefix of it with all its generated tokens delivered."""
    path = str(tiny_llama_path)
    rng = random.Random(41)
    specs, refs = [], {}
    for i in range(24):
        prompt = random_prompt(rng, rng.randint(3, 60))
        max_tokens = rng.randint(1, 24)
        refs[f"q{i}"] = hf_greedy(path, prompt, max_tokens)
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=rng.random() < 0.5)
        toks = refs[f"q{i}"]
        if len(toks) > 3 and rng.random() < 0.4:
            k = rng.randrange(1, len(toks))
            if toks.index(toks[k]) == k:
                sp.stop_token_ids = [toks[k]]
        spec = Spec(f"q{i}", prompt, sp, arrival=rng.choice([0, 0, 1, 2, 5]))
        if rng.random() < 0.25:
            spec.abort_after_tokens = rng.randint(1, 6)
        specs.append(spec)
    eng = make_engine(path, stream_interval=3, async_token_handoff="on", num_kv_blocks=12, max_model_len=128,
                      block_size=16, max_num_seqs=8,
                      max_num_batched_tokens=64)
    info = run_specs(eng, specs, order_rng=random.Random(5))
    aborted = 0
    for s in specs:
        r = info.results[s.rid]
        if r.finish_reason == "abort":
            aborted += 1
            assert r.tokens == refs[s.rid][:len(r.tokens)] and len(r.tokens) >= s.abort_after_tokens
            continue
        exp, reason = expected_from_reference(refs[s.rid], s.params, eos_ids=(EOS,))
        assert (r.tokens, r.finish_reason) == (exp, reason), s.rid
        # outputs: the first token, then one per 3, then the end's
        assert r.num_outputs == (1 + (len(exp) - 1 + 2) // 3 if len(exp) > 1 else 1), (s.rid, r.num_outputs, len(exp))
    assert aborted >= 2 and info.stats.num_preemptions >= 1
    assert not eng.scheduler.requests


def test_stream_interval_is_validated():
    from backend_lib import EngineConfig
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=r"EngineConfig.stream_interval: must be an integer >= 1"):
            EngineConfig(stream_interval=bad)
