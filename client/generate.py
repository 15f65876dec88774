"""Stream generated text to the terminal.

    .venv/bin/python -m client.generate "prompt" [--model ensemble|llm_bls|vllm_model|llm] [--http]
                                       [--max-tokens N] [--temperature T] [--stop STR ...]
                                       [--url HOST:PORT] [--no-stream]

gRPC streaming by default (port GRPC_PORT, 8001); --http uses the HTTP generate_stream
endpoint (port HTTP_PORT, 8000), i.e. server-sent events. `--model llm` is the token-level
model: the prompt is tokenized here (the tokenizer of TOKENIZER_PATH, else MODEL_PATH, else
models/tiny-llama) and the streamed ids detokenized here; stop strings need a text route.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import uuid
from typing import Iterator, Optional


ROUTES = ("ensemble", "llm_bls", "vllm_model", "llm")


def _trtllm_inputs(prompt: str, max_tokens: int, temperature: Optional[float], stop: list[str],
                   stream: bool) -> dict:
    body = {"text_input": prompt, "max_tokens": max_tokens, "stream": stream,
            "exclude_input_in_output": True}
    if temperature is not None:
        # top_p too: TensorRT-LLM's routes read absent top_k/top_p as greedy
        body["temperature"], body["top_p"] = temperature, 1.0
    if stop:
        body["stop_words"] = stop
    return body


def _vllm_inputs(prompt: str, max_tokens: int, temperature: Optional[float], stop: list[str],
                 stream: bool) -> dict:
    sp = {"max_tokens": max_tokens}
    if temperature is not None:
        sp["temperature"] = temperature
    if stop:
        sp["stop"] = stop
    return {"text_input": prompt, "stream": stream, "exclude_input_in_output": True,
            "sampling_parameters": json.dumps(sp), "return_finish_reason": True}


def _llm_inputs(prompt_ids: list[int], max_tokens: int, temperature: Optional[float],
                stream: bool) -> dict:
    body = {"input_ids": list(prompt_ids), "max_tokens": max_tokens, "stream": stream,
            "exclude_input_in_output": True}
    if temperature is not None:
        body["temperature"], body["top_p"] = temperature, 1.0  # (as above)
    return body


def request_body(model: str, prompt: str, max_tokens: int = 64, temperature: Optional[float] = None,
                 stop: Optional[list[str]] = None, stream: bool = True) -> dict:
    make = _vllm_inputs if model.startswith("vllm") else _trtllm_inputs
    return make(prompt, max_tokens, temperature, list(stop or []), stream)


def output_name(model: str) -> str:
    return "output_ids" if model == "llm" else "text_output"


def stream_http(url: str, model: str, body: dict, timeout: float = 300.0) -> Iterator:
    """Yields the output pieces (text, or token ids for llm) from POST
    /v2/models/<model>/generate_stream (SSE). An error status raises with the server's text."""
    import urllib.error
    import urllib.request
    req = urllib.request.Request(f"http://{url}/v2/models/{model}/generate_stream",
                                 data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    out = output_name(model)
    try:
        resp = urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"HTTP {e.code}: {_server_error_text(e.read())}") from None
    with resp:
        for raw in resp:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            if "error" in event:
                raise RuntimeError(event["error"])
            v = event.get(out, [] if out == "output_ids" else "")
            yield (v if isinstance(v, list) else [v]) if out == "output_ids" else _text_of(v)


def _server_error_text(raw: bytes) -> str:
    """tritonserver's error body ({"error": "..."}, as JSON or one SSE event) as its message,
    else the raw text."""
    text = raw.decode("utf-8", "replace").strip()
    if text.startswith("data:"):
        text = text[5:].strip()
    try:
        obj = json.loads(text)
    except ValueError:
        return text
    return str(obj.get("error", text)) if isinstance(obj, dict) else text


def _text_of(v) -> str:
    if isinstance(v, list):
        return "".join(_text_of(x) for x in v)
    return v if isinstance(v, str) else str(v)


