"""Speculative decoding settings: worker flags and `LLMFLEET_*` variables into the engine's
SpeculativeConfig, the "auto" batch-size threshold, `llmfleet up` passing them to decode and
unified workers only, and errors naming the flag."""

from __future__ import annotations

import pytest

from llmfleet.cli.fleet_plan import FleetSpec, plan
from llmfleet.cli.main import main as llmfleet_main
from llmfleet.engine.spec_decode import threshold
from llmfleet.services.worker.__main__ import parse_config
from llmfleet.shared.core.speculative import SpeculativeConfig


def engine_of(argv):
    _, engine, _ = parse_config(argv)
    return engine


def test_flags_build_the_engines_speculative_config():
    engine = engine_of(
        [
            "--speculative-method",
            "ngram",
            "--num-speculative-tokens",
            "5",
            "--ngram-min",
            "2",
            "--ngram-max",
            "6",
            "--speculative-disable-batch-size",
            "24",
        ]
    )
    assert engine.speculative == SpeculativeConfig(
        method="ngram", num_speculative_tokens=5, ngram_min=2, ngram_max=6, disable_batch_size=24
    )
    assert engine_of([]).speculative is None
    # vLLM's spellings are aliases.
    engine = engine_of(["--speculative-method", "ngram", "--ngram-prompt-lookup-max", "7"])
    assert engine.speculative.ngram_max == 7


def test_a_layer_truncated_draft_of_the_served_checkpoint():
    argv = ["--model", "/models/x", "--speculative-method", "draft"]
    argv += ["--speculative-model", "/models/x", "--speculative-draft-layers", "4"]
    assert engine_of(argv + ["--speculative-disable-batch-size", "never"]).speculative == (
        SpeculativeConfig(method="draft", model="/models/x", draft_layers=4)
    )


def test_environment_sets_speculation_and_flags_override_it(monkeypatch):
    monkeypatch.setenv("LLMFLEET_SPECULATIVE_METHOD", "ngram")
    monkeypatch.setenv("LLMFLEET_NUM_SPECULATIVE_TOKENS", "2")
    monkeypatch.setenv("LLMFLEET_SPECULATIVE_DISABLE_BATCH_SIZE", "never")
    engine = engine_of(["--num-speculative-tokens", "4"])
    assert engine.speculative == SpeculativeConfig(method="ngram", num_speculative_tokens=4)


def test_auto_threshold_resolves_for_the_device(tmp_path, monkeypatch):
    monkeypatch.setattr(threshold, "TABLE_DIR", tmp_path)
    k = 3
    engine = engine_of(["--speculative-method", "ngram", "--num-speculative-tokens", str(k)])
    expected = threshold.COST_MODELS["cpu"].threshold(k)
    assert engine.speculative.disable_batch_size == expected >= 1
    # A measured table for this device wins; the nearest measured k is taken.
    threshold.write_measured("cpu", "ngram", 2, 5, "bench")
    threshold.write_measured("cpu", "ngram", 6, 9, "bench")
    assert engine_of(["--speculative-method", "ngram"]).speculative.disable_batch_size == 5
    engine = engine_of(["--speculative-method", "ngram", "--num-speculative-tokens", "5"])
    assert engine.speculative.disable_batch_size == 9


def test_cost_model_stops_speculating_sooner_with_more_drafts_or_less_acceptance():
    cpu, gpu = threshold.COST_MODELS["cpu"], threshold.COST_MODELS["cuda"]
    assert gpu.threshold(3) > cpu.threshold(3) >= 1
    low = threshold.CostModel(ridge_tokens=128.0, acceptance=0.3)
    high = threshold.CostModel(ridge_tokens=128.0, acceptance=0.8)
    assert low.threshold(4) < high.threshold(4)
    # a = 0.5, k = 3: E = 1.875, B < 16 * (0.875 - 0.3) / 2.125 = 4.3
    assert gpu.threshold(3) == 4
    assert [gpu.threshold(k) for k in (2, 4)] == [5, 3]


def test_prefill_workers_never_speculate():
    _, engine, _ = parse_config(["--role", "prefill", "--speculative-method", "ngram"])
    assert engine.speculative is None
    _, engine, _ = parse_config(["--role", "decode", "--speculative-method", "ngram"])
    assert engine.speculative is not None


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--num-speculative-tokens", "4"], "--num-speculative-tokens"),
        (["--speculative-method", "ngram", "--ngram-min", "3", "--ngram-max", "2"], "--ngram-max"),
        (["--speculative-method", "ngram", "--ngram-min", "0"], "--ngram-min"),
        (["--speculative-method", "ngram", "--num-speculative-tokens", "0"], "--num-speculative"),
        (["--speculative-method", "ngram", "--speculative-model", "/x"], "--speculative-model"),
        (["--speculative-method", "draft"], "--speculative-model"),
        (
            ["--speculative-method", "ngram", "--speculative-draft-layers", "2"],
            "--speculative-draft-layers",
        ),
        (
            ["--speculative-method", "ngram", "--speculative-disable-batch-size", "lots"],
            "--speculative-disable-batch-size",
        ),
        (["--speculative-method", "ngram", "--simulate"], "--speculative-method"),
    ],
)
def test_bad_settings_exit_2_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_config(argv)
    assert exc.value.code == 2
    assert f"error: {flag}" in capsys.readouterr().err


def test_an_unknown_method_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_config(["--speculative-method", "medusa"])
    assert exc.value.code == 2
    assert "--speculative-method" in capsys.readouterr().err


def test_up_passes_speculation_to_decode_and_unified_workers_only(tmp_path):
    from llmfleet.shared.core.speculative_settings import SpeculativeSettings

    settings = SpeculativeSettings(
        speculative_method="ngram", num_speculative_tokens=4, speculative_disable_batch_size="8"
    )
    spec = FleetSpec(port=0, disaggregated=True, decode_workers=2, speculative=settings)
    workers = plan(spec, tmp_path)[2]
    for w in workers:
        _, config, _ = parse_config(w.argv[3:])  # past `python -m <module>`
        if w.role == "prefill":
            assert config.speculative is None
        else:
            assert config.speculative == SpeculativeConfig(
                method="ngram", num_speculative_tokens=4, disable_batch_size=8
            )
    assert [w.role for w in workers] == ["prefill", "decode", "decode"]
    unified = plan(FleetSpec(port=0, speculative=settings), tmp_path)[2]
    assert parse_config(unified[0].argv[3:])[1].speculative.num_speculative_tokens == 4


def test_up_refuses_bad_speculative_flags_before_starting_anything(capsys):
    status = llmfleet_main(["up", "--port", "0", "--ngram-max", "3"])
    assert status == 2
    assert "invalid --ngram-max: needs --speculative-method" in capsys.readouterr().err


@pytest.mark.gpu
def test_auto_threshold_on_a_gpu_names_it():
    import torch

    name = torch.cuda.get_device_name(torch.device("cuda:0"))
    assert threshold.device_name("cuda:0") == name
    value, source = threshold.resolve("cuda:0", "ngram", 3)
    assert value >= 1 and name in source
    engine = engine_of(
        ["--device", "cuda:0", "--dtype", "bfloat16", "--speculative-method", "ngram"]
    )
    assert engine.speculative.disable_batch_size == value
