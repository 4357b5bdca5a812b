"""RuntimeOptions: the environment is read in one place, values are checked, precedence is explicit."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest

from pipeloom.runtime.options import ENV_VARS, RuntimeOptions, resolve_options


def test_defaults_match_the_documented_ones() -> None:
    o = RuntimeOptions()
    assert (o.heartbeat_timeout, o.stall_timeout, o.heartbeat_interval) == (10.0, 30.0, 0.5)
    assert o.backend is None and o.trace is None and o.trace_endpoint is None
    assert o.gpu_commit_ms == 10.0 and o.overlap_streams is None and o.overlap_collectives
    assert o.fsdp_reduce == "auto" and not o.pair_groups and o.p2p_max_ctas is None and not o.deterministic


def test_frozen_and_keyword_only() -> None:
    o = RuntimeOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.stall_timeout = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        RuntimeOptions(None)  # type: ignore[misc]


def test_every_field_is_documented() -> None:
    src = pathlib.Path(__import__("pipeloom.runtime.options", fromlist=["x"]).__file__).read_text()
    for f in dataclasses.fields(RuntimeOptions):
        after = src.split(f"    {f.name}: ", 1)[1].split("\n", 2)
        assert after[1].strip().startswith('"""'), f"field {f.name} has no docstring"


def test_from_env_maps_every_variable() -> None:
    env = {
        "PIPELOOM_BACKEND": "gloo",
        "PIPELOOM_HEARTBEAT_TIMEOUT": "7.5",
        "PIPELOOM_STALL_TIMEOUT": "12",
        "PIPELOOM_FIRST_STEP_STALL_TIMEOUT": "600",
        "PIPELOOM_TRACE": "/tmp/t.json",
        "PIPELOOM_TRACE_ENDPOINT": "tcp://127.0.0.1:5555",
        "PIPELOOM_PAIR_GROUPS": "1",
        "PIPELOOM_P2P_MAX_CTAS": "4",
        "PIPELOOM_EP_MAX_CTAS": "8",
        "PIPELOOM_GPU_COMMIT_MS": "3",
        "PIPELOOM_GPU_COMMIT_LAUNCHES": "0",
        "PIPELOOM_GPU_EARLY_RECEIVES": "1",
        "PIPELOOM_OVERLAP_STREAMS": "0",
        "PIPELOOM_PROFILE_RANGES": "1",
        "PIPELOOM_OVERLAP_COLLECTIVES": "off",
        "PIPELOOM_FSDP_REDUCE": "fsdp",
        "PIPELOOM_DISPATCH": "ready",
        "PIPELOOM_STATIC_SHAPES": "1",
        "PIPELOOM_GPU_COMMIT_RUNNING": "0",
        "PIPELOOM_GPU_LEARN_SLEEP": "0",
        "PIPELOOM_BATCH_P2P": "1",
        "PIPELOOM_HOST_OVERLAP_BACKWARD": "0",
        "PIPELOOM_HOST_QUEUE_BACKWARDS": "1",
        "PIPELOOM_HOST_OVERLAP_TRIAL": "0",
        "PIPELOOM_DP_BUFFERS": "replica0",
        "PIPELOOM_CUDA_GRAPHS": "1",
        "PIPELOOM_DEFER_GRAPH_TEARDOWN": "0",
        "PIPELOOM_CUDA_GRAPHS_LOSS": "1",
        "UNRELATED": "x",
    }
    assert set(env) - {"UNRELATED"} == set(ENV_VARS)
    o = RuntimeOptions.from_env(env)
    assert o == RuntimeOptions(
        backend="gloo", heartbeat_timeout=7.5, stall_timeout=12.0, first_step_stall_timeout=600.0, trace="/tmp/t.json",
        trace_endpoint="tcp://127.0.0.1:5555", pair_groups=True, p2p_max_ctas=4, ep_max_ctas=8, gpu_commit_ms=3.0, gpu_commit_launches=0.0,
        gpu_early_receives=True, overlap_streams=False, profile_ranges=True, overlap_collectives=False, fsdp_reduce="fsdp", dispatch="ready",
        static_shapes=True, gpu_commit_running=False, gpu_learn_sleep=False, batch_p2p=True, host_overlap_backward=False, host_queue_backwards=True,
        host_overlap_trial=False, dp_buffers="replica0", cuda_graphs=True, defer_graph_teardown=False, cuda_graphs_loss=True,
    )


