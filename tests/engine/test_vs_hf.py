"""Greedy generation and prefill logits against HF transformers on the same weights."""
import functools
import random

import pytest
import torch

from engine_helpers import EOS, forward_logits, greedy, hf_greedy, hf_logits, make_engine, random_prompt

# Mixed lengths from 1 to a few hundred tokens (fixed seed: the same prompts every run).
PROMPT_LENS = (1, 3, 17, 64, 150, 300)
NEW = 24


def _prompts():
    rng = random.Random(1234)
    return [random_prompt(rng, n) for n in PROMPT_LENS]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_path(request, tiny_llama_path, tiny_qwen3_path):
    return str(tiny_llama_path if request.param == "llama" else tiny_qwen3_path)


# (engine overrides, expect preemption)
CONFIGS = {
    "chunk1-sync": (dict(max_num_batched_tokens=1), False),
    "chunk4-async": (dict(max_num_batched_tokens=4, async_token_handoff="on"), False),
    "chunk16-sync": (dict(max_num_batched_tokens=16), False),
    "chunk16-async": (dict(max_num_batched_tokens=16, async_token_handoff="on"), False),
    # 49 usable blocks of 8 tokens; the prompts alone need 67: preemption by recompute.
    "preempt-sync": (dict(max_num_batched_tokens=64, num_kv_blocks=50, block_size=8, max_model_len=384), True),
    "preempt-async": (dict(max_num_batched_tokens=64, num_kv_blocks=50, block_size=8, max_model_len=384,
                           async_token_handoff="on"), True),
    # Chunked prefill off: whole prompts in one step (the budget must cover max_model_len).
    "nochunk-async": (dict(enable_chunked_prefill=False, max_num_batched_tokens=384, num_kv_blocks=50,
                           block_size=8, max_model_len=384, async_token_handoff="on"), False),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_matches_hf_generate(model_path, name):
    overrides, preempt = CONFIGS[name]
    prompts = _prompts()
    refs = [hf_greedy(model_path, p, NEW) for p in prompts]
    eng = make_engine(model_path, **overrides)
    outs = eng.generate(prompts, greedy(NEW, ignore_eos=True))
    for p, ref, out in zip(prompts, refs, outs):
        assert out.token_ids == ref, f"prompt len {len(p)}"
        assert out.finish_reason == "length"
    st = eng.stats()
    assert st.kv_blocks_used == 0
    assert st.generation_tokens_total == NEW * len(prompts)
    if preempt:
        assert st.num_preemptions > 0
    if overrides.get("async_token_handoff") == "on":
        assert st.async_steps_total > 0 and st.sync_steps_total == 0
    else:
        assert st.sync_steps_total > 0 and st.async_steps_total == 0


@functools.lru_cache(maxsize=None)
def _eos_prompts(path, n_want=3):
    """Seeded search for prompts whose greedy continuation reaches EOS mid-stream."""
    rng = random.Random(99)
    cands = [random_prompt(rng, rng.randint(1, 40)) for _ in range(64)]
    eng = make_engine(path)
    outs = eng.generate(cands, greedy(40))
    hits = [(p, o.token_ids) for p, o in zip(cands, outs) if o.finish_reason == "stop" and len(o.token_ids) >= 3]
    misses = [p for p, o in zip(cands, outs) if o.finish_reason == "length"]
    assert len(hits) >= n_want and misses, "the tiny model should reach EOS on some random prompts"
    return tuple(p for p, _ in hits[:n_want]), tuple(misses[:2])


@pytest.mark.parametrize("async_mode", ["off", "on"])
def test_stops_at_eos_like_hf(model_path, async_mode):
    hits, misses = _eos_prompts(model_path)
    prompts = list(hits + misses)
    eng = make_engine(model_path, max_num_batched_tokens=16, async_token_handoff=async_mode)
    outs = eng.generate(prompts, greedy(40))
    for i, (p, out) in enumerate(zip(prompts, outs)):
        ref = hf_greedy(model_path, p, 40, stop_at_eos=True)
        assert out.token_ids == ref
        if i < len(hits):
            assert out.finish_reason == "stop" and out.token_ids[-1] == EOS
            assert EOS not in out.token_ids[:-1]
        else:
            assert out.finish_reason == "length" and EOS not in out.token_ids
    assert eng.stats().kv_blocks_used == 0


def test_min_tokens_like_hf_min_new_tokens(model_path):
    """min_tokens masks EOS until reached, exactly as HF's min_new_tokens does."""
    hits, _ = _eos_prompts(model_path, n_want=2)
    eng = make_engine(model_path)
    for p in hits:
        first_eos = hf_greedy(model_path, p, 40, stop_at_eos=True).index(EOS)
        for min_new in (first_eos + 1, first_eos + 5):
            ref = hf_greedy(model_path, p, 48, stop_at_eos=True, min_new=min_new)
            out = eng.generate([p], greedy(48, min_tokens=min_new))[0]
            assert out.token_ids == ref, min_new
            assert EOS not in out.token_ids[:min_new]
            assert out.finish_reason == ("stop" if ref[-1] == EOS else "length")


# ---- prefill logits ---------------------------------------------------------------------------

def test_prefill_logits_match_hf_all_positions(model_path):
    rng = random.Random(5)
    prompts = [random_prompt(rng, n) for n in (1, 9, 40, 257)]
    eng = make_engine(model_path, block_size=16)
    ours = forward_logits(eng, prompts)  # one varlen batch of four sequences
    for p, lg in zip(prompts, ours):
        ref = hf_logits(model_path, p)
        assert lg.shape == ref.shape == (len(p), eng.vocab_size)
        scale = ref.abs().max().item()
        torch.testing.assert_close(lg, ref, rtol=1e-5, atol=1e-5 * max(scale, 1.0))
        assert torch.equal(lg.argmax(-1), ref.argmax(-1))


def test_chunked_prefill_logits_match_hf(model_path):
    """A prompt prefilled in two chunks (the second reading the first's paged KV) gives the
    HF logits of the second chunk's positions."""
    rng = random.Random(6)
    p = random_prompt(rng, 100)
    eng = make_engine(model_path, block_size=8)
    forward_logits(eng, [p[:37]])
    second = forward_logits(eng, [p[37:]], starts=[37])[0]
    ref = hf_logits(model_path, p)[37:]
    torch.testing.assert_close(second, ref, rtol=1e-5, atol=1e-5 * max(ref.abs().max().item(), 1.0))


def test_sharded_checkpoint_same_tokens(tiny_llama_path, tiny_llama_sharded_path):
    from backend_lib.models.loader import safetensors_files
    assert len(safetensors_files(str(tiny_llama_sharded_path))) > 1
    prompts = _prompts()[:4]
    a = make_engine(tiny_llama_path).generate(prompts, greedy(16, ignore_eos=True))
    eng_b = make_engine(tiny_llama_sharded_path)
    b = eng_b.generate(prompts, greedy(16, ignore_eos=True))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    eng_a = make_engine(tiny_llama_path)
    for (na, pa), (nb, pb) in zip(eng_a.runner.model.named_parameters(), eng_b.runner.model.named_parameters()):
        assert na == nb and torch.equal(pa, pb), na
