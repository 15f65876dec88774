"""GPU tests for backend_lib/layers/sampling_kernels.py: the Triton sampler and penalty
kernels against the torch definitions in sampler.py / penalties.py.

Run: python3 -m pytest -q tests/gpu/test_sampling_kernels.py
Also runs on CPU under Triton's interpreter (slow, small shapes):
     TRITON_INTERPRET=1 SAMPLER_KERNELS_ON_CPU=1 python -m pytest -q tests/gpu/test_sampling_kernels.py
Seed: SAMPLING_KERNELS_TEST_SEED reproduces one run.
"""

import pytest

from gpu_helpers import kernel_test_target, seed_from_env, torch

_ON_CPU, pytestmark, DEVICE = kernel_test_target("SAMPLER_KERNELS_ON_CPU")
VOCAB, ROWS = (1500, 8) if _ON_CPU else (151936, 64)


def _tensors(rows, temperature, top_k, top_p, min_p, seed0):
    from backend_lib.layers.sampler import SamplingTensors
    full = lambda v, dt=torch.float32: torch.as_tensor(v, dtype=dt, device=DEVICE).expand(rows).contiguous()
    return SamplingTensors(
        temperature=full(temperature), top_k=full(top_k, torch.int64), top_p=full(top_p),
        seed=torch.arange(rows, dtype=torch.int64, device=DEVICE) * 7919 + seed0,
        position=torch.full((rows,), 33, dtype=torch.int64, device=DEVICE),
        banned_ids=torch.full((rows, 1), -1, dtype=torch.int64, device=DEVICE),
        min_stop_ids=torch.full((rows, 1), -1, dtype=torch.int64, device=DEVICE),
        min_tokens_left=torch.zeros(rows, dtype=torch.int64, device=DEVICE), min_p=full(min_p))


def _logits(rows, scale):
    # Real models' rows: a long flat tail and a few strong tokens.
    x = torch.randn(rows, VOCAB, device=DEVICE) * scale
    x[:, :8] += torch.rand(rows, 8, device=DEVICE) * 4 * scale
    return x


def _scores(logits, st):
    from backend_lib.layers.sampler import gumbel_noise, row_keys
    z = logits / torch.where(st.temperature > 0, st.temperature, 1.0).unsqueeze(1)
    return z + gumbel_noise(row_keys(st.seed, st.position), logits.shape[1])


