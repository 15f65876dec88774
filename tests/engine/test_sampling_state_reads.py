"""Plain greedy steps gather none of the per-row sampling state (temperature, top-k/p, seeds,
banned and min-stop ids, min_tokens, min_p): on CUDA each gather is a kernel of every greedy
step, CUDA graphs included. Sampled and masked steps still gather it, and the tokens are
unchanged (greedy equals the HF reference elsewhere; here sampled runs repeat by seed)."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from backend_lib import SamplingParams
from engine_helpers import greedy, make_engine

TABLES = ("temperature", "top_k", "top_p", "seed", "banned", "min_stop", "min_tokens", "prompt_len", "min_p")


class _IndexReads(TorchDispatchMode):
    """Where the tensors that aten.index.Tensor (tensor[indices]) reads from start."""

    def __init__(self):
        super().__init__()
        self.read = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.index.Tensor:
            self.read.add(args[0].data_ptr())
        return func(*args, **(kwargs or {}))


def _tables_gathered(eng, prompts, params) -> set:
    storages = {getattr(eng.runner, name).data_ptr(): name for name in TABLES}
    with _IndexReads() as mode:
        outs = eng.generate(prompts, params)
    assert all(len(o.token_ids) == p.max_tokens for o, p in zip(outs, params))
    return {storages[p] for p in mode.read if p in storages}, [o.token_ids for o in outs]


def test_greedy_steps_gather_no_sampling_state(path):
    eng = make_engine(path, max_num_seqs=8, max_num_batched_tokens=64)
    eng.runner.use_stand_in_graphs()   # decode through the graph program (eagerly on CPU)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    gathered, _ = _tables_gathered(eng, prompts, [greedy(12, ignore_eos=True)] * 3)
    assert gathered == set()
    # a masked greedy row (a banned id) and sampled rows read the state, as they must
    gathered, _ = _tables_gathered(eng, prompts, [greedy(12, ignore_eos=True, bad_token_ids=[20])] * 3)
    assert {"banned", "temperature"} <= gathered
    sampled = [SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)] * 3
    gathered, first = _tables_gathered(eng, prompts, sampled)
    assert set(TABLES) - {"min_p"} <= gathered
    _, again = _tables_gathered(eng, prompts, sampled)
    assert first == again
