"""Penalties, min_p, logprobs and n > 1 (issue 14) against HF references.

- repetition_penalty: HF's own RepetitionPenaltyLogitsProcessor inside `generate`;
  presence/frequency: a processor written from the OpenAI/vLLM formula (HF has none).
- seeded runs: HF's logits + those processors + HF's warpers, drawn with the engine's
  documented noise (Gumbel-max keyed by (seed, position), sampler.py).
- logprobs: log_softmax of HF's logits at every generated position (vLLM V1's raw logprobs).
- min_p kept set: HF's MinPLogitsWarper.
- async == sync, tokens and logprobs, with penalties under churn (aborts, preemption).
"""
import math
import random

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from backend_lib import SamplingParams
from backend_lib.layers.sampler import gumbel_noise, kept_mask, row_keys
from engine_helpers import Spec, hf_logits, hf_model, make_engine, random_prompt, run_specs
from test_blocks import check_block_invariants


class PresenceFrequency(LogitsProcessor):
    """OpenAI's formula over the generated tokens: logit -= frequency * count + presence * (count > 0)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        out = input_ids[:, self.prompt_len:]
        counts = torch.zeros_like(scores).scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def _processors(prompt_len, sp):
    procs = LogitsProcessorList()
    if sp.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(sp.repetition_penalty))
    if sp.presence_penalty or sp.frequency_penalty:
        procs.append(PresenceFrequency(prompt_len, sp.presence_penalty, sp.frequency_penalty))
    return procs


def _prompts(n, seed, lo=3, hi=40):
    rng = random.Random(seed)
    return [random_prompt(rng, rng.randint(lo, hi)) for _ in range(n)]


PENALTIES = [
    dict(repetition_penalty=1.3),
    dict(repetition_penalty=0.7),
    dict(presence_penalty=1.5),
    dict(frequency_penalty=2.0),
    dict(presence_penalty=-1.0, frequency_penalty=0.8),
    dict(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=1.0),
]


@pytest.mark.parametrize("async_mode", ["off", "on"])
def test_greedy_penalties_match_hf_generate(path, async_mode):
    eng = make_engine(path, async_token_handoff=async_mode, max_num_batched_tokens=32)
    prompts = _prompts(4, seed=1)
    plain = [o.token_ids for o in eng.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0,
                                                                      ignore_eos=True))]
    changed = 0
    for pen in PENALTIES:
        sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, **pen)
        outs = eng.generate(prompts, sp)
        for p, o, base in zip(prompts, outs, plain):
            with torch.inference_mode():
                ref = hf_model(path).generate(torch.tensor([p]), max_new_tokens=24, do_sample=False,
                                              eos_token_id=None, pad_token_id=3,
                                              logits_processor=_processors(len(p), sp))[0, len(p):].tolist()
            # HF applies its repetition_penalty argument itself; ours goes through the list.
            assert o.token_ids == ref, pen
            changed += o.token_ids != base
    assert changed >= 8, changed  # the penalties really change what greedy says
    assert eng.stats().kv_blocks_used == 0


def _reference_sampled(path, prompt, sp, n):
    """HF logits -> HF repetition processor + the presence/frequency formula -> HF's
    temperature/top-k/top-p/min-p warpers -> Gumbel-max with the engine's noise."""
    ids = list(prompt)
    procs = _processors(len(prompt), sp)
    warpers = [TemperatureLogitsWarper(sp.temperature)]
    if sp.top_k > 0:
        warpers.append(TopKLogitsWarper(sp.top_k))
    if sp.top_p < 1.0:
        warpers.append(TopPLogitsWarper(sp.top_p))
    if sp.min_p > 0:
        warpers.append(MinPLogitsWarper(sp.min_p))
    for _ in range(n):
        x = hf_logits(path, ids)[-1:].clone()
        x = procs(torch.tensor([ids]), x)
        for w in warpers:
            x = w(None, x)
        key = row_keys(torch.tensor([sp.seed]), torch.tensor([len(ids)]))
        score = torch.where(torch.isfinite(x), x + gumbel_noise(key, x.shape[1]), float("-inf"))
        ids.append(int(score.argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("async_mode", ["off", "on"])
def test_seeded_penalties_match_the_reference(path, async_mode):
    eng = make_engine(path, async_token_handoff=async_mode, max_num_batched_tokens=16)
    prompts = _prompts(3, seed=2)
    cases = [dict(temperature=1.5, **PENALTIES[0]), dict(temperature=2.0, top_k=50, **PENALTIES[5]),
             dict(temperature=1.8, top_p=0.95, **PENALTIES[4]), dict(temperature=2.5, min_p=0.05, **PENALTIES[3])]
    for i, case in enumerate(cases):
        params = [SamplingParams(max_tokens=12, seed=1000 * i + j, ignore_eos=True, **case)
                  for j in range(len(prompts))]
        outs = eng.generate(prompts, params)
        for p, sp, o in zip(prompts, params, outs):
            assert o.token_ids == _reference_sampled(path, p, sp, 12), case


@pytest.mark.parametrize("async_mode", ["off", "on"])
def test_logprobs_are_log_softmax_of_hf_logits(path, async_mode):
    eng = make_engine(path, async_token_handoff=async_mode, max_num_batched_tokens=16)
    prompts = _prompts(4, seed=3)
    for sp in (SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=5),
               SamplingParams(max_tokens=20, temperature=1.7, seed=9, ignore_eos=True, logprobs=0,
                              repetition_penalty=1.4, frequency_penalty=0.5),
               SamplingParams(max_tokens=20, temperature=2.0, top_p=0.9, seed=4, ignore_eos=True, logprobs=20)):
        outs = eng.generate(prompts, sp)
        for p, o in zip(prompts, outs):
            assert len(o.logprobs) == len(o.token_ids) == 20
            lsm = torch.log_softmax(hf_logits(path, p + o.token_ids).double(), -1)
            total = 0.0
            for j, (tok, lp) in enumerate(zip(o.token_ids, o.logprobs)):
                ref = lsm[len(p) - 1 + j]
                assert tok in lp and abs(lp[tok] - ref[tok].item()) < 1e-4
                total += lp[tok]
                top = ref.topk(sp.logprobs).indices.tolist() if sp.logprobs else []
                assert len(lp) in (sp.logprobs, sp.logprobs + 1) and set(top) | {tok} == set(lp), (j, lp, top)
                for tid, v in lp.items():
                    assert abs(v - ref[tid].item()) < 1e-4
            assert math.isclose(o.cumulative_logprob, total, rel_tol=1e-9, abs_tol=1e-9)
    # Without logprobs: none.
    o = eng.generate([prompts[0]], SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert o.logprobs is None and o.cumulative_logprob is None


def test_min_p_keeps_the_same_tokens_as_hf_warper():
    g = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    for _ in range(60):
        logits = torch.randn(1, 64, generator=g) * rng.choice([0.5, 2.0, 6.0])
        temp, mp = rng.choice([0.3, 0.7, 1.0, 1.8]), rng.choice([0.01, 0.05, 0.1, 0.3, 0.9, 1.0])
        ours = kept_mask(logits / temp, torch.tensor([-1]), torch.tensor([1.0]), torch.tensor([mp]))
        hf = MinPLogitsWarper(mp)(None, TemperatureLogitsWarper(temp)(None, logits.clone()))
        assert torch.equal(ours, torch.isfinite(hf)), (temp, mp)


def test_n_gives_distinct_reproducible_sequences(eng, path):
    prompt = _prompts(1, seed=5)[0]
    sp = SamplingParams(max_tokens=16, temperature=1.0, seed=77, n=4, ignore_eos=True, logprobs=1)
    outs = eng.generate([prompt], sp)
    assert [o.index for o in outs] == [0, 1, 2, 3]
    seqs = [tuple(o.token_ids) for o in outs]
    assert len(set(seqs)) == 4 and all(len(s) == 16 for s in seqs)
    again = eng.generate([prompt, prompt], [sp, SamplingParams(max_tokens=5, temperature=0.0)])
    assert [tuple(o.token_ids) for o in again[:4]] == seqs
    for a, b in zip(again[:4], outs):  # another batch: equal up to the GEMMs' last bits
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-4 for t in x)
    # Each sequence is the n=1 request with seed + index (vLLM's derivation).
    for i, s in enumerate(seqs):
        one = eng.generate([prompt], SamplingParams(max_tokens=16, temperature=1.0, seed=77 + i, ignore_eos=True))
        assert tuple(one[0].token_ids) == s
    assert eng.stats().kv_blocks_used == 0


def test_n_streams_each_index_and_finishes_once(path):
    eng = make_engine(path, async_token_handoff="on", max_num_batched_tokens=16)
    prompt = _prompts(1, seed=6)[0]
    eng.add_request("par", prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=3, n=3, ignore_eos=True))
    with pytest.raises(ValueError, match="request_id"):
        eng.add_request("par", prompt, SamplingParams(max_tokens=2))
    got = {i: [] for i in range(3)}
    finals = 0
    reasons = {}
    while eng.has_unfinished():
        for out in eng.step():
            assert out.request_id == "par"
            got[out.index].extend(out.new_token_ids)
            if out.finish_reason is not None:
                reasons[out.index] = str(out.finish_reason)
            finals += out.finished
    assert finals == 1 and reasons == {0: "length", 1: "length", 2: "length"}
    assert all(len(v) == 6 for v in got.values())
    # Abort by the client's id ends every sequence; the last output is the only final one.
    eng.add_request("par2", prompt, SamplingParams(max_tokens=50, temperature=1.0, n=4, ignore_eos=True))
    eng.step()
    eng.step()
    assert eng.abort("par2")
    outs = []
    while eng.has_unfinished():
        outs.extend(eng.step())
    assert sum(o.finished for o in outs) == 1 and outs[-1].finished
    assert {o.index for o in outs if o.finish_reason is not None} == {0, 1, 2, 3}
    assert eng.stats().kv_blocks_used == 0 and not eng._parents


