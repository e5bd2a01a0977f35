"""Every engine setting is a worker flag and an `llmfleet up` flag, and `llmfleet up` forwards
what it was given to its workers unchanged."""

from __future__ import annotations

import dataclasses

import pytest

from llmfleet.cli.fleet_plan import FleetSpec, plan
from llmfleet.cli.parser import build_parser
from llmfleet.cli.up import ENGINE_FIELDS
from llmfleet.services.worker.__main__ import parse_config
from llmfleet.shared.core.config import EngineConfig
from llmfleet.shared.core.engine_flags import HELP, NESTED, engine_argv
from llmfleet.shared.core.errors import ValidationError

# A value for every field that differs from its default and passes validation together (the
# nested `speculative` is set through flags of its own: tests/worker/test_spec_flags.py).
SETTINGS = {
    "model": "/models/x",
    "device": "cuda:1",
    "dtype": "bfloat16",
    "block_size": 32,
    "num_kv_blocks": 4096,
    "kv_cache_bytes": 1 << 34,
    "gpu_memory_utilization": 0.5,
    "max_num_seqs": 256,
    "max_num_batched_tokens": 8192,
    "max_model_len": 4096,
    "enable_prefix_caching": False,
    "encoder_cache_mb": 64,
    "max_n": 4,
    "max_logprobs": 5,
    "num_threads": 3,
    "cuda_graph_max_batch_size": 256,
    "async_scheduling": False,
    "tensor_parallel_size": 2,
    "tp_local_ranks": 1,
    "tp_port": 29500,
    "tp_join": "10.0.0.1:29500",
    "tp_rank": 1,
    "tp_all_reduce": "nccl",
    "quantization": "fp8",
    "load_format": "dummy",
    "simulate": False,
    "sim_step_ms": 2.5,
    "sim_decode_ms_per_seq": 0.125,
    "sim_prefill_ms_per_token": 0.0625,
}


def test_every_engine_field_has_a_flag_and_help():
    fields = [f.name for f in dataclasses.fields(EngineConfig)]
    assert sorted(fields) == sorted(HELP) == sorted([*SETTINGS, *NESTED])
    for f in dataclasses.fields(EngineConfig):
        if f.name in NESTED:
            continue
        assert getattr(EngineConfig(), f.name) != SETTINGS[f.name] or f.name == "simulate"


def test_worker_flags_round_trip_every_setting():
    _, engine, _ = parse_config(engine_argv(SETTINGS))
    assert engine == EngineConfig(**SETTINGS)


def test_boolean_settings_turn_on_and_off():
    _, engine, _ = parse_config(engine_argv({"simulate": True, "enable_prefix_caching": False}))
    assert engine.simulate and not engine.enable_prefix_caching
    assert engine_argv({"simulate": True, "max_n": None}) == ["--simulate"]


def test_up_forwards_every_other_setting_to_each_worker(tmp_path):
    args = build_parser().parse_args(
        ["up", "--port", "0", "--simulate", "--max-num-seqs", "256", "--sim-step-ms", "2.5"]
    )
    engine = {f: getattr(args, f) for f in ENGINE_FIELDS if getattr(args, f) is not None}
    assert engine == {"simulate": True, "max_num_seqs": 256, "sim_step_ms": 2.5}
    spec = FleetSpec(port=0, workers=2, engine=engine, model="/models/x")
    workers = plan(spec, tmp_path)[2]
    for w in workers:
        _, config, _ = parse_config(w.argv[3:])  # past `python -m <module>`
        assert (config.simulate, config.max_num_seqs, config.sim_step_ms) == (True, 256, 2.5)
        assert config.model == "/models/x"


def test_unknown_or_duplicated_engine_settings_are_refused():
    with pytest.raises(ValidationError, match="^engine"):
        FleetSpec(engine={"max_num_seq": 8})
    with pytest.raises(ValidationError, match="^engine"):
        FleetSpec(engine={"model": "/x"})  # FleetSpec.model says it
