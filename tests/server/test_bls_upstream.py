"""A BLS route whose upstream `llm` never answers: the client gets an error naming the bound
(parameter upstream_timeout_s) instead of hanging, and the stuck worker shows in the in-flight
gauge (Triton 2.51 cannot interrupt a BLS response iterator, see triton_glue/bls.py)."""
from __future__ import annotations

import json
import shutil
import time
import urllib.request

from .conftest import ROOT, start_server
from .util import StreamClient, http_post, wait_for

TIMEOUT_S = 3

# A stand-in for `llm` with its interface that holds every request and never answers it
# (what a hung or dead engine looks like from the BLS route), except control cancels; its
# finalize answers what it holds so that the server can stop.
SILENT_LLM = '''
import threading
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        self.held, self.lock = [], threading.Lock()

    def execute(self, requests):
        for r in requests:
            sender = r.get_response_sender()
            if pb_utils.get_input_tensor_by_name(r, "cancel_request_id") is not None:
                sender.send(flags=FINAL)
                continue
            with self.lock:
                self.held.append(sender)
        return None

    def finalize(self):
        with self.lock:
            held, self.held = self.held, []
        for s in held:
            s.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("stand-in unloading")), flags=FINAL)
'''


def _repo(tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "model_repository" / "vllm_model", repo / "vllm_model")
    cfg = repo / "vllm_model" / "config.pbtxt"
    text = cfg.read_text()
    old = 'key: "upstream_timeout_s" value: { string_value: "0" }'
    assert old in text
    cfg.write_text(text.replace(old, f'key: "upstream_timeout_s" value: {{ string_value: "{TIMEOUT_S}" }}'))
    (repo / "llm" / "1").mkdir(parents=True)
    llm_cfg = (ROOT / "model_repository" / "llm" / "config.pbtxt").read_text()
    (repo / "llm" / "config.pbtxt").write_text(llm_cfg.split("instance_group")[0]
                                               + "instance_group [ { count: 1 kind: KIND_CPU } ]\n")
    (repo / "llm" / "1" / "model.py").write_text(SILENT_LLM)
    return repo


def test_silent_upstream_answers_with_timeout_error(tmp_path):
    srv = start_server(tmp_path, model_repository=_repo(tmp_path), wait_model="vllm_model")
    try:
        body = {"text_input": "Hello", "stream": True, "sampling_parameters": json.dumps({"max_tokens": 4})}
        sc = StreamClient(srv.grpc_url)
        t0 = time.monotonic()
        got = [sc.send("vllm_model", body, f"s{i}", batched=False) for i in range(3)]
        for c in got:
            assert c.done.wait(TIMEOUT_S + 30), "the client was left hanging on a silent upstream"
        waited = time.monotonic() - t0
        time.sleep(0.1)
        sc.close()
        for c in got:
            assert c.finals == 1 and len(c.errors) == 1, c.errors
            assert "upstream_timeout_s" in c.errors[0] and f"{TIMEOUT_S} s" in c.errors[0], c.errors[0]
        assert TIMEOUT_S - 0.5 <= waited, waited
        # HTTP too, and the route stays ready
        status, text = http_post(srv.http_url, "/v2/models/vllm_model/generate",
                                 {**body, "stream": False}, timeout=TIMEOUT_S + 30)
        assert status >= 400 and "upstream_timeout_s" in text, (status, text)
        with urllib.request.urlopen(f"http://{srv.http_url}/v2/models/vllm_model/ready", timeout=10) as r:
            assert r.status == 200
        # the workers are free again (the helper threads reading the iterators stay blocked)
        assert wait_for(lambda: srv.metric("bls_inflight_requests", route="vllm_model") == 0, 10)
    finally:
        srv.stop()
