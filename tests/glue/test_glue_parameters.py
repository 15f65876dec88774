"""Glue (non-engine) parameters of the llm model: values in milliseconds are checked with a
message naming the parameter."""
import pytest

from triton_glue.config import GLUE_PARAMETERS, glue_parameter, positive_ms


@pytest.mark.parametrize("raw,ms", [("0.5", 0.5), ("5", 5.0), ("1000", 1000.0)])
def test_positive_ms_accepts(raw, ms):
    assert positive_ms("gil_switch_interval_ms", raw) == ms


@pytest.mark.parametrize("raw", ["0", "-1", "nan", "inf", "1001", "fast", ""])
def test_positive_ms_rejects_with_the_name(raw):
    with pytest.raises(ValueError, match=r"'gil_switch_interval_ms' must be a number of ms in \(0, 1000\]"):
        positive_ms("gil_switch_interval_ms", raw)


def test_switch_interval_defaults_to_python_s_own():
    assert GLUE_PARAMETERS["gil_switch_interval_ms"] == ""
    cfg = {"parameters": {"gil_switch_interval_ms": {"string_value": "0.25"}}}
    assert glue_parameter(cfg, "gil_switch_interval_ms") == "0.25"
    assert glue_parameter({"parameters": {}}, "gil_switch_interval_ms") == ""


@pytest.mark.parametrize("raw,on", [("on", True), ("off", False), (" ON ", True)])
def test_engine_process_on_off(raw, on):
    from triton_glue.config import engine_process
    assert engine_process({"parameters": {"engine_process": {"string_value": raw}}}) is on


def test_engine_process_defaults_on_and_rejects_other_values_by_name():
    from triton_glue.config import engine_process
    assert GLUE_PARAMETERS["engine_process"] == "on" and engine_process({"parameters": {}}) is True
    with pytest.raises(ValueError, match=r"^parameter 'engine_process' must be 'on' or 'off', not 'true'$"):
        engine_process({"parameters": {"engine_process": {"string_value": "true"}}})


def test_metric_labels_name_the_instance_only_when_there_are_several():
    """Two instances with the same metric name and labels would share one Prometheus series in
    tritonserver (freed by the first to unload): several instances get their own series."""
    import json
    from triton_glue.config import instance_count, metric_labels
    base = {"model": "llm", "version": "1"}

    def args(groups):
        return {"model_config": json.dumps({"instance_group": groups}), "model_instance_name": "llm_0_1"}

    assert metric_labels(args([{"count": 1, "kind": "KIND_CPU"}]), base) == base
    assert metric_labels(args([]), base) == base  # no instance_group: one instance
    assert metric_labels(args([{"count": 2, "kind": "KIND_CPU"}]), base) == dict(base, instance="llm_0_1")
    # count is per GPU: one instance on each of two GPUs is two instances
    assert instance_count(args([{"count": 1, "kind": "KIND_GPU", "gpus": [0, 1]}])["model_config"]) == 2
    assert metric_labels(args([{"count": 1, "kind": "KIND_GPU", "gpus": [0, 1]}]), base)["instance"] == "llm_0_1"
    assert base == {"model": "llm", "version": "1"}  # not modified
