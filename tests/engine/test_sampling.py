"""Sampling semantics: seeds, top-k/top-p, max/min tokens, stops, banned ids."""
import random

import pytest

from backend_lib import SamplingParams
from engine_helpers import EOS, greedy, make_engine, random_prompt


def _prompts(n, seed=0, lo=1, hi=60):
    rng = random.Random(seed)
    return [random_prompt(rng, rng.randint(lo, hi)) for _ in range(n)]


def sampled(max_tokens=16, seed=0, **kw):
    base = dict(temperature=0.9, top_p=0.95, top_k=100, ignore_eos=True)
    base.update(kw)
    return SamplingParams(max_tokens=max_tokens, seed=seed, **base)


def test_seeded_sampling_reproducible_across_batches_and_async(path):
    prompts = _prompts(6, seed=1)
    params = [sampled(seed=100 + i) for i in range(len(prompts))]
    # Alone (one request at a time)...
    single = make_engine(path)
    alone = [single.generate([p], [sp])[0].token_ids for p, sp in zip(prompts, params)]
    # ...in one batch, in reverse order with unrelated filler requests, chunked, async on/off.
    filler = _prompts(5, seed=2)
    fparams = [sampled(seed=7 + i) for i in range(len(filler))]
    for kw in (dict(), dict(max_num_batched_tokens=8), dict(async_token_handoff="on"),
               dict(async_token_handoff="on", max_num_batched_tokens=5)):
        eng = make_engine(path, **kw)
        outs = eng.generate(filler[:2] + prompts[::-1] + filler[2:], fparams[:2] + params[::-1] + fparams[2:])
        got = [o.token_ids for o in outs[2:2 + len(prompts)]][::-1]
        assert got == alone, kw
        assert eng.stats().kv_blocks_used == 0
    # A different seed gives a different sequence (16 tokens at temperature 0.9).
    seqs = {tuple(single.generate([prompts[0]], [sampled(seed=s)])[0].token_ids) for s in range(5)}
    assert len(seqs) == 5


def test_different_seeds_differ_and_unseeded_requests_vary(eng):
    p = _prompts(1, seed=3)[0]
    outs = eng.generate([p] * 6, [sampled(seed=s) for s in range(6)])
    assert len({tuple(o.token_ids) for o in outs}) == 6
    # seed=None draws a fresh seed per request from the engine seed.
    outs = eng.generate([p] * 4, SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True))
    assert len({tuple(o.token_ids) for o in outs}) == 4


def test_top_k_1_and_tiny_top_p_equal_greedy(eng):
    prompts = _prompts(5, seed=4)
    ref = [o.token_ids for o in eng.generate(prompts, greedy(20, ignore_eos=True))]
    for sp in (SamplingParams(max_tokens=20, temperature=1.0, top_k=1, seed=5, ignore_eos=True),
               SamplingParams(max_tokens=20, temperature=2.0, top_p=1e-6, seed=6, ignore_eos=True)):
        assert [o.token_ids for o in eng.generate(prompts, sp)] == ref


def test_a_temperature_below_vllms_epsilon_is_greedy(eng):
    """vLLM samples greedily below temperature 1e-5 (_SAMPLING_EPS), whatever top-k / top-p /
    min_p say; dividing the logits by 1e-38 would overflow them to infinities instead."""
    prompts = _prompts(4, seed=9)
    ref = [o.token_ids for o in eng.generate(prompts, greedy(12, ignore_eos=True))]
    for t in (9e-6, 1e-38):
        sp = SamplingParams(max_tokens=12, temperature=t, top_p=0.5, min_p=0.2, seed=3, ignore_eos=True)
        assert [o.token_ids for o in eng.generate(prompts, sp)] == ref, t
    assert not SamplingParams(temperature=1e-5).greedy


@pytest.mark.parametrize("async_mode", ["off", "on"])
def test_max_tokens_exact_and_no_overshoot_step(path, async_mode):
    eng = make_engine(path, async_token_handoff=async_mode)
    prompts = _prompts(3, seed=5)
    for m in (1, 2, 3, 5):
        for sp in (greedy(m, ignore_eos=True), sampled(m, seed=m)):
            outs = eng.generate(prompts, sp)
            assert [len(o.token_ids) for o in outs] == [m] * 3
            assert all(o.finish_reason == "length" for o in outs)
        # One request whose prompt fits one step: exactly m steps (prefill + m-1 decodes),
        # no wasted overshoot step when the host knows the length limit.
        before = eng.stats()
        out = eng.generate([prompts[0]], greedy(m, ignore_eos=True))[0]
        after = eng.stats()
        steps = (after.sync_steps_total + after.async_steps_total) - (before.sync_steps_total + before.async_steps_total)
        assert len(out.token_ids) == m and steps == m
    assert eng.stats().kv_blocks_used == 0


