"""`python -m openai_frontend`: serve the OpenAI-compatible API (settings: config.py)."""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional


def exit_with_parent(expected_parent: Optional[int]) -> None:
    """SIGTERM to this process when its parent dies (Linux PR_SET_PDEATHSIG); a parent already
    gone by now means exit at once."""
    import ctypes
    import os
    import signal

    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0) != 0:
        print("warning: prctl(PR_SET_PDEATHSIG) failed; the frontend will outlive the server",
              file=sys.stderr)
    if expected_parent is not None and os.getppid() != expected_parent:
        sys.exit(0)


def main(argv: Optional[list[str]] = None) -> int:
    from .config import FrontendConfig

    cfg = FrontendConfig.from_env()
    ap = argparse.ArgumentParser(prog="python -m openai_frontend", description=__doc__)
    ap.add_argument("--host", default=cfg.host)
    ap.add_argument("--port", type=int, default=cfg.port)
    ap.add_argument("--grpc-url", default=cfg.grpc_url, help="tritonserver's gRPC host:port")
    ap.add_argument("--triton-model", default=cfg.triton_model)
    ap.add_argument("--served-model-name", action="append",
                    help=f"model id(s) clients use (default {cfg.served_model_names})")
    ap.add_argument("--tokenizer", default=cfg.tokenizer_path, help="tokenizer folder (chat template)")
    ap.add_argument("--default-max-tokens", type=int, default=cfg.default_max_tokens)
    ap.add_argument("--max-model-len", type=int, default=cfg.max_model_len,
                    help="context window requests are checked against (0: the llm model's)")
    ap.add_argument("--log-level", default="info")
    ap.add_argument("--exit-with-parent", action="store_true",
                    help="exit when the parent process does (scripts/serve.sh: the tritonserver)")
    args = ap.parse_args(argv)
    if args.exit_with_parent:
        exit_with_parent(cfg.parent_pid)
    cfg.host, cfg.port, cfg.grpc_url = args.host, args.port, args.grpc_url
    if args.triton_model != cfg.triton_model and not args.served_model_name:
        cfg.served_model_names = [args.triton_model]
    cfg.triton_model = args.triton_model
    cfg.served_model_names = args.served_model_name or cfg.served_model_names
    cfg.tokenizer_path, cfg.default_max_tokens = args.tokenizer, args.default_max_tokens
    cfg.max_model_len = args.max_model_len

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        import uvicorn
        from transformers import AutoTokenizer

        from .app import create_app
    except ImportError as e:  # e.g. a GPU host whose venv could not install requirements-triton.txt
        print(f"error: the OpenAI frontend cannot start: {e} (install requirements-triton.txt: "
              "fastapi, uvicorn); tritonserver itself does not need it", file=sys.stderr)
        return 2

    from triton_glue.config import check_tokenizer_folder

    try:
        tok = AutoTokenizer.from_pretrained(check_tokenizer_folder(cfg.tokenizer_path),
                                            trust_remote_code=False, local_files_only=True)
    except Exception as e:  # noqa: BLE001
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"OpenAI frontend: http://{cfg.host}:{cfg.port}/v1 -> tritonserver {cfg.grpc_url} "
          f"model {cfg.triton_model!r} as {cfg.served_model_names}", file=sys.stderr, flush=True)
    uvicorn.run(create_app(cfg, tok), host=cfg.host, port=cfg.port, log_level=args.log_level,
                timeout_graceful_shutdown=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