# ---- async == sync with penalties under churn ------------------------------------------------

def _churn_specs(seed, n=90):
    rng = random.Random(seed)
    specs, t = [], 0
    for i in range(n):
        t += rng.choice([0, 0, 1, 2])
        pen = rng.choice(PENALTIES)
        sampled = rng.random() < 0.5
        sp = SamplingParams(max_tokens=rng.randint(1, 40), temperature=1.3 if sampled else 0.0,
                            top_p=rng.choice([1.0, 0.9]), min_p=rng.choice([0.0, 0.02]),
                            seed=rng.randrange(2**31) if sampled else None, ignore_eos=True,
                            logprobs=rng.choice([None, 0, 3]), **pen)
        prompt = random_prompt(rng, min(200, int(math.exp(rng.uniform(0, math.log(200))))))
        specs.append(Spec(f"c{i}", prompt, sp, arrival=t))
    return specs


@pytest.mark.parametrize("budget", [4, 48])
def test_async_equals_sync_with_penalties_under_churn(path, budget):
    specs = _churn_specs(budget)
    probe = make_engine(path, max_model_len=384, max_num_batched_tokens=512, num_kv_blocks=800, max_num_seqs=64)
    outs = probe.generate([s.prompt for s in specs], [s.params for s in specs])
    ref = {s.rid: o for s, o in zip(specs, outs)}
    rng = random.Random(budget + 1)
    for s in specs:
        toks = ref[s.rid].token_ids
        if len(toks) >= 4 and rng.random() < 0.3:
            k = rng.randrange(1, len(toks) - 1)
            if toks.index(toks[k]) >= 1:
                s.params.stop_token_ids = [toks[k]]
        r = rng.random()
        if r < 0.08:
            s.abort_at = s.arrival + rng.randint(0, 20)
        elif r < 0.16 and len(toks) >= 3:
            s.abort_after_tokens = rng.randint(1, len(toks) - 1)
    runs = {}
    for mode in ("off", "on"):
        eng = make_engine(path, async_token_handoff=mode, max_num_batched_tokens=budget, max_model_len=384,
                          block_size=16, num_kv_blocks=40, max_num_seqs=24)
        runs[mode] = run_specs(eng, specs, order_rng=random.Random(budget), on_step=check_block_invariants)
        info = runs[mode]
        assert info.stats.kv_blocks_used == 0 and info.stats.num_running == 0
        if budget >= 48:
            assert info.stats.num_preemptions > 0
        for s in specs:
            res, o = info.results[s.rid], ref[s.rid]
            exp = o.token_ids
            if s.params.stop_token_ids:
                exp = exp[:exp.index(s.params.stop_token_ids[0]) + 1]
            n = len(res.tokens)
            if res.finish_reason == "abort":
                assert res.tokens == exp[:n], (mode, s.rid)
            else:
                assert res.tokens == exp, (mode, s.rid)
            if s.params.logprobs is not None:
                # The probe batches and chunks differently: its logits differ in the last bits.
                assert len(res.logprobs) == n, (mode, s.rid)
                for got, want in zip(res.logprobs, o.logprobs):
                    assert got.keys() == want.keys() and all(abs(got[t] - want[t]) < 1e-4 for t in got), \
                        (mode, s.rid, got, want)
            else:
                assert res.logprobs == []
    sync, asyn = runs["off"], runs["on"]
    assert asyn.launched_with_inflight >= 0.5 * asyn.launched
    assert sum(r.finish_reason == "abort" for r in asyn.results.values()) >= 4
    # Token-identical; logprobs identical up to float rounding: the two modes batch rows
    # differently (async schedules step n+1 before step n's tokens are known), and a row's
    # logits depend in the last bits on the GEMM's batch size (CPU and cuBLAS alike).
    worst = 0.0
    for s in specs:
        a, b = sync.results[s.rid], asyn.results[s.rid]
        if s.abort_at is None and s.abort_after_tokens is None:
            assert (a.tokens, a.finish_reason) == (b.tokens, b.finish_reason), s.rid
            assert [d.keys() for d in a.logprobs] == [d.keys() for d in b.logprobs], s.rid
            for x, y in zip(a.logprobs, b.logprobs):
                worst = max([worst] + [abs(x[t] - y[t]) for t in x])
    assert worst < 1e-4, worst


