"""The CPU decode path (one batched SDPA over block-table-gathered KV, tail masked) equals the
per-sequence reference loop, for mixed lengths, GQA and shuffled block tables."""
import pytest
import torch

from backend_lib.layers.attention import (AttentionMetadata, reference_decode_attention,
                                          reference_paged_attention)


@pytest.mark.parametrize("hq,hkv,bs", [(8, 2, 4), (4, 4, 16), (14, 2, 8)])
def test_batched_decode_equals_the_loop(hq, hkv, bs):
    g = torch.Generator().manual_seed(hq * 100 + bs)
    nb, d = 96, 32
    kc, vc = torch.randn(nb, bs, hkv, d, generator=g), torch.randn(nb, bs, hkv, d, generator=g)
    lens = [1, bs, bs + 1, 3 * bs - 1, 7, 40]
    width = (max(lens) + bs - 1) // bs + 2
    # distinct random blocks per row; entries past a row's length hold real (wrong) block ids
    bt = torch.stack([torch.randperm(nb - 1, generator=g)[:width] + 1 for _ in lens]).to(torch.int32)
    q = torch.randn(len(lens), hq, d, generator=g)
    meta = AttentionMetadata(None, bt, torch.tensor(lens, dtype=torch.int32), None, 1, True, lens, [1] * len(lens))
    ref = reference_paged_attention(q, kc, vc, meta, d ** -0.5)
    out = reference_decode_attention(q, kc, vc, meta, d ** -0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
