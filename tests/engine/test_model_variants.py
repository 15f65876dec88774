"""Architecture variants the loader must accept (Qwen2 biases, tied / untied embeddings,
head_dim != hidden/heads, rope scaling types, Mistral), each a small random checkpoint written
here with transformers: our prefill logits and greedy tokens equal HF's on the same weights."""
import random

import pytest
import torch

from engine_helpers import forward_logits, greedy, hf_greedy, hf_logits, make_engine, random_prompt

VOCAB = 512
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6)


def _config(name):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config
    return {
        "qwen2": lambda: Qwen2Config(**COMMON, tie_word_embeddings=False),
        "qwen2-tied": lambda: Qwen2Config(**COMMON, tie_word_embeddings=True),
        "qwen3-untied-mha": lambda: Qwen3Config(**dict(COMMON, head_dim=16, num_key_value_heads=4),
                                                tie_word_embeddings=False),
        "llama-head_dim-32": lambda: LlamaConfig(**dict(COMMON, head_dim=32)),
        "llama-tied": lambda: LlamaConfig(**COMMON, tie_word_embeddings=True),
        "llama-rope-linear": lambda: LlamaConfig(**COMMON, rope_scaling={"rope_type": "linear", "factor": 2.0}),
        "llama-rope-yarn": lambda: LlamaConfig(**COMMON, rope_scaling={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}),
        "mistral": lambda: MistralConfig(**COMMON, sliding_window=None),
        "llama-attention_bias": lambda: LlamaConfig(**COMMON, attention_bias=True),
        "llama-mlp_bias": lambda: LlamaConfig(**COMMON, mlp_bias=True),
    }[name]()


VARIANTS = ["qwen2", "qwen2-tied", "qwen3-untied-mha", "llama-head_dim-32", "llama-tied",
            "llama-rope-linear", "llama-rope-yarn", "mistral", "llama-attention_bias", "llama-mlp_bias"]


def _write(name, out_dir, seed=0):
    from transformers import AutoModelForCausalLM, GenerationConfig
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(name)).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:  # biases random too, so a dropped bias shows
                p.normal_(0.0, 0.5 if "embed" in pname else 0.08)
    model.save_pretrained(str(out_dir))
    GenerationConfig(bos_token_id=1, eos_token_id=2).save_pretrained(str(out_dir))
    return str(out_dir)


@pytest.mark.parametrize("name", VARIANTS)
def test_variant_matches_hf(name, tmp_path):
    path = _write(name, tmp_path / name)
    rng = random.Random(0)
    prompts = [random_prompt(rng, n, VOCAB) for n in (1, 20, 300)]
    eng = make_engine(path, block_size=8)
    for p, lg in zip(prompts, forward_logits(eng, prompts)):
        ref = hf_logits(path, p)
        torch.testing.assert_close(lg, ref, rtol=1e-5, atol=1e-5 * max(ref.abs().max().item(), 1.0))
    outs = make_engine(path, max_num_batched_tokens=32, async_token_handoff="on").generate(
        prompts, greedy(12, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(path, p, 12) for p in prompts]
