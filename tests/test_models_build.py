"""The tiny checkpoints from scripts/make_model.py load and behave as intended."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

ROUNDTRIP = [
    "Hello world",
    "The keeper climbed the one hundred and twelve steps.",
    "  leading spaces, tabs\tand\nnewlines\n\n",
    "café crème, Nguyễn, Dvořák, Ångström, Straße",
    "東京の電車はとても静かです。你好！안녕하세요",
    "emoji: 😀🙏🍕 family 👨‍👩‍👧 flag 🇯🇵",
    "ΑΘΗΝΑ Καλημέρα / Спасибо / שלום / مرحبا",
    "<s> in text is parsed as the special token (HF default) and decodes back. 1 + 2 = 3",
    "",
]


def _load_safetensors_dir(path) -> dict[str, torch.Tensor]:
    idx = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(idx.read_text())["weight_map"].values())) if idx.exists() else ["model.safetensors"]
    out = {}
    for f in files:
        out.update(load_file(str(path / f)))
    return out


@pytest.fixture(scope="module")
def llama_tok(tiny_llama_path):
    return AutoTokenizer.from_pretrained(str(tiny_llama_path))


def test_llama_config(tiny_llama_path, llama_tok):
    cfg = AutoConfig.from_pretrained(str(tiny_llama_path))
    assert cfg.model_type == "llama"
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size) == (256, 4, 688)
    assert cfg.num_attention_heads == 8 and cfg.num_key_value_heads == 4  # GQA
    assert cfg.max_position_embeddings == 2048
    assert cfg.tie_word_embeddings is False
    assert cfg.vocab_size == len(llama_tok)
    rope = getattr(cfg, "rope_parameters", None) or cfg.rope_scaling
    assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0
    assert rope["original_max_position_embeddings"] == 256
    # The raw file carries both the transformers-5 and the legacy (hub) spellings.
    raw = json.loads((tiny_llama_path / "config.json").read_text())
    assert raw["rope_theta"] == 10000.0 and raw["rope_scaling"]["rope_type"] == "llama3"
    assert raw["rope_parameters"]["rope_type"] == "llama3"
    gen = json.loads((tiny_llama_path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == llama_tok.eos_token_id == 2
    assert gen["bos_token_id"] == llama_tok.bos_token_id == 1
    sd = _load_safetensors_dir(tiny_llama_path)
    assert "lm_head.weight" in sd and all(t.dtype == torch.float32 for t in sd.values())


def test_qwen3_config(tiny_qwen3_path):
    cfg = AutoConfig.from_pretrained(str(tiny_qwen3_path))
    assert cfg.model_type == "qwen3"
    assert cfg.num_attention_heads == 8 and cfg.num_key_value_heads == 2
    assert cfg.head_dim == 32 and cfg.head_dim != cfg.hidden_size // cfg.num_attention_heads
    assert cfg.tie_word_embeddings is True
    sd = _load_safetensors_dir(tiny_qwen3_path)
    assert "lm_head.weight" not in sd  # tied
    assert sd["model.layers.0.self_attn.q_norm.weight"].shape == (32,)
    assert sd["model.layers.0.self_attn.k_norm.weight"].shape == (32,)
    assert sd["model.layers.0.self_attn.q_proj.weight"].shape == (8 * 32, cfg.hidden_size)
    assert sd["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 32, cfg.hidden_size)


def test_tokenizer_roundtrip_and_no_auto_bos(tiny_llama_path, tiny_qwen3_path, llama_tok):
    for s in ROUNDTRIP:
        ids = llama_tok.encode(s)
        assert llama_tok.decode(ids) == s
        if "<s>" not in s:
            assert llama_tok.bos_token_id not in ids  # no automatic bos
        assert llama_tok.eos_token_id not in ids
    # the same tokenizer in both folders
    assert (tiny_llama_path / "tokenizer.json").read_bytes() == (tiny_qwen3_path / "tokenizer.json").read_bytes()
    # multi-byte characters are split across tokens somewhere (tests UTF-8-safe streaming)
    ids = llama_tok.encode("東京 🙏 Dvořák")
    assert any("\ufffd" in llama_tok.decode([i]) for i in ids)
    assert 512 <= len(llama_tok) <= 1000
    assert llama_tok.convert_ids_to_tokens([0, 1, 2, 3]) == ["<unk>", "<s>", "</s>", "<pad>"]


def test_chat_template(tiny_llama_path, tiny_qwen3_path):
    """The default models ship a chat template (the OpenAI frontend's chat route uses it)."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    for path in (tiny_llama_path, tiny_qwen3_path):
        tok = AutoTokenizer.from_pretrained(str(path))
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert text == "<|system|>\nBe brief.</s>\n<|user|>\nHi</s>\n<|assistant|>\n"
        ids = tok.encode(text)
        assert ids.count(tok.eos_token_id) == 2 and tok.decode(ids) == text
        no_prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
        assert no_prompt == "<|system|>\nBe brief.</s>\n<|user|>\nHi</s>\n"


@pytest.mark.parametrize("name", ["tiny_llama_path", "tiny_qwen3_path"])
def test_greedy_generation_varied(name, request):
    path = request.getfixturevalue(name)
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    prompts = ["The weather in the valley", "Once upon a time", "Bread is", "Nguyễn stays 王小明 🙏",
               "In Tokyo the trains", "The machine", "Thank you", "Q: Why does the library close?"]
    # one left-padded batch: 64 decode steps instead of 8 x 64
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=64, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    conts = []
    for row in out[:, enc["input_ids"].shape[1]:].tolist():
        if tok.eos_token_id in row:
            row = row[: row.index(tok.eos_token_id) + 1]
        conts.append(row)
    assert len({tuple(c) for c in conts[:4]}) >= 2
    # not degenerate: continuations use many different tokens
    assert max(len(set(c)) for c in conts) >= 10
    # EOS is reachable: some prompts stop early, and some run the full length
    stops = [c.index(tok.eos_token_id) + 1 for c in conts if tok.eos_token_id in c]
    assert stops, "no prompt reached EOS within 64 tokens"
    assert len(stops) < len(prompts)


def test_sharded_matches_single(tiny_llama_path, tiny_llama_sharded_path):
    idx = tiny_llama_sharded_path / "model.safetensors.index.json"
    assert idx.exists() and not (tiny_llama_sharded_path / "model.safetensors").exists()
    shards = set(json.loads(idx.read_text())["weight_map"].values())
    assert len(shards) >= 2
    a = _load_safetensors_dir(tiny_llama_path)
    b = _load_safetensors_dir(tiny_llama_sharded_path)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_sharded_path), dtype=torch.float32)
    sd = model.state_dict()
    assert all(torch.equal(sd[k], a[k]) for k in a)


