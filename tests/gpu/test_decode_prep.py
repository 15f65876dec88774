"""GPU tests for backend_lib/layers/decode_prep.py: the one-kernel decode inputs against the
torch ops they replace (decode_inputs_torch), on random metadata with padding rows, relayed and
host-known ids, odd table widths and several block sizes; inside a CUDA graph with fresh
metadata per replay; and the decode graph's whole step with the kernel on and off.

Run: python3 -m pytest -q tests/gpu/test_decode_prep.py
Also runs on CPU under Triton's interpreter:
     TRITON_INTERPRET=1 DECODE_PREP_ON_CPU=1 python -m pytest -q tests/gpu/test_decode_prep.py
Seed: DECODE_PREP_TEST_SEED reproduces one run.
"""

import pytest

from gpu_helpers import kernel_test_target, seed_from_env, torch

_ON_CPU, pytestmark, DEVICE = kernel_test_target("DECODE_PREP_ON_CPU")

FIELDS = ("ids", "positions", "slot", "slot_mapping", "tables", "seq_lens", "samples", "relay_dst", "next_pos")


def _case(batch, pad, width, block_size, num_slots):
    """(meta, relay, block_table, scratch slot): `batch` live rows then `pad` padding rows."""
    from backend_lib.decode_graphs import DecodeMeta
    scratch = num_slots
    block_table = torch.randint(0, 5000, (num_slots + 1, width), dtype=torch.int32, device=DEVICE)
    relay = torch.randint(0, 150000, (num_slots + 1,), dtype=torch.int64, device=DEVICE)
    slots = torch.randperm(num_slots, device=DEVICE)[:batch]
    pos = torch.randint(0, width * block_size, (batch,), device=DEVICE)
    host_ids = torch.randint(0, 150000, (batch,), device=DEVICE)
    from_relay = torch.rand(batch, device=DEVICE) < 0.7
    rows = [host_ids, torch.where(from_relay, slots, -1), pos, slots, (torch.rand(batch, device=DEVICE) < 0.8).long()]
    packed = torch.stack([torch.cat([r, torch.full((pad,), fill, dtype=torch.int64, device=DEVICE)])
                          for r, fill in zip(rows, DecodeMeta.PAD)]).contiguous()
    return DecodeMeta(packed), relay, block_table, scratch


@pytest.mark.parametrize("batch,pad,width,block_size", [(1, 0, 32, 16), (3, 5, 7, 16), (64, 0, 128, 16),
                                                        (17, 15, 33, 64), (0, 4, 8, 32), (256, 0, 2, 1)])
def test_kernel_equals_the_torch_ops(batch, pad, width, block_size):
    from backend_lib.layers import decode_prep
    seed = seed_from_env("DECODE_PREP_TEST_SEED")
    meta, relay, table, scratch = _case(batch, pad, width, block_size, num_slots=max(300, batch))
    meta_ref = type(meta)(meta.packed.clone())
    got = decode_prep.decode_inputs_kernel(meta, relay, table, block_size, scratch)
    want = decode_prep.decode_inputs_torch(meta_ref, relay, table, block_size, scratch)
    for f in FIELDS:
        g, w = getattr(got, f), getattr(want, f)
        assert g.dtype == w.dtype and g.shape == w.shape, (f, g.dtype, w.dtype, g.shape, w.shape)
        assert torch.equal(g, w), (f, seed)
    # both advanced the valid rows' positions, and nothing else of the metadata
    assert torch.equal(meta.packed, meta_ref.packed), seed
    assert torch.equal(meta.pos[:batch], got.positions[:batch] + 1) and torch.equal(meta.pos[batch:], got.positions[batch:])


@pytest.mark.skipif(_ON_CPU, reason="CUDA graphs")
def test_in_a_cuda_graph_with_fresh_metadata_per_replay():
    from backend_lib.layers import decode_prep
    seed = seed_from_env("DECODE_PREP_TEST_SEED")
    meta, relay, table, scratch = _case(12, 4, 40, 16, num_slots=100)
    decode_prep.decode_inputs_kernel(type(meta)(meta.packed.clone()), relay, table, 16, scratch)  # compile
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = decode_prep.decode_inputs_kernel(meta, relay, table, 16, scratch)
    for _ in range(3):
        fresh, relay2, table2, _ = _case(12, 4, 40, 16, num_slots=100)
        meta.packed.copy_(fresh.packed)
        relay.copy_(relay2)
        table.copy_(table2)
        ref_meta = type(meta)(meta.packed.clone())
        g.replay()
        want = decode_prep.decode_inputs_torch(ref_meta, relay, table, 16, scratch)
        for f in FIELDS:
            assert torch.equal(getattr(got, f), getattr(want, f)), (f, seed)
        assert torch.equal(meta.packed, ref_meta.packed), seed


@pytest.mark.skipif(_ON_CPU, reason="a CUDA engine")
def test_greedy_decode_equal_with_the_kernel_on_and_off(tiny_llama_path):
    """The whole engine (decode graphs, async handoff, relay) gives the same tokens with the
    kernel and with the torch ops, on a batch that fills buckets unevenly."""
    from backend_lib import EngineConfig, LLMEngine, SamplingParams, envs
    prompts = [[5 + i, 6, 7, 8 + 2 * i][: 1 + i % 4] for i in range(11)]
    params = [SamplingParams(max_tokens=20 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(11)]
    got = {}
    for mode in ("on", "off"):
        with envs.overridden({envs.DECODE_PREP_ENV: mode}):
            eng = LLMEngine(EngineConfig(model_path=str(tiny_llama_path), device="cuda", dtype="float32",
                                         max_model_len=256, num_kv_blocks=200))
            got[mode] = [o.token_ids for o in eng.generate(prompts, params)]
            eng.close()
    assert got["on"] == got["off"]
    assert [len(t) for t in got["on"]] == [p.max_tokens for p in params]