@pytest.mark.parametrize("async_mode", ["off", "on"])
def test_graph_programs_with_penalties_and_logprobs(path, async_mode):
    """Decode through the CPU stand-ins of the CUDA graphs (the full and the logprobs
    variants, static [B, C] outputs, saved-metadata reuse) = the eager program's outputs."""
    prompts = _prompts(6, seed=8)
    params = [SamplingParams(max_tokens=14, temperature=0.0 if i % 2 else 1.4, seed=i, ignore_eos=True,
                             logprobs=[None, 2, 5][i % 3], **PENALTIES[i]) for i in range(6)]
    eager = make_engine(path, async_token_handoff=async_mode).generate(prompts, params)
    eng = make_engine(path, async_token_handoff=async_mode)
    eng.runner.use_stand_in_graphs()
    graphed = eng.generate(prompts, params)
    g = eng.runner.decode_graphs
    assert g.steps_uploaded > 0 and (g.steps_reused > 0 or async_mode == "off")
    for a, b in zip(eager, graphed):
        assert a.token_ids == b.token_ids
        assert (a.logprobs is None) == (b.logprobs is None)
        for x, y in zip(a.logprobs or [], b.logprobs or []):
            assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-4 for t in x)


def test_async_engine_streams_n_and_logprobs(path):
    """AsyncEngine (what the llm model uses): one stream per client request id carrying every
    index, one final output; logprobs per token."""
    from backend_lib import AsyncEngine, EngineConfig
    aeng = AsyncEngine(EngineConfig(model_path=path, device="cpu", dtype="float32", max_model_len=256,
                                    num_kv_blocks=200, async_token_handoff="on"))
    try:
        prompt = _prompts(1, seed=9)[0]
        stream = aeng.add_request("a", prompt, SamplingParams(max_tokens=5, temperature=1.0, seed=1, n=2,
                                                              logprobs=2, ignore_eos=True))
        outs = list(stream)
        assert sum(o.finished for o in outs) == 1 and outs[-1].finished
        for i in (0, 1):
            mine = [o for o in outs if o.index == i]
            toks = [t for o in mine for t in o.new_token_ids]
            lps = [d for o in mine for d in o.new_logprobs]
            assert len(toks) == len(lps) == 5 and all(t in d for t, d in zip(toks, lps))
            assert mine[-1].cumulative_logprob == pytest.approx(sum(d[t] for t, d in zip(toks, lps)))
        with pytest.raises(ValueError, match="n must be"):
            aeng.add_request("b", prompt, SamplingParams(max_tokens=2, n=17))
    finally:
        aeng.shutdown()


