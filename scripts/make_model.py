#!/usr/bin/env python3
"""Build small, deterministic Hugging Face checkpoints with no downloads.

Tiny models (CPU tests, the default served model):

    python scripts/make_model.py --all                          # models/tiny-llama, tiny-qwen3, tiny-llama-sharded
    python scripts/make_model.py --out models/tiny-llama --arch llama
    python scripts/make_model.py --out models/tiny-qwen3 --arch qwen3
    python scripts/make_model.py --out models/x --arch llama --shard-size 4MB   # sharded + index
    python scripts/make_model.py --out models/tiny-llama --arch llama --check   # print greedy samples

Real-shaped random models (GPU benchmarks; weights are made directly with torch):

    python scripts/make_model.py --preset llama-3-8b --out /tmp/llama-3-8b --dtype bfloat16 --device cuda
    python scripts/make_model.py --preset qwen2.5-0.5b --out /tmp/qwen2.5-0.5b --device cuda

What is in a tiny model folder:

* ``config.json`` / ``generation_config.json`` / ``model.safetensors`` (float32) or
  ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``.
  ``config.json`` carries the transformers-5 ``rope_parameters`` *and* the legacy
  ``rope_theta`` / ``rope_scaling`` keys that hub checkpoints have, so readers of either
  form work.
* ``tokenizer.json`` + ``tokenizer_config.json``: a byte-level BPE trained here on
  ``scripts/corpus/*.txt`` (English prose plus accented, CJK and emoji text, so multi-byte
  UTF-8 characters split across tokens).  Special tokens: ``<unk>``=0, ``<s>``=1 (bos),
  ``</s>``=2 (eos), ``<pad>``=3.  **No bos/eos is added automatically** when encoding
  (``add_bos_token`` is false): ``tok.encode(s)`` returns exactly the ids of ``s``, and
  ``tok.decode(tok.encode(s)) == s`` for any string.  ``chat_template`` renders
  ``<|role|>\\n{content}</s>\\n`` per message (+ ``<|assistant|>\\n`` as generation prompt).
* ``.make_model.json``: the stamp.  It holds a hash of every parameter that determines the
  output (this file's parameter tables, the corpus bytes, SCRIPT_VERSION); a folder whose
  stamp matches is left alone, so the script is idempotent and cheap to call.

Weights: the module tree comes from ``AutoModelForCausalLM.from_config`` under
``torch.manual_seed``; then every tensor is refilled from its own CPU ``torch.Generator``
seeded by a hash of (seed, tensor name), so the values do not depend on the transformers
version's init code or on parameter order.  Random weights at the usual std 0.02 give
near-flat logits and greedy decoding that loops on one token; the scales below
(projections std 0.08-0.15, final-norm gain 25, EOS row gain 1.3-1.4) give peaked,
context-dependent next-token distributions (median greedy top1-top2 logit margin ~1-2)
and make some prompts reach ``</s>`` within 5-60 tokens while others run long.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
CORPUS_DIR = REPO_ROOT / "scripts" / "corpus"
DEFAULT_MODELS_DIR = REPO_ROOT / "models"
STAMP_NAME = ".make_model.json"
# Bump when the output changes for reasons the parameter tables below do not capture.
SCRIPT_VERSION = 1

# ----------------------------------------------------------------------------- tokenizer

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]  # ids 0..3
UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
TOKENIZER_PARAMS = {
    "vocab_size": 768,  # 4 specials + 256 byte symbols + 508 merges
    "min_frequency": 2,
    "special_tokens": SPECIAL_TOKENS,
    "model_max_length": 2048,
}

# A plain role-tagged chat format (``<|role|>`` line, content, ``</s>``) so that chat clients
# (the OpenAI frontend's /v1/chat/completions) work on the default model.  Kept out of the
# stamp's hash: a template change only rewrites tokenizer_config.json (ensure_chat_template),
# never the weights.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '</s>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

# ----------------------------------------------------------------------------- tiny archs

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}

TINY_ARCHS: dict[str, dict] = {
    "llama": {
        "config": {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 256,
            "intermediate_size": 688,
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 32,
            "max_position_embeddings": 2048,
            "rope_theta": 10000.0,
            "rope_scaling": LLAMA3_ROPE,
            "rms_norm_eps": 1e-5,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
        },
        "init": {
            "seed": 1234,
            "embed_std": 0.02,
            "lm_head_std": 0.02,
            "proj_std": 0.08,
            "norm_jitter": 0.1,
            "final_norm_gain": 25.0,
            "eos_gain": 1.4,
        },
    },
    "qwen3": {
        "config": {
            "model_type": "qwen3",
            "architectures": ["Qwen3ForCausalLM"],
            # head_dim 32 is set explicitly and differs from hidden/heads = 16: the q
            # projection is 256 wide for a 128-wide residual, like Qwen3-0.6B (1024 -> 2048).
            "hidden_size": 128,
            "intermediate_size": 384,
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "max_position_embeddings": 2048,
            "rope_theta": 1000000.0,
            "rope_scaling": None,
            "rms_norm_eps": 1e-6,
            "hidden_act": "silu",
            "attention_bias": False,
            "use_sliding_window": False,
            "tie_word_embeddings": True,
        },
        "init": {
            "seed": 4321,
            "embed_std": 0.02,
            "lm_head_std": 0.02,  # unused: tied to the embedding
            "proj_std": 0.15,
            "norm_jitter": 0.1,
            "final_norm_gain": 25.0,
            "eos_gain": 1.5,
        },
    },
}

# name -> (arch, max_shard_size or None)
TINY_MODELS: dict[str, tuple[str, str | None]] = {
    "tiny-llama": ("llama", None),
    "tiny-qwen3": ("qwen3", None),
    "tiny-llama-sharded": ("llama", "4MB"),  # ~13 MB of float32 -> 4 shards + index
}

# ----------------------------------------------------------------------------- big presets

RANDOM_PRESETS: dict[str, dict] = {
    "qwen2.5-0.5b": {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "attention_bias": True,  # documentation only: Qwen2 always has q/k/v bias
    },
    "llama-3-8b": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": dict(LLAMA3_ROPE, original_max_position_embeddings=8192),
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    },
}
DEFAULT_SHARD_BYTES = 5 * 10**9


# ============================================================================= helpers


def log(msg: str) -> None:
    print(f"[make_model] {msg}", file=sys.stderr, flush=True)


def corpus_files() -> list[Path]:
    files = sorted(CORPUS_DIR.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no corpus files in {CORPUS_DIR}")
    return files


def corpus_digest() -> str:
    h = hashlib.sha256()
    for f in corpus_files():
        h.update(f.name.encode())
        h.update(b"\0")
        h.update(f.read_bytes())
    return h.hexdigest()


def params_hash(params: dict) -> str:
    return hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16]


def read_stamp(out_dir: Path) -> dict | None:
    try:
        return json.loads((out_dir / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return None


def is_up_to_date(out_dir: Path, phash: str) -> bool:
    stamp = read_stamp(out_dir)
    return stamp is not None and stamp.get("params_hash") == phash


def parse_size(s: str | int | None) -> int | None:
    if s is None or isinstance(s, int):
        return s
    s = s.strip().upper()
    for unit, mult in (("GIB", 2**30), ("MIB", 2**20), ("KIB", 2**10), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3), ("B", 1)):
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * mult)
    return int(s)


@contextlib.contextmanager
def build_lock(out_dir: Path):
    """Serialize concurrent builds of one folder (e.g. parallel pytest workers)."""
    import fcntl

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    lock_path = out_dir.parent / f".{out_dir.name}.lock"
    with open(lock_path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _prepare_tmp(out_dir: Path) -> Path:
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def _commit_tmp(tmp: Path, out_dir: Path, force: bool) -> None:
    _make_readable(tmp)
    if out_dir.exists():
        if read_stamp(out_dir) is None and not force:
            shutil.rmtree(tmp)
            raise FileExistsError(f"{out_dir} exists and was not made by make_model.py (no {STAMP_NAME}); use --force")
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)


def _tensor_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def _make_readable(folder: Path) -> None:
    # save_pretrained may create 0600 files; a server running as another user must read them.
    for f in folder.iterdir():
        if f.is_file():
            f.chmod(0o644)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _add_legacy_rope_keys(config_path: Path, rope_theta: float, rope_scaling: dict | None) -> None:
    """transformers 5 writes only ``rope_parameters``; hub checkpoints carry the legacy keys."""
    cfg = json.loads(config_path.read_text())
    cfg["rope_theta"] = rope_theta
    cfg["rope_scaling"] = copy.deepcopy(rope_scaling) if rope_scaling else None
    rp = cfg.get("rope_parameters")
    if not isinstance(rp, dict):
        rp = dict(rope_scaling or {"rope_type": "default"})
        rp["rope_theta"] = rope_theta
        cfg["rope_parameters"] = rp
    _write_json(config_path, cfg)


# ============================================================================= tokenizer


def build_tokenizer():
    """Train the byte-level BPE on the corpus.  Deterministic: same corpus -> same file."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_PARAMS["vocab_size"],
        min_frequency=TOKENIZER_PARAMS["min_frequency"],
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [f.read_text(encoding="utf-8") for f in corpus_files()]
    tok.train_from_iterator(texts, trainer=trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    return tok


def ensure_chat_template(out_dir: Path) -> None:
    """tokenizer_config.json of a built folder carries CHAT_TEMPLATE (rewritten atomically)."""
    tc_path = out_dir / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    if tc.get("chat_template") != CHAT_TEMPLATE:
        tc["chat_template"] = CHAT_TEMPLATE
        tmp = tc_path.with_suffix(f".tmp-{os.getpid()}")
        _write_json(tmp, tc)
        tmp.chmod(0o644)
        os.replace(tmp, tc_path)
        log(f"{out_dir}: chat template updated")


def save_tokenizer(tok, out_dir: Path) -> int:
    """Write tokenizer.json + tokenizer_config.json loadable by AutoTokenizer; returns vocab size."""
    from transformers import PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        clean_up_tokenization_spaces=False,
        model_max_length=TOKENIZER_PARAMS["model_max_length"],
    )
    hf_tok.save_pretrained(str(out_dir))
    # "PreTrainedTokenizerFast" loads in transformers 4.x and 5.x alike (5.x writes its
    # own new name, TokenizersBackend).  No automatic bos/eos.
    tc_path = out_dir / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc["add_bos_token"] = False
    tc["add_eos_token"] = False
    tc["clean_up_tokenization_spaces"] = False
    tc["chat_template"] = CHAT_TEMPLATE
    _write_json(tc_path, tc)
    if not (out_dir / "special_tokens_map.json").exists():
        _write_json(
            out_dir / "special_tokens_map.json",
            {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"},
        )
    return tok.get_vocab_size()


# ============================================================================= tiny models


def tiny_params(arch: str, shard_size: str | None) -> dict:
    spec = TINY_ARCHS[arch]
    return {
        "kind": "tiny",
        "script_version": SCRIPT_VERSION,
        "arch": arch,
        "config": spec["config"],
        "init": spec["init"],
        "tokenizer": TOKENIZER_PARAMS,
        "corpus_sha256": corpus_digest(),
        "shard_size": shard_size,
    }


def make_hf_config(arch_cfg: dict, vocab_size: int):
    from transformers import AutoConfig

    kw = copy.deepcopy(arch_cfg)  # config classes may edit nested dicts (rope_scaling) in place
    model_type = kw.pop("model_type")
    if model_type == "qwen2":
        kw.pop("attention_bias", None)  # Qwen2 has q/k/v bias unconditionally
    if kw.get("rope_scaling") is None:
        kw.pop("rope_scaling", None)
    kw.update(vocab_size=vocab_size, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    return AutoConfig.for_model(model_type, **kw)


def init_tiny_weights_(model, init: dict, tie: bool) -> None:
    """Refill every parameter deterministically (independent of transformers' init code)."""
    import torch

    seed = init["seed"]
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied lm_head is deduplicated here
            g = torch.Generator().manual_seed(_tensor_seed(seed, name))
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name == "model.norm.weight":
                val = init["final_norm_gain"] * (1.0 + init["norm_jitter"] * noise)
            elif "norm" in name:  # input/post-attention layernorm, q_norm, k_norm
                val = 1.0 + init["norm_jitter"] * noise
            elif name.endswith("bias"):
                val = init["proj_std"] * noise
            elif "embed_tokens" in name:
                val = init["embed_std"] * noise
            elif name.startswith("lm_head"):
                val = init["lm_head_std"] * noise
            else:
                val = init["proj_std"] * noise
            p.copy_(val.to(p.dtype))
        out_w = model.get_output_embeddings().weight
        out_w[EOS_ID] *= init["eos_gain"]
        if tie:
            assert out_w.data_ptr() == model.get_input_embeddings().weight.data_ptr()


def weights_digest(state_dict) -> str:
    import torch

    h = hashlib.sha256()
    for k in sorted(state_dict):
        t = state_dict[k].detach().contiguous().cpu()
        h.update(k.encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def build_tiny_model(arch: str, tok):
    """Returns (model, hf_config); the model is float32 and in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    spec = TINY_ARCHS[arch]
    cfg = make_hf_config(spec["config"], tok.get_vocab_size())
    torch.manual_seed(spec["init"]["seed"])
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    init_tiny_weights_(model, spec["init"], tie=bool(spec["config"]["tie_word_embeddings"]))
    return model.eval(), cfg


def save_tiny_model(model, arch: str, tok, out_dir: Path, shard_size: str | None, phash: str, params: dict, force: bool) -> None:
    from transformers import GenerationConfig

    spec = TINY_ARCHS[arch]
    tmp = _prepare_tmp(out_dir)
    try:
        kw = {"max_shard_size": shard_size or "50GB"}
        if _accepts_safe_serialization():  # transformers 4.x; 5.x always writes safetensors
            kw["safe_serialization"] = True
        model.save_pretrained(str(tmp), **kw)
        _add_legacy_rope_keys(tmp / "config.json", spec["config"]["rope_theta"], spec["config"]["rope_scaling"])
        GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID).save_pretrained(str(tmp))
        save_tokenizer(tok, tmp)
        if shard_size and not (tmp / "model.safetensors.index.json").exists():
            raise RuntimeError(f"shard size {shard_size} did not produce an index file")
        stamp = {
            "params_hash": phash,
            "weights_sha256_16": weights_digest(model.state_dict()),
            "params": params,
        }
        _write_json(tmp / STAMP_NAME, stamp)
        _commit_tmp(tmp, out_dir, force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _accepts_safe_serialization() -> bool:
    import inspect

    from transformers import PreTrainedModel

    return "safe_serialization" in inspect.signature(PreTrainedModel.save_pretrained).parameters


def make_tiny(out_dir: str | Path, arch: str, shard_size: str | None = None, force: bool = False, check: bool = False) -> Path:
    """Build one tiny model folder unless an up-to-date one is there.  Returns the path."""
    return make_tiny_many([(Path(out_dir), arch, shard_size)], force=force, check=check)[0]


def make_tiny_many(jobs: list[tuple[Path, str, str | None]], force: bool = False, check: bool = False) -> list[Path]:
    """Build several tiny folders, training the tokenizer and each arch's weights once."""
    out: list[Path] = []
    tok = None
    models: dict[str, object] = {}
    for out_dir, arch, shard_size in jobs:
        out_dir = Path(out_dir).resolve()
        if arch not in TINY_ARCHS:
            raise ValueError(f"unknown arch {arch!r}; choose from {sorted(TINY_ARCHS)}")
        params = tiny_params(arch, shard_size)
        phash = params_hash(params)
        with build_lock(out_dir):
            if not force and is_up_to_date(out_dir, phash):
                log(f"{out_dir} is up to date ({phash})")
                ensure_chat_template(out_dir)
            else:
                t0 = time.time()
                if tok is None:
                    tok = build_tokenizer()
                if arch not in models:
                    models[arch] = build_tiny_model(arch, tok)[0]
                save_tiny_model(models[arch], arch, tok, out_dir, shard_size, phash, params, force)
                log(f"built {out_dir} ({arch}, shards={shard_size or 'single'}) in {time.time() - t0:.1f}s")
        if check:
            sanity_check(out_dir)
        out.append(out_dir)
    return out


def make_all(models_dir: str | Path = DEFAULT_MODELS_DIR, force: bool = False, check: bool = False) -> list[Path]:
    models_dir = Path(models_dir)
    return make_tiny_many([(models_dir / name, arch, shard) for name, (arch, shard) in TINY_MODELS.items()], force=force, check=check)


CHECK_PROMPTS = [
    "The weather in the valley",
    "Once upon a time",
    "In Tokyo the trains",
    "Bread is",
    "Q: Why does the library close?",
    "Nguyễn stays 王小明 🙏",
    "The machine",
    "Thank you",
]


def sanity_check(model_dir: Path, max_new_tokens: int = 64) -> dict:
    """Greedy-generate from a few prompts with transformers; print and return a summary."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    conts, eos_at = [], []
    for p in CHECK_PROMPTS:
        ids = torch.tensor([tok.encode(p)])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
        new = out[0, ids.shape[1]:].tolist()
        conts.append(new)
        eos_at.append(new.index(EOS_ID) + 1 if EOS_ID in new else None)
        print(f"  {p!r} -> {tok.decode(new)!r}"[:160])
    summary = {"distinct": len({tuple(c) for c in conts}), "eos_at": eos_at}
    print(f"  {model_dir.name}: {summary}")
    return summary


# ============================================================================= big random models


def _big_param_specs(cfg) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every stored tensor, from the HF module tree on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]  # tied lm_head dropped


def write_random_model(
    out_dir: str | Path,
    preset: str,
    dtype: str = "bfloat16",
    device: str = "cpu",
    seed: int = 0,
    overrides: dict | None = None,
    max_shard_bytes: int | str = DEFAULT_SHARD_BYTES,
    force: bool = False,
) -> Path:
    """Write a real-shaped random checkpoint (std 0.02 normal, norms = 1) for benchmarks.

    ``preset`` is a key of RANDOM_PRESETS; ``overrides`` replaces config fields (used by the
    tests to write a scaled-down variant).  Tensors are generated on ``device`` one at a
    time and written as safetensors shards of at most ``max_shard_bytes`` with an index.
    The tiny tokenizer is reused (its vocab is smaller than the model's; that is fine for
    token-id benchmarks).  Idempotent through the same stamp file as the tiny models.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    if preset not in RANDOM_PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(RANDOM_PRESETS)}")
    out_dir = Path(out_dir).resolve()
    arch_cfg = copy.deepcopy(dict(RANDOM_PRESETS[preset], **(overrides or {})))
    max_shard_bytes = parse_size(max_shard_bytes)
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    dtype_name = str(torch_dtype).replace("torch.", "")
    params = {
        "kind": "random",
        "script_version": SCRIPT_VERSION,
        "preset": preset,
        "config": arch_cfg,
        "dtype": dtype_name,
        "seed": seed,
        "max_shard_bytes": max_shard_bytes,
        "tokenizer": TOKENIZER_PARAMS,
        "corpus_sha256": corpus_digest(),
    }
    phash = params_hash(params)
    with build_lock(out_dir):
        if not force and is_up_to_date(out_dir, phash):
            log(f"{out_dir} is up to date ({phash})")
            return out_dir
        t0 = time.time()
        cfg = make_hf_config(arch_cfg, arch_cfg["vocab_size"])
        cfg.dtype = dtype_name
        specs = _big_param_specs(cfg)
        elem = torch.empty((), dtype=torch_dtype).element_size()
        # Plan shards up front so the file names can carry the shard count.
        shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
        cur = 0
        for name, shape in specs:
            nbytes = math.prod(shape) * elem
            if shards[-1] and cur + nbytes > max_shard_bytes:
                shards.append([])
                cur = 0
            shards[-1].append((name, shape))
            cur += nbytes
        n = len(shards)
        tmp = _prepare_tmp(out_dir)
        try:
            weight_map: dict[str, str] = {}
            total = 0
            for i, shard in enumerate(shards):
                fname = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                tensors = {}
                for name, shape in shard:
                    g = torch.Generator(device=device).manual_seed(_tensor_seed(seed, name))
                    if "norm" in name:
                        t = torch.ones(shape, dtype=torch_dtype, device=device)
                    else:
                        t = torch.randn(shape, generator=g, dtype=torch.float32, device=device).mul_(0.02).to(torch_dtype)
                    tensors[name] = t.cpu()
                    weight_map[name] = fname
                    total += t.numel() * elem
                save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
                del tensors
                log(f"  wrote {fname}")
            if n > 1:
                _write_json(tmp / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
            cfg.save_pretrained(str(tmp))
            _add_legacy_rope_keys(tmp / "config.json", arch_cfg["rope_theta"], arch_cfg.get("rope_scaling"))
            GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID).save_pretrained(str(tmp))
            save_tokenizer(build_tokenizer(), tmp)
            _write_json(tmp / STAMP_NAME, {"params_hash": phash, "params": params})
            _commit_tmp(tmp, out_dir, force)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log(f"built {out_dir} ({preset}, {dtype_name}, {total / 1e9:.2f} GB in {n} file(s)) in {time.time() - t0:.1f}s")
    return out_dir


# ============================================================================= CLI


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--all", action="store_true", help="build models/tiny-llama, tiny-qwen3, tiny-llama-sharded")
    ap.add_argument("--models-dir", default=str(DEFAULT_MODELS_DIR), help="parent folder for --all (default: %(default)s)")
    ap.add_argument("--out", help="output folder for --arch or --preset")
    ap.add_argument("--arch", choices=sorted(TINY_ARCHS), help="tiny architecture")
    ap.add_argument("--shard-size", default=None, help="tiny: save sharded with this max shard size (e.g. 4MB)")
    ap.add_argument("--preset", choices=sorted(RANDOM_PRESETS), help="real-shaped random model (benchmarks)")
    ap.add_argument("--dtype", default="bfloat16", help="--preset: weight dtype (default: %(default)s)")
    ap.add_argument("--device", default="cpu", help="--preset: where to generate weights (default: %(default)s)")
    ap.add_argument("--max-shard-bytes", default=str(DEFAULT_SHARD_BYTES), help="--preset: shard size (default: 5GB)")
    ap.add_argument("--seed", type=int, default=0, help="--preset: weight seed")
    ap.add_argument("--force", action="store_true", help="rebuild even when the stamp matches")
    ap.add_argument("--check", action="store_true", help="tiny: print greedy generations after building")
    args = ap.parse_args(argv)

    if args.all:
        make_all(args.models_dir, force=args.force, check=args.check)
    elif args.preset:
        if not args.out:
            ap.error("--preset needs --out")
        write_random_model(args.out, args.preset, dtype=args.dtype, device=args.device, seed=args.seed,
                           max_shard_bytes=args.max_shard_bytes, force=args.force)
    elif args.arch:
        if not args.out:
            ap.error("--arch needs --out")
        make_tiny(args.out, args.arch, shard_size=args.shard_size, force=args.force, check=args.check)
    else:
        ap.error("give --all, --arch ARCH --out DIR, or --preset NAME --out DIR")
    return 0


if __name__ == "__main__":
    sys.exit(main())
