"""PP=2 with both stages on one GPU (gloo, staged: the debugging mode of pipeline.py): the
per-step payload reaches each stage's device through its runner's pinned staging ring
(HostStaging.upload_tensor) instead of a per-step pinned tensor or a pageable non-blocking
copy; the tokens equal the PP=1 engine's on the same GPU over the churny workload."""
import sys
from pathlib import Path

from gpu_helpers import GPU_MARKS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pp"))
from pp_workload import _cfg, assert_matches_reference, reference_factory  # noqa: E402

pytestmark = GPU_MARKS


def test_pp2_on_one_gpu_matches_pp1(tiny_llama_path):
    import torch.distributed as dist
    from backend_lib import LLMEngine
    reference = reference_factory(LLMEngine(_cfg(tiny_llama_path, device="cuda")))
    eng = LLMEngine(_cfg(tiny_llama_path, pp=2, device="cuda", async_mode="off"))
    try:
        assert_matches_reference(eng, reference, ((4, 21), (16, 22)))
    finally:
        eng.close()
    assert not dist.is_initialized()