def test_deterministic_and_idempotent(tiny_llama_path, make_model_module, tmp_path):
    mm = make_model_module
    stamp = json.loads((tiny_llama_path / mm.STAMP_NAME).read_text())
    out = mm.make_tiny(tmp_path / "again", "llama")
    # same bytes for tokenizer, same weights
    assert (out / "tokenizer.json").read_bytes() == (tiny_llama_path / "tokenizer.json").read_bytes()
    again = json.loads((out / mm.STAMP_NAME).read_text())
    assert again["params_hash"] == stamp["params_hash"]
    assert again["weights_sha256_16"] == stamp["weights_sha256_16"]
    # second call is a no-op
    mtime = os.stat(out / "model.safetensors").st_mtime_ns
    mm.make_tiny(tmp_path / "again", "llama")
    assert os.stat(out / "model.safetensors").st_mtime_ns == mtime


@pytest.mark.parametrize("preset", ["llama-3-8b", "qwen2.5-0.5b"])
def test_write_random_model_scaled_down(preset, make_model_module, tmp_path):
    mm = make_model_module
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=1000)
    out = mm.write_random_model(tmp_path / preset, preset, "bfloat16", overrides=small, max_shard_bytes="100KB")
    cfg = AutoConfig.from_pretrained(str(out))
    full = mm.RANDOM_PRESETS[preset]
    assert cfg.model_type == full["model_type"] and cfg.tie_word_embeddings == full["tie_word_embeddings"]
    assert (out / "model.safetensors.index.json").exists()
    sd = _load_safetensors_dir(out)
    assert all(t.dtype == torch.bfloat16 for t in sd.values())
    if preset == "qwen2.5-0.5b":
        assert "model.layers.0.self_attn.q_proj.bias" in sd and "lm_head.weight" not in sd
    else:
        rope = getattr(cfg, "rope_parameters", None) or cfg.rope_scaling
        assert rope["rope_type"] == "llama3" and rope["rope_theta"] == 500000.0
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16)
    msd = model.state_dict()
    assert all(torch.equal(msd[k], sd[k]) for k in sd)
    ids = torch.tensor([[5, 6, 7]])
    gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert gen.shape == (1, 7)
    AutoTokenizer.from_pretrained(str(out))