def test_merged_queued_outputs_keep_each_index_and_their_logprobs():
    """The merge of queued step outputs (a lagging sender): per (request, index), tokens and
    logprobs concatenated; the ending request's final output after its other sequence's,
    both before the other requests' outputs."""
    from backend_lib import RequestOutput
    from backend_lib.delivery import DeliveryQueue
    lp = lambda t: {t: -0.5}
    q = DeliveryQueue()
    for out in (RequestOutput("r", [1], False, index=0, new_logprobs=[lp(1)]),
                RequestOutput("r", [7], False, index=1, new_logprobs=[lp(7)]),
                RequestOutput("r", [8], False, "stop", index=1, new_logprobs=[lp(8)]),
                RequestOutput("q", [5], False),
                RequestOutput("r", [2], True, "length", index=0, new_logprobs=[lp(2)])):
        q.add(out)
    got = [(o.request_id, o.index, o.new_token_ids, o.new_logprobs, o.finished) for o in q.drain()]
    assert got == [("r", 1, [7, 8], [lp(7), lp(8)], False), ("r", 0, [1, 2], [lp(1), lp(2)], True),
                   ("q", 0, [5], None, False)]


def _hf_greedy(path, prompt, sp, n):
    with torch.inference_mode():
        return hf_model(path).generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                                       eos_token_id=None, pad_token_id=3,
                                       logits_processor=_processors(len(prompt), sp))[0, len(prompt):].tolist()


@pytest.mark.parametrize("async_mode", ["off", "on"])
def test_slots_reused_between_requests_with_and_without_penalties(path, async_mode):
    """Penalty state is reset only when a request with penalties is admitted: a request
    without them that takes a slot a penalized one left (its counts and prompt set still
    there) samples as plain greedy, beside a penalized row in the same steps (so its row
    goes through the penalty pass); a penalized request that takes a used slot starts clean."""
    eng = make_engine(path, async_token_handoff=async_mode, max_num_seqs=2)
    prompts = _prompts(4, seed=5)
    pen = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, **PENALTIES[0])
    pen2 = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, **PENALTIES[2])
    plain = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    # A alone in slot 0; then C (slot 1) and B (slot 0, A's state) together; then D and E in
    # the slots B and C leave
    rounds = [[(prompts[0], pen)], [(prompts[1], pen2), (prompts[2], plain)],
              [(prompts[3], pen), (prompts[2], pen2)]]
    for batch in rounds:
        outs = eng.generate([p for p, _ in batch], [sp for _, sp in batch])
        for (p, sp), o in zip(batch, outs):
            assert o.token_ids == _hf_greedy(path, p, sp, 16), (sp, p)
    assert eng.stats().kv_blocks_used == 0