def test_from_env_empty_and_overrides() -> None:
    assert RuntimeOptions.from_env({}) == RuntimeOptions()
    assert RuntimeOptions.from_env({"PIPELOOM_STALL_TIMEOUT": " "}) == RuntimeOptions()  # empty: the default
    o = RuntimeOptions.from_env({"PIPELOOM_STALL_TIMEOUT": "12", "PIPELOOM_HEARTBEAT_TIMEOUT": "3"}, stall_timeout=60)
    assert (o.stall_timeout, o.heartbeat_timeout) == (60, 3.0)


def test_cold_step_stall_timeout() -> None:
    assert RuntimeOptions().cold_stall_timeout == 300.0
    assert RuntimeOptions(stall_timeout=60).cold_stall_timeout == 600.0
    assert RuntimeOptions(stall_timeout=60, first_step_stall_timeout=90).cold_stall_timeout == 90.0
    assert RuntimeOptions(stall_timeout=60, first_step_stall_timeout=5).cold_stall_timeout == 60.0  # never below
    with pytest.raises(ValueError, match="first_step_stall_timeout must be a positive number"):
        RuntimeOptions(first_step_stall_timeout=0)


@pytest.mark.parametrize(
    "var,value,needle",
    [
        ("PIPELOOM_STALL_TIMEOUT", "soon", "PIPELOOM_STALL_TIMEOUT='soon': expected a number of seconds"),
        ("PIPELOOM_GPU_COMMIT_MS", "soon", "PIPELOOM_GPU_COMMIT_MS='soon': expected a number of milliseconds"),
        ("PIPELOOM_P2P_MAX_CTAS", "1.5", "PIPELOOM_P2P_MAX_CTAS='1.5': expected an integer"),
        ("PIPELOOM_OVERLAP_STREAMS", "maybe", "PIPELOOM_OVERLAP_STREAMS='maybe': expected auto or one of"),
        ("PIPELOOM_BACKEND", "mpi", "backend must be 'gloo', 'nccl' or None (got 'mpi')"),
        ("PIPELOOM_HEARTBEAT_TIMEOUT", "-1", "heartbeat_timeout must be a positive number of seconds (got -1.0)"),
        ("PIPELOOM_FSDP_REDUCE", "always", "fsdp_reduce must be 'auto' or 'fsdp'"),
    ],
)
def test_bad_values_are_named(var: str, value: str, needle: str) -> None:
    with pytest.raises(ValueError) as info:
        RuntimeOptions.from_env({var: value})
    assert needle in str(info.value)


def test_bad_fields_are_all_reported() -> None:
    with pytest.raises(ValueError) as info:
        RuntimeOptions(stall_timeout=0, gpu_commit_ms=-1, p2p_max_ctas=0, gpu_commit_launches=-2, ep_max_ctas=True)
    msg = str(info.value)
    assert "stall_timeout" in msg and "gpu_commit_ms" in msg and "p2p_max_ctas" in msg and "gpu_commit_launches" in msg and "ep_max_ctas" in msg


def test_precedence_kwargs_over_options_over_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPELOOM_STALL_TIMEOUT", "12")
    monkeypatch.setenv("PIPELOOM_HEARTBEAT_TIMEOUT", "3")
    # no options: the environment, then explicit values that are not None
    o = resolve_options(None, heartbeat_timeout=None, stall_timeout=40.0)
    assert (o.heartbeat_timeout, o.stall_timeout) == (3.0, 40.0)
    # options given: the environment is not read
    o = resolve_options(RuntimeOptions(gpu_commit_ms=2.0), stall_timeout=None, overlap_collectives=False)
    assert (o.heartbeat_timeout, o.stall_timeout, o.gpu_commit_ms, o.overlap_collectives) == (10.0, 30.0, 2.0, False)
    with pytest.raises(TypeError, match="options must be a RuntimeOptions, not dict"):
        resolve_options({"stall_timeout": 1})  # type: ignore[arg-type]


def test_host_overlap_backward_is_auto_by_default() -> None:
    assert RuntimeOptions().host_overlap_backward is None
    for raw, want in (("auto", None), ("1", True), ("0", False)):
        assert RuntimeOptions.from_env({"PIPELOOM_HOST_OVERLAP_BACKWARD": raw}).host_overlap_backward is want
    with pytest.raises(ValueError, match="host_overlap_backward must be None"):
        RuntimeOptions(host_overlap_backward="yes")  # type: ignore[arg-type]