def _assert_same_draws(logits, st, use_filters, got, want):
    """Equal, except rows whose two best reference scores are a float near-tie (the kernel's
    exp/log round differently from torch's)."""
    from backend_lib.layers.sampler import kept_mask
    diff = (got != want).nonzero().flatten().tolist()
    if not diff:
        return
    z = logits / torch.where(st.temperature > 0, st.temperature, 1.0).unsqueeze(1)
    sc = _scores(logits, st)
    if use_filters:
        sc = sc.masked_fill(~kept_mask(z, st.top_k, st.top_p, st.min_p), float("-inf"))
    for r in diff:
        a, b = sc[r, want[r]].item(), sc[r, got[r]].item()
        assert abs(a - b) < 1e-3, f"row {r}: kernel {got[r].item()} (score {b}) vs reference {want[r].item()} (score {a})"
    assert len(diff) <= max(1, len(got) // 50), diff


@pytest.mark.parametrize("case", [
    dict(temperature=0.0, top_k=-1, top_p=1.0, min_p=0.0),
    dict(temperature=0.7, top_k=-1, top_p=1.0, min_p=0.0),
    dict(temperature=0.7, top_k=-1, top_p=0.9, min_p=0.0),
    dict(temperature=1.0, top_k=-1, top_p=0.5, min_p=0.0),
    dict(temperature=1.3, top_k=50, top_p=1.0, min_p=0.0),
    dict(temperature=0.9, top_k=1000, top_p=0.8, min_p=0.0),
    dict(temperature=1.0, top_k=-1, top_p=1.0, min_p=0.05),
    dict(temperature=0.8, top_k=20, top_p=0.95, min_p=0.02),
    dict(temperature=2.0, top_k=-1, top_p=0.3, min_p=0.1),
])
@pytest.mark.parametrize("scale", [0.05, 1.0, 4.0])
def test_kernel_draws_equal_the_reference(case, scale):
    from backend_lib.layers import sampling_kernels
    from backend_lib.layers.sampler import sample_reference
    seed_from_env("SAMPLING_KERNELS_TEST_SEED")
    logits = _logits(ROWS, scale)
    filters = case["top_k"] > 0 or case["top_p"] < 1 or case["min_p"] > 0
    st = _tensors(ROWS, seed0=11, **case)
    got = sampling_kernels.sample_rows_kernel(logits, st, use_filters=filters)
    want = sample_reference(logits, st, use_filters=filters)
    _assert_same_draws(logits, st, filters, got, want)


def test_mixed_rows_each_take_their_own_path():
    """One batch mixing greedy, temperature and filtered rows: each row's draw equals the one it
    gets alone (per-row programs), and the reference's."""
    from backend_lib.layers import sampling_kernels
    from backend_lib.layers.sampler import SamplingTensors, sample_reference
    seed_from_env("SAMPLING_KERNELS_TEST_SEED")
    logits = _logits(ROWS, 1.0)
    n = ROWS
    t = torch.tensor([0.0, 0.7, 1.0, 0.9] * (n // 4), device=DEVICE)
    st = SamplingTensors(
        temperature=t, top_k=torch.tensor([-1, -1, 40, 5] * (n // 4), device=DEVICE),
        top_p=torch.tensor([1.0, 1.0, 0.9, 0.7] * (n // 4), device=DEVICE),
        seed=torch.arange(n, dtype=torch.int64, device=DEVICE) + 5,
        position=torch.arange(n, dtype=torch.int64, device=DEVICE) + 100,
        banned_ids=torch.full((n, 1), -1, dtype=torch.int64, device=DEVICE),
        min_stop_ids=torch.full((n, 1), -1, dtype=torch.int64, device=DEVICE),
        min_tokens_left=torch.zeros(n, dtype=torch.int64, device=DEVICE),
        min_p=torch.tensor([0.0, 0.0, 0.0, 0.01] * (n // 4), device=DEVICE))
    got = sampling_kernels.sample_rows_kernel(logits, st, use_filters=True)
    _assert_same_draws(logits, st, True, got, sample_reference(logits, st, use_filters=True))
    for r in range(0, n, 5):
        one = SamplingTensors(*[getattr(st, f)[r:r + 1] for f in SamplingTensors.__dataclass_fields__])
        assert sampling_kernels.sample_rows_kernel(logits[r:r + 1], one, use_filters=True).item() == got[r].item()


def test_kernel_samples_the_filtered_softmax(small_scratch):
    """Many seeds on one small row: frequencies match softmax(z) on HF's kept set (4.5 sigma)."""
    from backend_lib.layers import sampling_kernels
    n = 4000 if not _ON_CPU else 200  # the interpreter runs every program of every pass in turn
    base = torch.tensor([2.0, 1.5, 1.0, 0.2, -0.5, -3.0, -3.1, -4.0], device=DEVICE)
    for temp, k, p, mp in ((1.0, -1, 1.0, 0.0), (0.7, 3, 1.0, 0.0), (1.3, -1, 0.8, 0.0), (1.0, -1, 1.0, 0.2),
                           (1.0, 4, 0.9, 0.0)):
        logits = base.repeat(n, 1)
        st = _tensors(n, temp, k, p, mp, seed0=3)
        toks = sampling_kernels.sample_rows_kernel(logits, st, use_filters=True)
        from backend_lib.layers.sampler import kept_mask
        z = base / temp
        kept = kept_mask(z.unsqueeze(0), torch.tensor([k], device=DEVICE), torch.tensor([p], device=DEVICE),
                         torch.tensor([mp], device=DEVICE))[0]
        probs = torch.where(kept, z.softmax(-1), 0.0)
        probs = (probs / probs.sum()).double().cpu()
        freq = torch.bincount(toks.cpu(), minlength=base.numel()).double() / n
        sigma = (probs * (1 - probs) / n).sqrt()
        assert torch.all((freq - probs).abs() <= 4.5 * sigma + 1e-12), (temp, k, p, mp, freq, probs)


def _penalty_tables():
    """Per-slot penalty state for ROWS rows drawn from ROWS + 3 slots; row 0 is a neutral slot
    (its logits must come out bit-identical)."""
    slots_total = ROWS + 3
    counts = torch.randint(0, 3, (slots_total, VOCAB), dtype=torch.int32, device=DEVICE)
    counts *= torch.rand(slots_total, VOCAB, device=DEVICE) < 0.01
    prompt = torch.rand(slots_total, VOCAB, device=DEVICE) < 0.01
    rep = torch.rand(slots_total, device=DEVICE) + 0.5
    pres = torch.rand(slots_total, device=DEVICE) * 4 - 2
    freq = torch.rand(slots_total, device=DEVICE) * 4 - 2
    rep[0], pres[0], freq[0] = 1.0, 0.0, 0.0
    slots = torch.randperm(slots_total, device=DEVICE)[:ROWS]
    slots[0] = 0
    return slots, counts, prompt, rep, pres, freq


def test_penalty_kernel_equals_the_reference():
    from backend_lib.layers import sampling_kernels
    from backend_lib.layers.penalties import apply_penalties_reference
    seed_from_env("SAMPLING_KERNELS_TEST_SEED")
    slots, counts, prompt, rep, pres, freq = _penalty_tables()
    logits = torch.randn(ROWS, VOCAB, device=DEVICE) * 3
    logits[:, 5] = float("-inf")
    want = apply_penalties_reference(logits.clone(), counts[slots], prompt[slots], rep[slots], pres[slots], freq[slots])
    got = sampling_kernels.apply_penalties_kernel(logits.clone(), slots, counts, prompt, rep, pres, freq)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[0], logits[0])


# ---- the split kernels (sampling_split.py) against the per-row kernels and the definition ----

def _tie_logits(rows, scale):
    """Rows with many exact ties (values on a coarse grid), -inf entries, and one row where
    only a handful of tokens are finite."""
    x = torch.round(_logits(rows, scale) * 2) / 2
    x[:, 3::7] = float("-inf")
    x[rows - 1, 5:] = float("-inf")
    x[0, 10:20] = x[0].max()        # a ten-way tie at the top
    return x


def _threshold_kept(z, top_k, top_p, min_p):
    """The kernels' kept set: sampler.kept_mask's rules, with a tie at a boundary kept whole
    (kept = z >= the boundary value; kept_mask's sort keeps an arbitrary part of it)."""
    vocab = z.shape[1]
    sz = z.sort(dim=-1, descending=True).values
    m = sz[:, :1]
    t_m = torch.where((min_p > 0).unsqueeze(1), m + torch.log(min_p.clamp(min=1e-30)).unsqueeze(1), float("-inf"))
    k_on = ((top_k > 0) & (top_k < vocab)).unsqueeze(1)
    n_m = (sz >= t_m).sum(1, keepdim=True)
    kth = torch.minimum(top_k.clamp(min=1).unsqueeze(1), n_m) - 1
    floor = torch.maximum(t_m, torch.where(k_on, sz.gather(1, kth), float("-inf")))
    in_set = sz >= floor
    e = torch.where(in_set, torch.exp(sz - m), 0.0)
    before = e.cumsum(-1) - e
    n_keep = (in_set & (before < top_p.unsqueeze(1) * e.sum(-1, keepdim=True))).sum(1, keepdim=True)
    thr_p = torch.where((top_p < 1).unsqueeze(1), sz.gather(1, (n_keep - 1).clamp(min=0)), float("-inf"))
    return z >= torch.maximum(floor, thr_p)


def _threshold_reference(logits, st):
    from backend_lib.layers.sampler import gumbel_noise, row_keys
    z = logits / torch.where(st.temperature > 0, st.temperature, 1.0).unsqueeze(1)
    score = (z + gumbel_noise(row_keys(st.seed, st.position), logits.shape[1]))
    score = score.masked_fill(~_threshold_kept(z, st.top_k, st.top_p, st.min_p), float("-inf"))
    return torch.where(st.temperature > 0, score.argmax(-1), logits.argmax(-1))


@pytest.fixture
def small_scratch(monkeypatch):
    """A small boundary buffer so that small vocabularies still take every search path
    (several rounds, and the per-row fallback when top_k or a tie exceeds it)."""
    from backend_lib.layers import sampling_split
    monkeypatch.setattr(sampling_split, "SCRATCH_SPLIT", 64 if _ON_CPU else 256)
    # ... and pivot passes chunked finer than the other passes, as on large batches.
    monkeypatch.setattr(sampling_split, "MIN_PIVOT_CHUNK", 256)


SPLIT_CASES = [
    dict(temperature=0.0, top_k=-1, top_p=1.0, min_p=0.0),
    dict(temperature=0.7, top_k=-1, top_p=1.0, min_p=0.0),
    dict(temperature=0.7, top_k=-1, top_p=0.9, min_p=0.0),
    dict(temperature=1.0, top_k=-1, top_p=1e-6, min_p=0.0),     # top_p near 0: the max only
    dict(temperature=1.0, top_k=-1, top_p=0.9999, min_p=0.0),   # near 1
    dict(temperature=1.0, top_k=1, top_p=1.0, min_p=0.0),
    dict(temperature=1.3, top_k=50, top_p=1.0, min_p=0.0),
    dict(temperature=0.9, top_k=40, top_p=0.8, min_p=0.0),
    dict(temperature=1.0, top_k=VOCAB - 1, top_p=1.0, min_p=0.0),
    dict(temperature=1.0, top_k=VOCAB + 5, top_p=0.7, min_p=0.0),  # top_k >= vocab: off
    dict(temperature=1.0, top_k=-1, top_p=1.0, min_p=0.05),
    dict(temperature=0.8, top_k=20, top_p=0.95, min_p=0.02),
    dict(temperature=2.0, top_k=-1, top_p=0.3, min_p=0.1),
]


@pytest.mark.parametrize("case", SPLIT_CASES)
@pytest.mark.parametrize("ties", [False, True])
def test_split_kernels_equal_the_definition(case, ties, small_scratch):
    """Token ids equal sample_reference's on every row (ties broken by the lowest index, as
    torch's argmax), over several seeds and logit scales, vocab not a multiple of a chunk."""
    from backend_lib.layers import sampling_split
    from backend_lib.layers.sampler import sample_reference
    seed = seed_from_env("SAMPLING_KERNELS_TEST_SEED")
    filters = case["top_k"] > 0 or case["top_p"] < 1 or case["min_p"] > 0
    assert VOCAB % sampling_split.chunk_size(ROWS, VOCAB) != 0
    for scale, seed0 in ((0.05, 1), (1.0, 2), (4.0, 3)):
        logits = (_tie_logits if ties else _logits)(ROWS, scale)
        st = _tensors(ROWS, seed0=seed0 * 1000 + 7, **case)
        got = sampling_split.sample_rows_split(logits, st, use_filters=filters)
        want = _threshold_reference(logits, st) if filters else sample_reference(logits, st, use_filters=False)
        if ties or _ON_CPU:
            # Exact: ties make scores exactly equal (the lowest index must win), no near-ties.
            assert torch.equal(got, want), (seed, scale, (got != want).nonzero().flatten().tolist())
        else:
            _assert_same_draws(logits, st, filters, got, want)


@pytest.mark.skipif(_ON_CPU, reason="the per-row kernel under the interpreter takes minutes")
@pytest.mark.parametrize("case", SPLIT_CASES)
def test_split_kernels_equal_the_row_kernels_exactly(case):
    """The same noise and the same rules as sampling_kernels' per-row programs: identical ids
    on 4 x 64 rows (only float sums are in a different order)."""
    from backend_lib.layers import sampling_kernels, sampling_split
    seed_from_env("SAMPLING_KERNELS_TEST_SEED")
    filters = case["top_k"] > 0 or case["top_p"] < 1 or case["min_p"] > 0
    for rep, scale in enumerate((0.05, 0.5, 1.0, 4.0)):
        logits = _logits(ROWS, scale)
        st = _tensors(ROWS, seed0=rep + 100, **case)
        st.position = torch.arange(ROWS, dtype=torch.int64, device=DEVICE) * 3 + rep
        got = sampling_split.sample_rows_split(logits, st, use_filters=filters)
        want = _rows_kernel(logits, st, filters)
        assert torch.equal(got, want), (scale, (got != want).nonzero().flatten().tolist())


def _rows_kernel(logits, st, filters):
    from backend_lib.layers import sampling_kernels
    old, sampling_kernels.IMPL = sampling_kernels.IMPL, "rows"
    try:
        return sampling_kernels.sample_rows_kernel(logits, st, use_filters=filters)
    finally:
        sampling_kernels.IMPL = old


def test_split_fallback_rows_equal_the_definition(small_scratch):
    """Rows the parallel search cannot resolve (top_k above the boundary buffer, a tie wider
    than it at the top) take the per-row program: still the definition's ids."""
    from backend_lib.layers import sampling_split
    seed_from_env("SAMPLING_KERNELS_TEST_SEED")
    rows = 2
    logits = _logits(rows, 1.0)
    logits[1, : sampling_split.SCRATCH_SPLIT + 10] = logits[1].max() + 1.0  # the top is one wide tie
    st = _tensors(rows, 1.0, sampling_split.SCRATCH_SPLIT + 20, 0.9, 0.0, seed0=5)
    st.top_k[1] = 3
    got = sampling_split.sample_rows_split(logits, st, use_filters=True)
    assert torch.equal(got, _threshold_reference(logits, st))


def test_mask_kernel_equals_apply_masks():
    from backend_lib.layers.sampler import apply_masks_
    from backend_lib.layers.sampling_split import apply_masks_kernel
    seed_from_env("SAMPLING_KERNELS_TEST_SEED")
    st = _tensors(ROWS, 0.7, -1, 1.0, 0.0, seed0=1)
    st.banned_ids = torch.full((ROWS, 70), -1, dtype=torch.int64, device=DEVICE)
    st.min_stop_ids = torch.full((ROWS, 3), -1, dtype=torch.int64, device=DEVICE)
    for r in range(ROWS):
        n = r * 9 % 71
        st.banned_ids[r, :n] = torch.randperm(VOCAB, device=DEVICE)[:n]
        st.min_stop_ids[r, : r % 4] = torch.tensor([2, VOCAB - 1, 7][: r % 4], device=DEVICE)
    st.min_tokens_left = torch.arange(ROWS, device=DEVICE) % 3 - 1
    logits = torch.randn(ROWS, VOCAB, device=DEVICE)
    want = apply_masks_(logits.clone(), st)
    assert torch.equal(apply_masks_kernel(logits.clone(), st), want)


def _logprobs_reference(raw, tokens, k):
    """Raw log_softmax; the top-k by value, ties to the lower index (a stable sort)."""
    lp = torch.log_softmax(raw.double(), dim=-1)
    order = torch.sort(raw, dim=-1, descending=True, stable=True).indices[:, :k]
    return lp.gather(1, tokens.unsqueeze(1)).squeeze(1), order, lp.gather(1, order)


@pytest.mark.parametrize("rows,vocab", [(1, VOCAB), (3, VOCAB), (1, 25000)] if _ON_CPU else
                         [(1, VOCAB), (64, VOCAB), (257, VOCAB), (8, 1000)])
def test_logprobs_kernel_equals_log_softmax(rows, vocab):
    """Ids exact (ties to the lower index), values within float32 rounding of log_softmax;
    vocabularies with fewer and with more blocks than MAX_LOGPROBS (the block-max floor)."""
    from backend_lib.layers.logprobs import MAX_LOGPROBS
    from backend_lib.layers.logprobs_kernels import pack_tokens_and_logprobs_kernel
    seed_from_env("SAMPLING_KERNELS_TEST_SEED")
    k = MAX_LOGPROBS
    raw = torch.randn(rows, vocab, device=DEVICE) * 3
    raw[:, :8] += 12
    raw[:, 4::9] = float("-inf")
    raw[0, 100:103] = raw[0].max() + 0.5           # a three-way tie at the top
    raw[rows - 1, 30:60] = torch.round(raw[rows - 1, 30:60])  # ties inside the top-k
    raw[rows - 1, 30:60] += raw[rows - 1].max()
    tokens = torch.randint(0, vocab, (rows,), device=DEVICE)
    tokens[0] = 4  # a -inf logit was sampled (a filter can't do that, but the math must hold)
    packed = pack_tokens_and_logprobs_kernel(raw, tokens)
    want_lp, want_ids, want_top = _logprobs_reference(raw, tokens, k)
    assert torch.equal(packed[:, 0], tokens)
    assert torch.equal(packed[:, 1:1 + k], want_ids)
    vals = packed[:, 1 + k:].contiguous().view(torch.float64)
    assert torch.isneginf(vals[0, 0])
    torch.testing.assert_close(vals[1:, 0], want_lp[1:], rtol=0, atol=2e-5)
    torch.testing.assert_close(vals[:, 1:], want_top, rtol=0, atol=2e-5)


@pytest.mark.skipif(_ON_CPU, reason="an engine on CUDA")
def test_engine_on_cuda_kernels_equal_torch_path_sync_and_async(tiny_llama_path, monkeypatch):
    """Tiny model on CUDA (graphs): penalties, min_p, top-k/top-p and logprobs through the
    Triton kernels = the torch definition on the same device; async = sync."""
    import random

    from backend_lib import EngineConfig, LLMEngine, SamplingParams
    from backend_lib.layers import sampling_kernels
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 768) for _ in range(rng.randint(3, 60))] for _ in range(24)]
    params = [SamplingParams(max_tokens=24, ignore_eos=True, seed=i, temperature=[0.0, 0.8, 1.3][i % 3],
                             top_p=[1.0, 0.9][i % 2], top_k=[-1, -1, 40][i % 3], min_p=[0.0, 0.05][i % 4 == 0],
                             repetition_penalty=[1.0, 1.3][i % 2], presence_penalty=[0.0, 0.5][i % 3 == 1],
                             frequency_penalty=[0.0, 0.4][i % 5 == 0], logprobs=[None, 3][i % 2])
              for i in range(len(prompts))]

    def run(mode):
        eng = LLMEngine(EngineConfig(model_path=str(tiny_llama_path), device="cuda", dtype="float32",
                                     max_num_seqs=32, max_model_len=256, num_kv_blocks=1024,
                                     async_token_handoff=mode))
        assert eng.runner.graphs
        return eng.generate(prompts, params)

    sync, asyn = run("off"), run("on")
    monkeypatch.setattr(sampling_kernels, "available", lambda: False)
    torch_path = run("on")
    for a, b, c in zip(sync, asyn, torch_path):
        assert a.token_ids == b.token_ids
        assert (a.logprobs is None) == (b.logprobs is None)
        for x, y in zip(a.logprobs or [], b.logprobs or []):
            assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-4 for t in x)
    same = sum(a.token_ids == c.token_ids for a, c in zip(asyn, torch_path))
    assert same >= len(prompts) - 1, same  # a float near-tie may break differently, once


# ---- model-dtype (bf16) logits: the kernels upcast in registers, as `.float()` does ----------
@pytest.mark.parametrize("case", [SPLIT_CASES[0], SPLIT_CASES[1], SPLIT_CASES[2], SPLIT_CASES[7], SPLIT_CASES[11]])
def test_split_kernels_on_bf16_logits_equal_the_definition(case, small_scratch):
    """The sampler skips the float32 copy of bf16 logits (sampler.native_logits_ok): the
    kernels upcast in registers, so ids drawn from the bf16 tensor are the definition's on its
    float32 values (on the GPU up to float near-ties: the kernels' sums may run in another order
    for another input dtype)."""
    from backend_lib.layers import sampling_split
    from backend_lib.layers.sampler import sample_reference
    seed_from_env("SAMPLING_KERNELS_TEST_SEED")
    filters = case["top_k"] > 0 or case["top_p"] < 1 or case["min_p"] > 0
    for scale, seed0 in ((0.05, 1), (1.0, 2), (4.0, 3)):
        native = _logits(ROWS, scale).to(torch.bfloat16)
        st = _tensors(ROWS, seed0=seed0 * 1000 + 7, **case)
        got = sampling_split.sample_rows_split(native, st, use_filters=filters)
        x = native.float()
        want = _threshold_reference(x, st) if filters else sample_reference(x, st, use_filters=False)
        if _ON_CPU or not filters:
            assert torch.equal(got, want), (scale, (got != want).nonzero().flatten().tolist())
        else:
            _assert_same_draws(x, st, filters, got, want)


def test_logprobs_kernel_on_bf16_equals_it_on_the_float_copy():
    """Ids exact (they depend on the values only), logprobs within float32 rounding."""
    from backend_lib.layers.logprobs import MAX_LOGPROBS
    from backend_lib.layers.logprobs_kernels import pack_tokens_and_logprobs_kernel
    seed_from_env("SAMPLING_KERNELS_TEST_SEED")
    k = MAX_LOGPROBS
    raw = (torch.randn(ROWS, VOCAB, device=DEVICE) * 3).to(torch.bfloat16)
    raw[:, 4::9] = float("-inf")
    tokens = torch.randint(0, VOCAB, (ROWS,), device=DEVICE)
    got = pack_tokens_and_logprobs_kernel(raw, tokens)
    want = pack_tokens_and_logprobs_kernel(raw.float(), tokens)
    assert torch.equal(got[:, :1 + k], want[:, :1 + k])
    gv = got[:, 1 + k:].contiguous().view(torch.float64)
    wv = want[:, 1 + k:].contiguous().view(torch.float64)
    torch.testing.assert_close(gv, wv, rtol=0, atol=2e-5)


def test_penalty_upcast_pass_equals_upcast_then_in_place():
    """penalties.upcast_apply's one pass (bf16 in, float32 out, neutral rows copied) equals
    .float() followed by the in-place penalty kernel, bit for bit."""
    from backend_lib.layers import sampling_kernels
    seed_from_env("SAMPLING_KERNELS_TEST_SEED")
    slots, counts, prompt, rep, pres, freq = _penalty_tables()
    native = (torch.randn(ROWS, VOCAB, device=DEVICE) * 3).to(torch.bfloat16)
    native[:, 5] = float("-inf")
    out = torch.full((ROWS, VOCAB), float("nan"), device=DEVICE)
    got = sampling_kernels.apply_penalties_kernel(native, slots, counts, prompt, rep, pres, freq, out=out)
    want = sampling_kernels.apply_penalties_kernel(native.float(), slots, counts, prompt, rep, pres, freq)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert torch.equal(got[0], native[0].float())


@pytest.mark.parametrize("case", [SPLIT_CASES[2], SPLIT_CASES[7], SPLIT_CASES[11]])
def test_split_kernels_read_clean_rows_from_raw(case, small_scratch):
    """penalties.upcast_apply_sparse copies only the rows something writes into (penalties,
    banned ids, stop ids masked for min_tokens) and marks them; the split kernels read the other
    rows from the bf16 logits. Ids equal the same kernels on the dense float32 copy (whose
    clean rows are the bf16 values upcast), with unwritten rows of the sparse copy poisoned
    (NaN), and with a fallback row (a tie wider than the boundary buffer) among them."""
    from backend_lib.layers import sampling_kernels, sampling_split
    from backend_lib.layers.sampler import apply_masks_
    seed_from_env("SAMPLING_KERNELS_TEST_SEED")
    slots, counts, prompt, rep, pres, freq = _penalty_tables()
    neutral = torch.arange(ROWS, device=DEVICE) % 3 != 1      # rows 1, 4 (and 7 unless its slot is 0's) keep theirs
    rep[slots[neutral]], pres[slots[neutral]], freq[slots[neutral]] = 1.0, 0.0, 0.0
    st = _tensors(ROWS, seed0=11, **case)
    st.banned_ids = torch.full((ROWS, 4), -1, dtype=torch.int64, device=DEVICE)
    st.banned_ids[2, :2] = torch.tensor([3, 9])                 # row 2: banned ids only
    st.banned_ids[0, 3] = 4                                     # row 0: an id after padding counts too
    st.min_stop_ids = torch.full((ROWS, 2), -1, dtype=torch.int64, device=DEVICE)
    st.min_stop_ids[3, 0], st.min_stop_ids[5, 0] = 0, 1         # row 3: masked stop; row 5: min_tokens reached
    st.min_tokens_left[3] = 2
    native = _logits(ROWS, 1.0).to(torch.bfloat16)
    native[6, : sampling_split.SCRATCH_SPLIT + 10] = native[6].max() + 1.0  # row 6 falls back to the row kernel
    st.top_k[6] = 3
    out = torch.full((ROWS, VOCAB), float("nan"), device=DEVICE)
    written = torch.full((ROWS,), -1, dtype=torch.int32, device=DEVICE)
    sampling_kernels.apply_penalties_kernel(native, slots, counts, prompt, rep, pres, freq, out=out,
                                            sparse_for=st, written=written)
    penalized = ((rep[slots] != 1) | (pres[slots] != 0) | (freq[slots] != 0)).tolist()
    assert written.tolist() == [int(penalized[r] or r in (0, 2, 3)) for r in range(ROWS)]
    assert 0 < sum(penalized) < ROWS and not penalized[6]
    assert torch.isnan(out[written == 0]).all()
    dense = sampling_kernels.apply_penalties_kernel(native, slots, counts, prompt, rep, pres, freq,
                                                    out=torch.empty_like(out))
    assert torch.equal(out[written == 1], dense[written == 1])
    apply_masks_(out, st)
    apply_masks_(dense, st)
    got = sampling_split.sample_rows_split(out, st, use_filters=True, clean_rows=(native, written))
    want = sampling_split.sample_rows_split(dense, st, use_filters=True)
    assert torch.equal(got, want), (got != want).nonzero().flatten().tolist()
    assert torch.equal(got, _threshold_reference(dense, st)) or not _ON_CPU


@pytest.mark.parametrize("rows,share", [(300, 0.3), (300, 0.0), (5, 1.0)])
def test_sparse_upcast_lists_exactly_the_rows_written(rows, share):
    """The sparse upcast's flags and work list over several blocks of rows (the flag kernel
    walks them 128 at a time): written[row] is 1 exactly for the rows with penalties, banned
    ids or masked stop ids, those rows come out penalized or upcast, and no other row of the
    output is touched (with no such row, none at all)."""
    from backend_lib.layers import sampling_kernels
    from backend_lib.layers.penalties import apply_penalties_reference
    seed_from_env("SAMPLING_KERNELS_TEST_SEED")
    vocab = 1000
    g = torch.Generator().manual_seed(rows)
    pick = lambda: (torch.rand(rows, generator=g) < share).to(DEVICE)
    penalized, banned, stop, left = pick(), pick(), pick(), pick()
    slots = torch.arange(rows, device=DEVICE)
    rep = torch.where(penalized, 1.3, 1.0)
    pres = torch.zeros(rows, device=DEVICE)
    freq = torch.zeros(rows, device=DEVICE)
    counts = (torch.rand(rows, vocab, generator=g) < 0.05).to(torch.int32).to(DEVICE)
    prompt = torch.zeros(rows, vocab, dtype=torch.bool, device=DEVICE)
    st = _tensors(rows, temperature=1.0, top_k=-1, top_p=0.9, min_p=0.0, seed0=3)
    st.banned_ids = torch.full((rows, 20), -1, dtype=torch.int64, device=DEVICE)
    st.banned_ids[:, 17] = torch.where(banned, 7, -1)           # past the first block of ids
    st.min_stop_ids = torch.full((rows, 2), -1, dtype=torch.int64, device=DEVICE)
    st.min_stop_ids[:, 1] = torch.where(stop, 2, -1)
    st.min_tokens_left = torch.where(left, 3, 0).to(DEVICE)
    native = (torch.randn(rows, vocab, generator=g) * 3).to(torch.bfloat16).to(DEVICE)
    out = torch.full((rows, vocab), float("nan"), device=DEVICE)
    written = torch.full((rows,), -1, dtype=torch.int32, device=DEVICE)
    sampling_kernels.apply_penalties_kernel(native, slots, counts, prompt, rep, pres, freq, out=out,
                                            sparse_for=st, written=written)
    want = penalized | banned | (stop & left)
    assert written.tolist() == want.int().tolist()
    assert torch.isnan(out[~want]).all()
    ref = native.float()
    apply_penalties_reference(ref, counts, prompt, rep, pres, freq)
    assert torch.equal(out[want], ref[want])
