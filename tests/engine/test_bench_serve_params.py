"""bench.serve sizes max_model_len and num_kv_blocks for the parts and workloads it runs: a
cache sized for the 512-request burst of 1536-token requests (49,680 blocks, 97 GiB for the
Llama-3-8B shape) made a fixed-workload run at 64 streams fail to load on an 80 GiB GPU."""
from bench.serve import engine_params, parse_args


def _params(*argv):
    a = parse_args(["--preset", "llama-3-8b", "--device", "cuda", "--engine", "large", *argv])
    return engine_params(a, "/tmp/unused-model")


def test_fixed_workload_without_burst_sizes_for_its_own_streams():
    p = _params("--workloads", "fixed", "--parts", "inproc,triton", "--concurrency", "64")
    # prompt 256 + output 128 -> 400 tokens (a block over), 25 blocks a stream, 64 streams + 16
    assert (p["max_model_len"], p["num_kv_blocks"]) == ("400", str(64 * 25 + 16))


def test_burst_or_mixed_workload_sizes_for_the_longest_request():
    burst = _params("--workloads", "fixed", "--parts", "inproc,burst", "--concurrency", "64")
    # 1024 + 512 -> 1552 tokens, 97 blocks; the burst's 512 requests at once (max_num_seqs 512)
    assert (burst["max_model_len"], burst["num_kv_blocks"]) == ("1552", str(512 * 97 + 16))
    mixed = _params("--workloads", "mixed", "--parts", "triton", "--concurrency", "16,64")
    assert (mixed["max_model_len"], mixed["num_kv_blocks"]) == ("1552", str(64 * 97 + 16))


def test_an_explicit_block_count_is_kept():
    p = _params("--workloads", "fixed", "--parts", "triton", "--concurrency", "64", "--set", "num_kv_blocks=5000")
    assert p["num_kv_blocks"] == "5000"