@pytest.mark.parametrize("async_mode", ["off", "on"])
def test_stop_ids_and_eos_truncate_exactly(path, async_mode):
    """With a fixed seed the token sequence is fixed; a stop id (or EOS) must cut it at its
    first occurrence, inclusive, and nothing may follow it."""
    eng = make_engine(path, async_token_handoff=async_mode, max_num_batched_tokens=32)
    prompts = _prompts(8, seed=6)
    for make in (lambda i, **kw: greedy(40, **kw), lambda i, **kw: sampled(40, seed=50 + i, **kw)):
        free = [o.token_ids for o in eng.generate(prompts, [make(i, ignore_eos=True) for i in range(8)])]
        params = []
        for i, toks in enumerate(free):
            stop = [toks[5 + i]] if i % 2 == 0 else []  # mid-stream stop id on half of them
            params.append(make(i, ignore_eos=False, stop_token_ids=stop))
        outs = eng.generate(prompts, params)
        n_stop = 0
        for toks, sp, out in zip(free, params, outs):
            stops = set(sp.stop_token_ids) | {EOS}
            cut = next((j for j, t in enumerate(toks) if t in stops), None)
            if cut is None:
                assert out.token_ids == toks and out.finish_reason == "length"
            else:
                n_stop += 1
                assert out.token_ids == toks[:cut + 1] and out.finish_reason == "stop"
                assert not stops & set(out.token_ids[:-1])
        assert n_stop >= 4
    assert eng.stats().kv_blocks_used == 0


@pytest.mark.parametrize("async_mode", ["off", "on"])
def test_min_tokens_masks_eos_and_stop_ids(path, async_mode):
    eng = make_engine(path, async_token_handoff=async_mode)
    prompts = _prompts(8, seed=7)
    free = [o.token_ids for o in eng.generate(prompts, greedy(40, ignore_eos=True))]
    stop_ids = [[toks[2]] for toks in free]  # would fire at index <= 2
    for min_tokens in (4, 9):
        params = [greedy(40, min_tokens=min_tokens, stop_token_ids=s) for s in stop_ids]
        outs = eng.generate(prompts, params)
        for sp, out in zip(params, outs):
            stops = set(sp.stop_token_ids) | {EOS}
            assert not stops & set(out.token_ids[:min_tokens])
            assert len(out.token_ids) > min_tokens
            if out.finish_reason == "stop":
                assert out.token_ids[-1] in stops and not stops & set(out.token_ids[:-1])
        # Sampled too.
        params = [sampled(40, seed=i, min_tokens=min_tokens, ignore_eos=False, stop_token_ids=s)
                  for i, s in enumerate(stop_ids)]
        for sp, out in zip(params, eng.generate(prompts, params)):
            stops = set(sp.stop_token_ids) | {EOS}
            assert len(out.token_ids) > min_tokens and not stops & set(out.token_ids[:min_tokens])
    # min_tokens == max_tokens: never stops early.
    outs = eng.generate(prompts, [greedy(6, min_tokens=6, stop_token_ids=s) for s in stop_ids])
    assert all(len(o.token_ids) == 6 and o.finish_reason == "length" for o in outs)
    assert eng.stats().kv_blocks_used == 0


@pytest.mark.parametrize("async_mode", ["off", "on"])
def test_bad_token_ids_never_sampled(path, async_mode):
    eng = make_engine(path, async_token_handoff=async_mode)
    prompts = _prompts(6, seed=8)
    free = [o.token_ids for o in eng.generate(prompts, greedy(24, ignore_eos=True))]
    for make in (lambda i, bad: greedy(24, ignore_eos=True, bad_token_ids=bad),
                 lambda i, bad: sampled(24, seed=i, temperature=1.5, top_p=1.0, top_k=-1, bad_token_ids=bad)):
        params = []
        for i, toks in enumerate(free):
            params.append(make(i, sorted(set(toks))[:16]))  # ban what greedy would say
        outs = eng.generate(prompts, params)
        for sp, out in zip(params, outs):
            assert len(out.token_ids) == 24
            assert not set(sp.bad_token_ids) & set(out.token_ids)
    assert eng.stats().kv_blocks_used == 0


