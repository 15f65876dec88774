"""Hugging Face baselines for bench.decode: `generate` (static cache on CUDA) and continuous
batching (`generate_batch`, when the installed transformers has it).

Both are timed like our engine: the window runs from the moment the host has the first output
token of every request of the batch to the moment it has the last one.
  - generate: timestamps from a `BaseStreamer` (generate hands it each step's tokens on the
    host; it syncs on every step anyway for its stop check).
  - generate_batch: its own per-token host timestamps (`record_timestamps=True`,
    time.perf_counter when the token is appended to the request). Its scheduler may split the
    prefills over several steps, so early requests can decode before the window opens; the
    last request to get its first token still decodes output_len - 1 tokens inside it.
"""
from __future__ import annotations

import importlib.util
import sys
import time
from typing import Optional

import torch


class _Stamps:
    """A transformers streamer that records when each step's tokens reach the host."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def load_model(path: str, dtype: torch.dtype, device: str, dummy: bool):
    """A checkpoint, or (dummy) a random-init model of the config's shape built directly on
    the device (no checkpoint on disk; speed only)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    if dummy:
        cfg = AutoConfig.from_pretrained(path)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    return model.eval().requires_grad_(False)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_generate(model, prompts: list[list[int]], args, kw: dict) -> tuple[float, dict]:
    """One point (warm-up with the same shapes, then measured): (window seconds, extra)."""
    from transformers.generation.streamers import BaseStreamer

    class Stamps(_Stamps, BaseStreamer):
        pass

    ids = torch.tensor(prompts, device=args.device)
    # eos_token_id=None: no EOS stop (ignore_eos); checked below by the output length.
    kw = dict(kw, attention_mask=torch.ones_like(ids), max_new_tokens=args.output_len,
              do_sample=False, eos_token_id=None, pad_token_id=0)
    window = rep_s = 0.0
    for rep in range(2):  # warm-up (static cache, compile if on), then measured
        st = Stamps()
        sync(args.device)
        t_rep = time.perf_counter()
        try:
            with torch.inference_mode():
                out = model.generate(ids, streamer=st, **kw)
        except Exception as e:  # noqa: BLE001 - e.g. torch.compile unavailable: measure eager
            if kw.get("disable_compile", True) or args.device != "cuda":
                raise
            print(f"  hf generate: auto-compiled decode failed ({type(e).__name__}: {e}); "
                  f"falling back to eager", file=sys.stderr, flush=True)
            kw["disable_compile"] = True
            st = Stamps()
            with torch.inference_mode():
                out = model.generate(ids, streamer=st, **kw)
        sync(args.device)
        n_new = out.shape[1] - ids.shape[1]
        assert n_new == args.output_len, (n_new, args.output_len)
        # times[0]: the prompt; times[1]: first new token (after prefill); times[-1]: last.
        assert len(st.times) == args.output_len + 1, len(st.times)
        window = st.times[-1] - st.times[1]
        rep_s = time.perf_counter() - t_rep
    return window, {"rep_wall_s": round(rep_s, 2), "static_cache": "cache_implementation" in kw,
                    "compile": "disable_compile" in kw and not kw["disable_compile"]}


def generate_kwargs(args) -> dict:
    if args.device != "cuda":
        return {}  # CPU: the default dynamic cache
    # static cache; HF auto-compiles its decode forward unless disable_compile
    return {"cache_implementation": "static", "disable_compile": not args.hf_compile}


def has_generate_batch(model) -> bool:
    return hasattr(model, "generate_batch")


def prepare_cb(model, args) -> dict:
    """Pick a paged attention implementation that needs nothing from the network: HF's CB
    would otherwise try flash-attention kernels through the hub when flash_attn is absent."""
    extra = {}
    if importlib.util.find_spec("flash_attn") is None and hasattr(model, "set_attn_implementation"):
        try:
            model.set_attn_implementation("paged|sdpa")
        except Exception as e:  # noqa: BLE001 - older/newer API: let CB choose
            extra["attn_note"] = f"set_attn_implementation failed: {type(e).__name__}"
    extra["attn"] = getattr(model.config, "_attn_implementation", None)
    return extra


def cb_config(max_batch: int):
    """One CB manager for every batch of the model (persistent), sized for the largest."""
    try:
        from transformers import ContinuousBatchingConfig
    except ImportError:
        try:
            from transformers.generation.configuration_utils import ContinuousBatchingConfig
        except ImportError:
            return None
    return ContinuousBatchingConfig(max_requests_per_batch=max_batch)


def run_generate_batch(model, prompts: list[list[int]], args, cbc) -> tuple[float, dict]:
    from transformers import GenerationConfig
    gen = GenerationConfig(max_new_tokens=args.output_len, do_sample=False, eos_token_id=-1, pad_token_id=0)
    kw = {"continuous_batching_config": cbc} if cbc is not None else {}
    window = rep_s = 0.0
    for rep in range(2):  # warm-up (manager, cache, CUDA graphs of these shapes), then measured
        sync(args.device)
        t_rep = time.perf_counter()
        # no_grad, not inference_mode: generate_batch's worker thread updates tensors in place
        # outside inference mode ("Inplace update to inference tensor" on the H200 run).
        with torch.no_grad():
            res = model.generate_batch(prompts, generation_config=gen, record_timestamps=True,
                                       progress_bar=False, persistent_manager=True, **kw)
        sync(args.device)
        outs = list(res.values())
        assert len(outs) == len(prompts), f"generate_batch returned {len(outs)} of {len(prompts)} requests"
        for o in outs:
            if getattr(o, "error", None):
                raise RuntimeError(f"generate_batch request failed: {o.error}")
            assert len(o.generated_tokens) == args.output_len, (len(o.generated_tokens), args.output_len)
            assert o.timestamps and len(o.timestamps) == args.output_len, "no per-token timestamps"
        window = max(o.timestamps[-1] for o in outs) - max(o.timestamps[0] for o in outs)
        rep_s = time.perf_counter() - t_rep
    return window, {"rep_wall_s": round(rep_s, 2)}


def destroy_cb(model) -> None:
    fn = getattr(model, "destroy_cached_continuous_batching_manager", None)
    if fn is not None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            print(f"  hf cb: destroying the manager failed: {type(e).__name__}: {e}", file=sys.stderr)


def point_guard(history: dict, impl: str, batch: int, cap_s: float) -> Optional[str]:
    """Reason to skip (impl, batch), or None. history[impl] = (batch, wall seconds of that
    point's measured rep; one-off setup such as the CB manager's is excluded). Predicted:
    warm-up + measured rep, scaled linearly by batch (an upper bound for decode)."""
    prev = history.get(impl)
    if prev is None or cap_s <= 0:
        return None
    pb, rep_s = prev
    predicted = 2 * rep_s * batch / pb
    if predicted > cap_s:
        return (f"predicted {predicted:.0f} s (2 runs; one run at batch {pb} took {rep_s:.1f} s, scaled "
                f"linearly) > --hf-max-point-s {cap_s:.0f}")
    return None
