"""GPU tests for backend_lib/layers/greedy_argmax.py: the split argmax of all-greedy steps
against torch.argmax (ties at chunk edges and inside chunks, all -inf rows, bf16 / fp32 logits,
every row count it serves), in a CUDA graph with fresh logits, and through sampler.sample with
the switch on and off.

Run: python3 -m pytest -q tests/gpu/test_greedy_argmax.py
Also runs on CPU under Triton's interpreter (smaller vocabulary):
     TRITON_INTERPRET=1 SAMPLER_KERNELS_ON_CPU=1 python -m pytest -q tests/gpu/test_greedy_argmax.py
"""
import pytest

from gpu_helpers import kernel_test_target, seed_from_env, torch

_ON_CPU, pytestmark, DEVICE = kernel_test_target("SAMPLER_KERNELS_ON_CPU")
VOCAB = 5000 if _ON_CPU else 151936
ROW_COUNTS = [1, 3] if _ON_CPU else [1, 2, 8, 64]


def _ga():
    from backend_lib.layers import greedy_argmax
    return greedy_argmax


def _logits(rows, dtype, seed):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(rows, VOCAB, generator=g, device=DEVICE).to(dtype)
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("rows", ROW_COUNTS)
def test_matches_torch_argmax_with_ties_and_empty_rows(dtype, rows):
    ga = _ga()
    from backend_lib.layers.sampling_split import chunk_size
    seed = seed_from_env("GREEDY_ARGMAX_TEST_SEED")
    x = _logits(rows, dtype, seed)
    chunk = chunk_size(rows, VOCAB)
    # row 0: the max tied at the last index of chunk 0 and the first of chunk 1 and further on
    x[0, [chunk - 1, chunk, VOCAB - 1]] = 50.0
    if rows > 1:
        x[1] = float("-inf")                        # torch: index 0
    if rows > 2:
        x[2, [7, 9, 3 * VOCAB // 4]] = 60.0          # ties inside one chunk and across chunks
    got = ga.argmax_rows(x)
    want = x.argmax(dim=-1)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert torch.equal(got, want), (seed, got.tolist(), want.tolist())
    assert int(got[0]) == chunk - 1
    if rows > 1:
        assert int(got[1]) == 0
    if rows > 2:
        assert int(got[2]) == 7


def test_strided_rows_and_errors():
    ga = _ga()
    x = _logits(6, torch.float32, 3)
    view = x[::2]                                     # a row stride of 2 x VOCAB
    assert torch.equal(ga.argmax_rows(view), view.argmax(dim=-1))
    with pytest.raises(ValueError, match="argmax_rows: logits must be \\[rows, vocab\\] with a unit vocab stride"):
        ga.argmax_rows(x.t())
    assert not ga.pays(x.t()) and ga.pays(x) and not ga.pays(torch.empty(0, VOCAB, device=DEVICE))
    assert not ga.pays(torch.empty(ga.GREEDY_ARGMAX_MAX_ROWS + 1, 8, device=DEVICE))


def test_sampler_uses_it_by_the_switch(monkeypatch):
    from backend_lib import envs
    from backend_lib.layers import greedy_argmax, sampler
    calls = []
    real = greedy_argmax.argmax_rows
    monkeypatch.setattr(greedy_argmax, "argmax_rows", lambda t: calls.append(t.shape) or real(t))
    monkeypatch.setattr(sampler, "_use_kernels", lambda t: True)   # CUDA's choice, also on the CPU run
    x = _logits(3, torch.float32, 11)
    for mode, used in (("on", True), ("off", False)):
        monkeypatch.setenv(envs.GREEDY_ARGMAX_ENV, mode)
        calls.clear()
        assert torch.equal(sampler.sample(x.clone(), None, True, False), x.argmax(dim=-1))
        assert bool(calls) == used, mode


@pytest.mark.skipif(_ON_CPU, reason="CUDA graphs")
def test_in_a_cuda_graph_with_fresh_logits():
    ga = _ga()
    seed = seed_from_env("GREEDY_ARGMAX_TEST_SEED")
    x = _logits(2, torch.bfloat16, seed)
    ga.argmax_rows(x)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = ga.argmax_rows(x)
    for i in range(5):
        x.copy_(_logits(2, torch.bfloat16, seed + i + 1))
        g.replay()
        assert torch.equal(out, x.argmax(dim=-1)), (seed, i)