def test_top_k_top_p_keep_the_same_tokens_as_hf_warpers():
    import torch
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from backend_lib.layers.sampler import _top_k_top_p
    g = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    for _ in range(40):
        logits = torch.randn(1, 64, generator=g) * rng.choice([0.5, 2.0, 6.0])
        temp, k, p = rng.choice([0.3, 0.7, 1.0, 1.8]), rng.choice([-1, 1, 3, 10, 64, 100]), rng.choice([0.05, 0.5, 0.9, 1.0])
        ours = _top_k_top_p(logits / temp, torch.tensor([k]), torch.tensor([p]))
        hf = TemperatureLogitsWarper(temp)(None, logits.clone())
        if k > 0:
            hf = TopKLogitsWarper(k)(None, hf)
        if p < 1.0:
            hf = TopPLogitsWarper(p)(None, hf)
        assert torch.equal(torch.isfinite(ours), torch.isfinite(hf)), (temp, k, p)
        kept = torch.isfinite(ours)
        torch.testing.assert_close(ours[kept], hf[kept])


def test_sampler_draws_from_the_softmax_distribution():
    """Seeds 0..N-1 on the same logits: token frequencies match softmax(logits / T) restricted
    to top-k / top-p, within 4.5 sigma (deterministic: the noise is a hash of seed/position)."""
    import torch

    from backend_lib.layers.sampler import SamplingTensors, sample
    n, v = 8000, 6
    base = torch.tensor([2.0, 1.5, 1.0, 0.2, -0.5, -3.0])
    for temp, top_k, top_p, allowed in ((1.0, -1, 1.0, 6), (0.7, 3, 1.0, 3), (1.3, -1, 0.8, None)):
        logits = base.repeat(n, 1)
        st = SamplingTensors(
            temperature=torch.full((n,), temp), top_k=torch.full((n,), top_k, dtype=torch.int64),
            top_p=torch.full((n,), top_p), seed=torch.arange(n, dtype=torch.int64) * 7919 + 11,
            position=torch.full((n,), 17, dtype=torch.int64), banned_ids=torch.full((n, 1), -1, dtype=torch.int64),
            min_stop_ids=torch.full((n, 1), -1, dtype=torch.int64), min_tokens_left=torch.zeros(n, dtype=torch.int64))
        toks = sample(logits, st, all_greedy=False, use_masks=top_k > 0 or top_p < 1.0)
        probs = (base / temp).softmax(-1)
        if allowed is None:  # top-p: the smallest prefix (by probability) reaching top_p
            cum = probs.cumsum(-1) - probs
            allowed = int((cum < top_p).sum())
        probs[allowed:] = 0
        probs /= probs.sum()
        freq = torch.bincount(toks, minlength=v).double() / n
        sigma = (probs * (1 - probs) / n).sqrt().double()
        assert torch.all((freq - probs.double()).abs() <= 4.5 * sigma + 1e-12), (temp, top_k, top_p, freq, probs)


def _first_end(tokens, seqs):
    """Index of the last token of the earliest complete occurrence of any of seqs, or None."""
    for j in range(len(tokens)):
        if any(len(s) <= j + 1 and tokens[j + 1 - len(s):j + 1] == s for s in seqs):
            return j
    return None


@pytest.mark.parametrize("async_mode", ["off", "on"])
def test_stop_sequences_cut_after_the_full_sequence(path, async_mode):
    """Multi-token stop sequences (TensorRT-LLM's stop words): the request stops on the token
    that completes one, that sequence stays in the output, and a partial match never stops."""
    from engine_helpers import hf_greedy
    eng = make_engine(path, async_token_handoff=async_mode, max_num_batched_tokens=32)
    prompts = _prompts(6, seed=11)
    free = [hf_greedy(path, p, 30) for p in prompts]  # the reference: HF greedy, no stops
    params, expect = [], []
    for i, toks in enumerate(free):
        n = 2 + i % 3
        # the second sequence matches at index 3 but not at 4: a partial match
        seqs = [toks[6 + i:6 + i + n], [toks[3], (toks[4] + 1) % 768]]
        params.append(greedy(30, ignore_eos=True, stop_sequences=seqs))
        expect.append(_first_end(toks, seqs))
    outs = eng.generate(prompts, params)
    for toks, cut, out in zip(free, expect, outs):
        assert cut is not None
        assert out.token_ids == toks[:cut + 1] and out.finish_reason == "stop"
    assert eng.stats().kv_blocks_used == 0


def test_stop_sequences_limits_name_the_field(eng):
    from backend_lib.request import MAX_STOP_SEQUENCE_LEN, MAX_STOP_SEQUENCES
    for bad in ([[]], [[1] * (MAX_STOP_SEQUENCE_LEN + 1)], [[10 ** 6]], [[5]] * (MAX_STOP_SEQUENCES + 1)):
        with pytest.raises(ValueError, match="stop_sequences"):
            eng.generate([[5, 6, 7]], greedy(4, stop_sequences=bad))
    out = eng.generate([[5, 6, 7]], greedy(4, ignore_eos=True, stop_sequences=[[5] * MAX_STOP_SEQUENCE_LEN] * MAX_STOP_SEQUENCES))
    assert len(out[0].token_ids) >= 1
