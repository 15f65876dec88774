"""`python -m client.generate` as a user runs it: the routes over gRPC and HTTP, the token-level
`llm` model included (tokenized and detokenized in the client), and the server's error text on a
bad request."""
from __future__ import annotations

import subprocess
import sys

import pytest

from backend_lib import SamplingParams
from triton_glue.detokenizer import full_text

from .conftest import MODEL_DIR, ROOT

PROMPT = "Tell me a story"


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "TOKENIZER_PATH": str(MODEL_DIR), "HOME": "/tmp"}
    return subprocess.run([sys.executable, "-m", "client.generate", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def greedy_text(tokenizer, reference_engine):
    ids = tokenizer.encode(PROMPT)
    c = reference_engine.generate([ids], SamplingParams(max_tokens=12, temperature=0.0))[0]
    return full_text(tokenizer, ids, c.token_ids)


@pytest.mark.parametrize("model,http", [("llm", False), ("llm", True), ("vllm_model", True),
                                        ("ensemble", False), ("llm_bls", False)])
def test_generate_routes(server, greedy_text, model, http):
    url = server.http_url if http else server.grpc_url
    r = run_cli(PROMPT, "--model", model, "--max-tokens", "12", "--temperature", "0", "--url", url,
                *(["--http"] if http else []))
    assert r.returncode == 0, r.stderr
    assert r.stdout == greedy_text + "\n"


@pytest.mark.parametrize("http", [False, True], ids=["grpc", "http"])
def test_server_error_text_is_shown(server, http):
    url = server.http_url if http else server.grpc_url
    r = run_cli(PROMPT, "--model", "vllm_model", "--max-tokens", "100000", "--url", url,
                *(["--http"] if http else []))
    assert r.returncode == 1
    assert "max_tokens must be an integer in [1, 2048] (max_model_len) (got 100000)" in r.stderr, r.stderr
    if http:
        assert "HTTP 400" in r.stderr
