"""The config schema: presets load, YAML round-trips, every class of bad input names its field."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest
import yaml

from configs import ClusterConfig, ConfigError, available_presets, config_to_yaml, load_config


@pytest.mark.parametrize("preset", available_presets())
def test_every_preset_loads(preset: str) -> None:
    config = load_config(preset)
    assert isinstance(config, ClusterConfig)


def test_presets_cover_local_and_tiny() -> None:
    assert {"local", "tiny"} <= set(available_presets())
    local = load_config("local")
    assert (local.workers.num_prefill, local.workers.num_decode) == (1, 1)
    assert local.model.source == "gemma-3-270m"
    assert load_config("tiny").model.source.startswith("tiny-")


def test_defaults_equal_the_local_preset() -> None:
    # The embedded default and the `local` preset describe the same cluster, apart from the
    # fields the preset spells out differently on purpose (pinning, max running requests, ray CPUs).
    local = load_config("local")
    default = ClusterConfig()
    assert default.model == local.model
    assert default.workers == local.workers
    assert default.transfer == local.transfer


@pytest.mark.parametrize("preset", available_presets())
def test_yaml_round_trip(preset: str, tmp_path: Path) -> None:
    config = load_config(preset, ["workers.num_decode=3", "router.imbalance_ratio=1.5"])
    path = tmp_path / "resolved.yaml"
    path.write_text(config_to_yaml(config))
    assert load_config(path) == config


def test_overrides_parse_yaml_values() -> None:
    config = load_config(
        "tiny",
        [
            "workers.num_decode=2",
            "kv_cache.prefix_caching=false",
            "router.policy=round_robin",
            "router.pins=[{text: 'You are a helpful assistant.', replicas: 2, ttl_s: 30}]",
            "workers.prefill.custom_resources={prefill: 1}",
        ],
    )
    assert config.workers.num_decode == 2
    assert config.kv_cache.prefix_caching is False
    assert config.router.policy == "round_robin"
    assert config.router.pins[0].replicas == 2
    assert config.workers.prefill.custom_resources == {"prefill": 1.0}


def test_override_into_a_list_item() -> None:
    config = load_config("tiny", ["router.pins=[{token_ids: [1, 2, 3]}]", "router.pins.0.replicas=2"])
    assert config.router.pins[0].replicas == 2


def test_configs_are_frozen() -> None:
    config = load_config("tiny")
    with pytest.raises(pydantic.ValidationError):
        config.workers.num_decode = 5  # type: ignore[misc]
    copy = config.model_copy(update={"workers": config.workers.model_copy(update={"num_decode": 4})})
    assert copy.workers.num_decode == 4 and config.workers.num_decode == 1


def _error(preset: str, overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(preset, overrides)
    return str(info.value)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        # out of range
        ("workers.num_decode=-1", "workers.num_decode: must be >= 1 (got -1)"),
        ("kv_cache.block_size=0", "kv_cache.block_size: must be >= 1 (got 0)"),
        ("router.imbalance_ratio=0.5", "router.imbalance_ratio: must be >= 1.0 (got 0.5)"),
        ("router.replicas=0", "router.replicas: must be >= 1 (got 0)"),
        ("router.replicas=65", "router.replicas: must be <= 64 (got 65)"),
        ("transfer.read_timeout_s=0", "transfer.read_timeout_s: must be > 0.0 (got 0)"),
        # unknown field
        ("workers.num_decoder=2", "workers.num_decoder: unknown field (got 2)"),
        ("nonsense=1", "nonsense: unknown field (got 1)"),
        # wrong type
        ("kv_cache.block_size=abc", "kv_cache.block_size: must be an integer (got 'abc')"),
        ("kv_cache.prefix_caching=maybe", "kv_cache.prefix_caching: must be true or false (got 'maybe')"),
        ("workers=3", "workers: must be a mapping (got 3)"),
        ("transfer.backend=rdma", "transfer.backend: must be one of 'nixl' or 'local' (got 'rdma')"),
        ("model.source=not-a-model", "model.source: unknown model name 'not-a-model'"),
        # inconsistent combinations
        (
            "scheduler.prefill_chunk_size=2",
            "scheduler.prefill_chunk_size: must be >= kv_cache.block_size (4) (got 2)",
        ),
        (
            "kv_cache.pinning.budget_blocks=1000",
            "kv_cache.pinning.budget_blocks: must be <= kv_cache.num_blocks (256) (got 1000)",
        ),
        (
            "kv_cache.memory_budget_mib=64",
            "kv_cache.num_blocks: set either num_blocks or memory_budget_mib, not both",
        ),
        (
            "kv_cache.gpu_memory_utilization=0.9",
            "kv_cache.gpu_memory_utilization: set either num_blocks or gpu_memory_utilization, not both",
        ),
        ("kv_cache.gpu_memory_utilization=1.5", "kv_cache.gpu_memory_utilization: must be <= 1.0 (got 1.5)"),
        ("kv_cache.gpu_memory_utilization=nan", "kv_cache.gpu_memory_utilization: must be <= 1.0 (got 'nan')"),
        ("kv_cache.gpu_memory_utilization=0", "kv_cache.gpu_memory_utilization: must be > 0.0 (got 0)"),
        (
            "scheduler.prefill_chunk_size=4096",
            "scheduler.prefill_chunk_size: must be <= scheduler.max_num_batched_tokens (256) (got 4096)",
        ),
        (
            "router.pins=[{text: hi, replicas: 3}]",
            "router.pins.0.replicas: must be <= the number of workers (2) (got 3)",
        ),
        ("router.pins=[{replicas: 1}]", "router.pins.0.text: give exactly one of text or token_ids"),
        ("transfer.release_timeout_s=1", "transfer.release_timeout_s: must be > transfer.read_timeout_s (3.0) (got 1"),
    ],
)
def test_bad_input_names_field_and_value(override: str, expected: str) -> None:
    assert expected in _error("tiny", [override])


def test_pins_need_the_pinned_tier() -> None:
    message = _error("tiny", ["kv_cache.pinning.enabled=false", "router.pins=[{text: hi}]"])
    assert message.startswith("router.pins: pinned prefixes need kv_cache.pinning.enabled=true")


@pytest.mark.parametrize("override", ["workers.num_decode", "=3", "workers..num_decode=1", ".x=1"])
def test_malformed_override(override: str) -> None:
    message = _error("tiny", [override])
    assert message.startswith(f"override {override!r}: expected dotted.key=value")


def test_override_through_a_scalar_names_the_scalar() -> None:
    assert _error("tiny", ["workers.num_decode.x=1"]).startswith("workers.num_decode: cannot set")


def test_unknown_preset_lists_the_available_ones() -> None:
    message = _error("no-such-preset", [])
    assert message.startswith("config: unknown preset 'no-such-preset' (available: ")
    assert "local" in message and "tiny" in message


def test_missing_file_and_bad_yaml(tmp_path: Path) -> None:
    assert "config: no such file" in _error(str(tmp_path / "absent.yaml"), [])
    bad = tmp_path / "bad.yaml"
    bad.write_text("workers: [unclosed\n")
    assert "is not valid YAML" in _error(str(bad), [])
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    assert "must hold a mapping" in _error(str(scalar), [])


def test_several_problems_are_all_reported(tmp_path: Path) -> None:
    path = tmp_path / "many.yaml"
    path.write_text(yaml.safe_dump({"workers": {"num_decode": 0, "num_prefill": -2}, "bogus": 1}))
    problems = _error(str(path), []).splitlines()
    assert "workers.num_decode: must be >= 1 (got 0)" in problems
    assert "workers.num_prefill: must be >= 0 (got -2)" in problems
    assert "bogus: unknown field (got 1)" in problems


def test_serve_defaults_bind_loopback_on_8000() -> None:
    serve = load_config("local").serve
    assert (serve.host, serve.port, serve.api_key, serve.served_model_name) == ("127.0.0.1", 8000, None, None)
    assert serve.ingress_replicas == 1 and serve.max_queued_requests >= 1


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("serve.port=0", "serve.port: must be >= 1 (got 0)"),
        ("serve.port=70000", "serve.port: must be <= 65535 (got 70000)"),
        ("serve.port=abc", "serve.port: must be an integer (got 'abc')"),
        ("serve.host=' '", "serve.host: must not be empty"),
        ("serve.api_key=''", "serve.api_key: must not be empty"),
        ("serve.max_queued_requests=0", "serve.max_queued_requests: must be >= 1 (got 0)"),
        ("serve.ingress_replicas=-1", "serve.ingress_replicas: must be >= 1 (got -1)"),
        ("serve.graceful_shutdown_timeout_s=0", "serve.graceful_shutdown_timeout_s: must be > 0.0 (got 0)"),
        ("serve.graceful_shutdown_timeout_s=.nan", "serve.graceful_shutdown_timeout_s"),
        ("serve.bogus=1", "serve.bogus: unknown field (got 1)"),
    ],
)
def test_bad_serve_values_name_their_field(override: str, expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config("tiny", [override])
    assert expected in str(caught.value)


def test_the_api_key_comes_from_the_environment_first(monkeypatch: pytest.MonkeyPatch) -> None:
    from serving.api import resolve_api_key

    serve = load_config("tiny", ["serve.api_key=from-config"]).serve
    monkeypatch.delenv(serve.api_key_env, raising=False)
    assert resolve_api_key(serve) == "from-config"
    monkeypatch.setenv(serve.api_key_env, "from-env")
    assert resolve_api_key(serve) == "from-env"


def test_gpu_memory_utilization_needs_a_cuda_device() -> None:
    message = _error("tiny", ["kv_cache.num_blocks=null", "kv_cache.gpu_memory_utilization=0.9"])
    assert "kv_cache.gpu_memory_utilization: needs model.device=cuda (got 'cpu')" in message
    config = load_config(
        "tiny", ["kv_cache.num_blocks=null", "kv_cache.gpu_memory_utilization=0.9", "model.device=cuda"]
    )
    assert config.kv_cache.gpu_memory_utilization == 0.9


@pytest.mark.parametrize(
    ("device", "dtype", "resolved"),
    [
        ("cpu", "auto", "float32"),
        ("cuda", "auto", "bfloat16"),
        ("cuda", "float32", "float32"),
        ("cpu", "bfloat16", "bfloat16"),
    ],
)
def test_auto_dtype_is_bf16_on_cuda_and_fp32_on_the_cpu(device: str, dtype: str, resolved: str) -> None:
    config = load_config("tiny", [f"model.device={device}", f"model.dtype={dtype}"])
    assert config.model.resolved_dtype == resolved
