"""Tests for deploy.config: loading, validation messages, overrides, round trips."""

from __future__ import annotations

import dataclasses
import textwrap

import pytest
import yaml

from cluster.config import GroupConfig
from configkit import parse_bytes
from deploy.config import (
    DEFAULT_CONFIG_PATH,
    Config,
    ConfigError,
    DecodeGraphConfig,
    load_config,
    with_overrides,
)
from worker.config import EngineConfig


def write(tmp_path, text: str, name: str = "config.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def error_of(*args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(*args, **kwargs)
    return str(info.value)


# --- defaults and partial files -------------------------------------------------------------


def test_defaults_load():
    cfg = load_config()
    assert cfg == Config()
    assert cfg.graphs.decode.backend == "full"
    assert cfg.scheduler.chunked_prefill_size == 8192
    assert cfg.cache.page_size == 16


def test_default_yaml_lists_every_key_with_its_default():
    assert yaml.safe_load(DEFAULT_CONFIG_PATH.read_text()) == Config().to_dict()


def test_config_is_frozen_and_hashable():
    cfg = load_config(None, ["graphs.decode.batch_sizes=[1, 2, 4]"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.graphs.enabled = False  # type: ignore[misc]
    assert hash(cfg) == hash(with_overrides(cfg, []))


def test_partial_yaml_takes_defaults(tmp_path):
    path = write(tmp_path, """
        graphs:
          decode:
            backend: eager
        serve:
          port: 9000
    """)
    cfg = load_config(path)
    assert cfg.graphs.decode.backend == "eager"
    assert cfg.graphs.decode.max_batch_size == 256
    assert cfg.graphs.prefill == Config().graphs.prefill
    assert cfg.serve.port == 9000
    assert cfg.model == Config().model


def test_empty_file_and_null_section_are_defaults(tmp_path):
    assert load_config(write(tmp_path, "")) == Config()
    assert load_config(write(tmp_path, "graphs:\n", "null_section.yaml")) == Config()


def test_yaml_yes_is_a_bool(tmp_path):
    assert load_config(write(tmp_path, "graphs:\n  debug: yes\n")).graphs.debug is True


def test_float_field_accepts_int(tmp_path):
    cfg = load_config(write(tmp_path, "cluster:\n  step_timeout_s: 5\n"))
    assert cfg.cluster.step_timeout_s == 5.0 and isinstance(cfg.cluster.step_timeout_s, float)


# --- errors ----------------------------------------------------------------------------------


def test_unknown_top_level_key(tmp_path):
    msg = error_of(write(tmp_path, "grahps:\n  enabled: true\n"))
    assert msg.startswith("grahps: unknown key (did you mean 'graphs'?)")
    assert "allowed keys: model, attention, cache" in msg


def test_unknown_nested_key(tmp_path):
    msg = error_of(write(tmp_path, "scheduler:\n  chunked_prefil_size: 4096\n"))
    assert msg.startswith("scheduler.chunked_prefil_size: unknown key (did you mean 'chunked_prefill_size'?)")
    assert "allowed keys: max_running_requests," in msg


def test_unknown_deeply_nested_key_without_suggestion(tmp_path):
    msg = error_of(write(tmp_path, "graphs:\n  prefill:\n    zzz: 1\n"))
    assert msg.startswith("graphs.prefill.zzz: unknown key; allowed keys: backend,")


def test_bad_enum_value_with_suggestion(tmp_path):
    msg = error_of(write(tmp_path, "graphs:\n  decode:\n    backend: ful\n"))
    assert msg == (
        "graphs.decode.backend: invalid value 'ful'; allowed: full, breakable, tc_full, eager, debug "
        "(did you mean 'full'?)"
    )


def test_bad_enum_value_case_typo():
    msg = error_of(None, ["model.dtype=BF16"])
    assert "model.dtype: invalid value 'BF16'; allowed: auto, float32, bfloat16, float16" in msg


@pytest.mark.parametrize(
    "override, expected",
    [
        ("cache.page_size='16'", "cache.page_size: expected int, got '16' (str)"),
        ("graphs.enabled=1", "graphs.enabled: expected bool, got 1 (int)"),
        ("graphs.enabled=on_", "graphs.enabled: expected bool, got 'on_' (str)"),
        ("scheduler.max_running_requests=true", "scheduler.max_running_requests: expected int, got True (bool)"),
        ("model.max_model_len=1.5", "model.max_model_len: expected int | null, got 1.5 (float)"),
        ("graphs.decode.batch_sizes=[1, x]", "graphs.decode.batch_sizes[1]: expected int, got 'x' (str)"),
        ("graphs.decode.batch_sizes=8", "graphs.decode.batch_sizes: expected list[int] | null, got 8 (int)"),
        ("graphs.memory_budget=[1]", "graphs.memory_budget: expected int | float | str | null, got [1] (list)"),
        ("graphs.decode=eager", "graphs.decode: expected a mapping, got 'eager' (str)"),
    ],
)
def test_wrong_type(override, expected):
    assert error_of(None, [override]) == expected


@pytest.mark.parametrize(
    "override, expected",
    [
        ("cache.page_size=12", "cache.page_size: must be a power of two >= 1, got 12"),
        ("cache.num_pages=1", "cache.num_pages: must be >= 2, got 1"),
        ("cache.gpu_memory_fraction=1.5", "cache.gpu_memory_fraction: must be in (0, 1], got 1.5"),
        ("serve.gil_switch_interval_ms=0", "serve.gil_switch_interval_ms: must be in (0, 1000] or null, got 0"),
        ("cache.gpu_memory_fraction=.nan", "cache.gpu_memory_fraction: must be in (0, 1], got nan"),
        ("serve.port=70000", "serve.port: must be in 1..65535, got 70000"),
        ("model.max_model_len=0", "model.max_model_len: must be >= 1, got 0"),
        ("graphs.prefill.max_padding_ratio=0.5", "graphs.prefill.max_padding_ratio: must be >= 1, got 0.5"),
        ("graphs.decode.batch_sizes=[1, 4, 2]", "graphs.decode.batch_sizes: must be a non-empty, strictly increasing"),
        ("graphs.decode.batch_sizes=[0, 1]", "graphs.decode.batch_sizes: must be a non-empty, strictly increasing"),
        ("graphs.decode.batch_sizes=[1, 512]", "graphs.decode.batch_sizes: largest size 512 exceeds max_batch_size"),
        ("graphs.memory_budget=1.5", "graphs.memory_budget: a float is a fraction of free memory"),
        ("graphs.memory_budget=4Gx", "graphs.memory_budget: invalid byte size '4Gx'"),
        ("graphs.capture_timeout_s=0", "graphs.capture_timeout_s: must be > 0, got 0.0"),
    ],
)
def test_range_error(override, expected):
    assert error_of(None, [override]).startswith(expected)


def test_chunked_prefill_must_fit_in_a_batch():
    msg = error_of(None, ["scheduler.chunked_prefill_size=16384"])
    assert msg.startswith("scheduler.chunked_prefill_size: 16384 exceeds max_num_batched_tokens (8192)")


@pytest.mark.parametrize(
    "override, key",
    [
        ("graphs.prefill.max_tokens=4096", "graphs.prefill.max_tokens"),
        ("graphs.prefill.token_buckets=[512, 2048]", "graphs.prefill.token_buckets"),
    ],
)
def test_prefill_graph_ceiling_below_chunk_size(override, key):
    msg = error_of(None, [override])
    assert msg.startswith(f"{key}: largest captured prefill size")
    assert "scheduler.chunked_prefill_size (8192)" in msg
    assert "stay eager and keep its activation peak" in msg


def test_engine_config_carries_the_prefill_ceiling_check():
    with pytest.raises(ConfigError, match=r"^graphs\.prefill\.max_tokens: largest captured prefill size 4096"):
        EngineConfig.from_dict({"graphs": {"prefill": {"max_tokens": 4096}}})


def test_serves_cap_must_exceed_the_fleets_queue():
    msg = error_of(None, ["serve.max_ongoing_requests=4096"])
    assert msg.startswith("serve.max_ongoing_requests: 4096 must exceed scheduler.max_waiting_requests (4096)")
    assert "its proxy retries them in a loop instead of answering 429" in msg
    cfg = load_config(None, ["serve.max_ongoing_requests=300", "scheduler.max_waiting_requests=64"])
    assert (cfg.serve.max_ongoing_requests, cfg.scheduler.max_waiting_requests) == (300, 64)
    assert error_of(None, ["serve.max_ongoing_requests=0"]).startswith("serve.max_ongoing_requests: must be >= 1")


def test_prefill_graph_ceiling_ignored_without_prefill_graphs():
    cfg = load_config(None, ["graphs.prefill.max_tokens=4096", "graphs.capture=decode"])
    assert cfg.graphs.prefill.max_tokens == 4096
    assert not cfg.graphs.uses_prefill_graphs


def test_non_mapping_yaml_names_file(tmp_path):
    path = write(tmp_path, "- a\n- b\n")
    msg = error_of(path)
    assert str(path) in msg and "must be a mapping" in msg and "(list)" in msg


def test_unparsable_yaml_names_file(tmp_path):
    path = write(tmp_path, "graphs: [unclosed\n")
    msg = error_of(path)
    assert msg.startswith(f"{path}: invalid YAML")


def test_missing_file_names_file(tmp_path):
    path = tmp_path / "missing.yaml"
    assert error_of(path).startswith(f"{path}: cannot read config file")


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


# --- overrides -------------------------------------------------------------------------------


def test_overrides_apply_on_top_of_file(tmp_path):
    path = write(tmp_path, "graphs:\n  decode:\n    backend: eager\n")
    cfg = load_config(path, [
        "graphs.decode.backend=full",
        "graphs.decode.batch_sizes=[1,2,4]",
        "serve.api_key=null",
        "model.path=/models/llama",
        "graphs.enabled=false",
        "graphs.memory_budget=4GiB",
        "cache.gpu_memory_fraction=0.5",
    ])
    assert cfg.graphs.decode.backend == "full"
    assert cfg.graphs.decode.batch_sizes == (1, 2, 4)
    assert cfg.serve.api_key is None
    assert cfg.model.path == "/models/llama"
    assert cfg.graphs.enabled is False
    assert cfg.graphs.memory_budget == "4GiB"
    assert cfg.graphs.resolved_memory_budget(free_bytes=10**12) == 4 * 2**30
    assert cfg.cache.gpu_memory_fraction == 0.5


def test_override_null_resets_optional_value(tmp_path):
    path = write(tmp_path, "cache:\n  num_pages: 100\n")
    assert load_config(path).cache.num_pages == 100
    assert load_config(path, ["cache.num_pages=none"]).cache.num_pages is None
    assert load_config(path, ["cache.num_pages=null"]).cache.num_pages is None
    assert load_config(None, ["serve.api_key='none'"]).serve.api_key == "none"


def test_override_unknown_path_fails_like_yaml_typo(tmp_path):
    from_override = error_of(None, ["scheduler.chunked_prefil_size=4096"])
    from_yaml = error_of(write(tmp_path, "scheduler:\n  chunked_prefil_size: 4096\n"))
    assert from_override == from_yaml
    assert error_of(None, ["nope.x=1"]).startswith("nope: unknown key")


def test_malformed_override():
    assert "expected KEY=VALUE" in error_of(None, ["graphs.enabled"])
    assert "expected KEY=VALUE" in error_of(None, ["graphs..enabled=true"])
    assert "value is not valid YAML" in error_of(None, ["graphs.decode.batch_sizes=[1, 2"])


def test_with_overrides_returns_validated_copy():
    base = load_config()
    cfg = with_overrides(base, ["graphs.decode.backend=eager", "scheduler.max_running_requests=8"])
    assert cfg.graphs.decode.backend == "eager" and cfg.scheduler.max_running_requests == 8
    assert base == Config()
    with pytest.raises(ConfigError, match=r"graphs\.decode\.backend: invalid value 'ful'"):
        with_overrides(base, ["graphs.decode.backend=ful"])


# --- round trip and helpers ------------------------------------------------------------------


def test_round_trip():
    cfg = load_config(None, [
        "graphs.decode.batch_sizes=[1, 8, 32]",
        "graphs.prefill.token_buckets=[1024, 8192]",
        "graphs.memory_budget=0.25",
        "model.path=/m",
        "cluster.mode=disaggregated",
    ])
    data = cfg.to_dict()
    assert data["graphs"]["decode"]["batch_sizes"] == [1, 8, 32]
    assert Config.from_dict(data) == cfg
    assert Config.from_dict(yaml.safe_load(yaml.safe_dump(data))) == cfg


def test_config_chain_and_group_sections():
    cfg = load_config(None, ["serve.api_key=secret", "cluster.tp_size=2"])
    assert isinstance(cfg, GroupConfig) and isinstance(cfg, EngineConfig)
    group = GroupConfig.of(cfg)
    assert type(group) is GroupConfig and list(group.to_dict()) == list(cfg.to_dict())[:-1]
    assert "serve" not in group.to_dict() and group.cluster.tp_size == 2 and group.graphs == cfg.graphs
    assert GroupConfig.from_dict(group.to_dict()) == group
    with pytest.raises(ConfigError, match=r"^serve: unknown key; allowed keys: model, .*, cluster$"):
        GroupConfig.from_dict(cfg.to_dict())


def test_section_from_dict():
    assert DecodeGraphConfig.from_dict({"backend": "eager"}).backend == "eager"
    with pytest.raises(ConfigError, match=r"^max_batch_size: must be >= 1, got 0$"):
        DecodeGraphConfig.from_dict({"max_batch_size": 0})


def test_resolved_defaults():
    cfg = Config()
    assert cfg.model.resolved_device(cuda_available=False) == "cpu"
    assert cfg.model.resolved_dtype("cuda") == "bfloat16"
    assert cfg.model.resolved_dtype("cpu") == "float32"
    assert cfg.graphs.prefill.resolved_max_tokens(8192) == 8192
    assert cfg.graphs.prefill.resolved_num_request_slots(8192) == 16
    assert cfg.graphs.prefill.resolved_num_request_slots(256) == 1
    # Never more slots than requests a step can carry; mixed steps take one per running request.
    assert cfg.graphs.prefill.resolved_num_request_slots(8192, 4) == 4
    assert cfg.graphs.prefill.resolved_num_request_slots(8192, 256, mixed_steps=True) == 256
    assert cfg.graphs.resolved_memory_budget(1000) is None
    assert with_overrides(cfg, ["graphs.memory_budget=0.5"]).graphs.resolved_memory_budget(1000) == 500
    assert with_overrides(cfg, ["graphs.memory_budget=1000000"]).graphs.resolved_memory_budget(1) == 10**6


@pytest.mark.parametrize(
    "text, expected",
    [
        ("4GiB", 4 * 2**30),
        ("512MB", 512 * 10**6),
        ("1.5 gib", 3 * 2**29),
        ("1048576", 2**20),
        ("2Ki", 2048),
        ("1e3", 1000),
        ("10b", 10),
        (123, 123),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["", "GiB", "4 GiBs", "-1GB", "4.2.1MB", -5, True, 1.5])
def test_parse_bytes_rejects(bad):
    with pytest.raises(ValueError):
        parse_bytes(bad)
