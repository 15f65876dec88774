"""HF transformers on the tiny checkpoint the server runs: the reference for log probabilities
(vLLM V1's raw logprobs are log_softmax of the model's logits)."""
from __future__ import annotations

import pytest
import torch

from .conftest import MODEL_DIR


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32).eval()


def _logprobs(hf, prompt, gen):
    with torch.no_grad():
        logits = hf(torch.tensor([list(prompt) + list(gen)])).logits[0].double()
    return torch.log_softmax(logits, dim=-1)


def hf_logprobs(hf, prompt, gen):
    """log_softmax of HF's logits at each generated position, of the generated token."""
    lp = _logprobs(hf, prompt, gen)
    return [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(gen)]


def hf_top(hf, prompt, gen, k):
    """(values, ids) of the top-k logprobs at each generated position."""
    lp = _logprobs(hf, prompt, gen)
    return [lp[len(prompt) - 1 + i].topk(k) for i in range(len(gen))]


def hf_ranks(hf, prompt, gen):
    """vLLM's rank of each generated token: how many tokens have a logprob >= its own."""
    lp = _logprobs(hf, prompt, gen)
    return [int((lp[len(prompt) - 1 + i] >= lp[len(prompt) - 1 + i, t]).sum()) for i, t in enumerate(gen)]