def _grpc_inputs(model: str, body: dict):
    # imported here, like tritonclient: a python without them gets the venv hint from main()
    import numpy as np
    import tritonclient.grpc as grpcclient
    batched = not model.startswith("vllm")  # TensorRT-LLM-style models have max_batch_size > 0

    def tensor(name, value):
        if name == "input_ids":  # TensorRT-LLM's INT32 token ids
            arr = np.array([value], dtype=np.int32)
            t = grpcclient.InferInput(name, list(arr.shape), "INT32")
            t.set_data_from_numpy(arr)
            return t
        if isinstance(value, str):
            arr = np.array([value.encode("utf-8")], dtype=np.object_)
        elif isinstance(value, bool):
            arr = np.array([value], dtype=np.bool_)
        elif isinstance(value, int):
            arr = np.array([value], dtype=np.int32)
        elif isinstance(value, float):
            arr = np.array([value], dtype=np.float32)
        elif isinstance(value, list):
            arr = np.array([v.encode("utf-8") for v in value], dtype=np.object_)
        else:
            raise TypeError(name)
        if batched:
            arr = arr.reshape(1, -1)
        dt = {"O": "BYTES", "b": "BOOL", "i": "INT32", "f": "FP32"}[arr.dtype.kind]
        t = grpcclient.InferInput(name, list(arr.shape), dt)
        t.set_data_from_numpy(arr)
        return t

    return [tensor(k, v) for k, v in body.items()]


def stream_grpc(url: str, model: str, body: dict, timeout: float = 300.0) -> Iterator:
    """Yields the output pieces (text, or token ids for llm) over a gRPC bidirectional stream."""
    import tritonclient.grpc as grpcclient
    q: "queue.Queue" = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    try:
        out_name = output_name(model)
        client.async_stream_infer(model, _grpc_inputs(model, body), request_id=uuid.uuid4().hex,
                                  outputs=[grpcclient.InferRequestedOutput(out_name)],
                                  enable_empty_final_response=True)
        while True:
            result, error = q.get(timeout=timeout)
            if error is not None:
                raise RuntimeError(str(error))
            final = result.get_response().parameters.get("triton_final_response")
            out = result.as_numpy(out_name)
            if out is not None and out_name == "output_ids":
                yield [int(t) for t in out.reshape(-1)]
            elif out is not None:
                yield "".join(x.decode("utf-8") if isinstance(x, bytes) else str(x) for x in out.reshape(-1))
            if final is not None and final.bool_param:
                return
    finally:
        client.stop_stream()
        client.close()


def _tokenizer():
    """The served model's tokenizer, found as the server finds it."""
    from transformers import AutoTokenizer

    from triton_glue.config import check_tokenizer_folder, tokenizer_path_from_env
    path = check_tokenizer_folder(tokenizer_path_from_env("models/tiny-llama"))
    return AutoTokenizer.from_pretrained(path, trust_remote_code=False, local_files_only=True)


def _detokenized(tok, prompt_ids: list[int], chunks: Iterator[list[int]]) -> Iterator[str]:
    from triton_glue.detokenizer import IncrementalDetokenizer
    detok = IncrementalDetokenizer(tok, prompt_ids)
    for ids in chunks:
        yield detok.add(ids)
    yield detok.add([], final=True)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m client.generate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prompt")
    ap.add_argument("--model", default="ensemble", help=f"one of {ROUTES} (default ensemble)")
    ap.add_argument("--http", action="store_true", help="HTTP generate_stream instead of gRPC")
    ap.add_argument("--url", help="host:port (default localhost:$GRPC_PORT or $HTTP_PORT)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float)
    ap.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    ap.add_argument("--no-stream", action="store_true", help="one response at the end")
    args = ap.parse_args(argv)
    url = args.url or ("localhost:" + (os.environ.get("HTTP_PORT", "8000") if args.http
                                       else os.environ.get("GRPC_PORT", "8001")))
    fn = stream_http if args.http else stream_grpc
    try:
        if args.model == "llm":
            if args.stop:
                raise ValueError("--stop needs a text route (ensemble, llm_bls, vllm_model); llm takes token ids")
            tok = _tokenizer()
            ids = [int(i) for i in tok.encode(args.prompt)]
            body = _llm_inputs(ids, args.max_tokens, args.temperature, stream=not args.no_stream)
            pieces = _detokenized(tok, ids, fn(url, args.model, body))
        else:
            body = request_body(args.model, args.prompt, args.max_tokens, args.temperature, args.stop,
                                stream=not args.no_stream)
            pieces = fn(url, args.model, body)
        for piece in pieces:
            sys.stdout.write(piece)
            sys.stdout.flush()
    except KeyboardInterrupt:
        return 130
    except ImportError as e:
        from triton_glue.venv_hint import venv_hint
        print(f"\nerror: {e}{venv_hint()}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001
        print(f"\nerror: {e}", file=sys.stderr)
        return 1
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
