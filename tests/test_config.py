"""The config contract: known keys with defaults, one clear error naming each bad key."""

from pathlib import Path

import pytest
import yaml

from jacobeam.pipeline import config, demo

MINIMAL = {"model": {"builtin": "mlp"}, "input": {"paths": ["data/*.npy"]}, "output": {"path": "out/"}}


def test_defaults_fill_the_contract_keys():
    cfg = config.validate(MINIMAL)
    assert cfg.jacobian.batch_size == 256
    assert cfg.jacobian.jit_compile is False
    assert cfg.output.samples_per_shard == 4096
    assert cfg.output.compression == "none"
    assert cfg.input.key is None


@pytest.mark.parametrize(
    "raw, message",
    [
        ({**MINIMAL, "jacobain": {}}, r"jacobain: unknown key"),
        ({**MINIMAL, "output": {"path": "o", "samples_per_shrad": 3}}, r"output.samples_per_shrad: unknown key"),
        ({**MINIMAL, "jacobian": {"batch_size": "big"}}, r"jacobian.batch_size: .*integer"),
        ({**MINIMAL, "jacobian": {"batch_size": 0}}, r"jacobian.batch_size: .*greater than 0"),
        ({**MINIMAL, "jacobian": {"memory_budget": "lots"}}, r"jacobian.memory_budget: could not parse value and unit"),
        ({**MINIMAL, "jacobian": {"memory_budget": 0}}, r"jacobian.memory_budget: .*must be a positive size"),
        ({**MINIMAL, "input": {"paths": ["x"], "on_bad_sample": "ignore"}}, r"input.on_bad_sample: .*'error' or 'skip'"),
        ({**MINIMAL, "output": {"path": "o", "compression": "zstd"}}, r"output.compression: .*'none', 'lzf' or 'gzip'"),
        ({"model": {"builtin": "mlp"}, "output": {"path": "o"}}, r"input: required key is missing"),
        ({**MINIMAL, "model": {"builtin": "mlp", "path": "m.keras"}}, r"model: .*exactly one of path, factory or builtin"),
        ({**MINIMAL, "model": {"factory": "no_colon"}}, r"model.factory: .*package.module:callable"),
    ],
)
def test_bad_config_names_the_key(raw, message):
    with pytest.raises(config.ConfigError, match=message):
        config.validate(raw)


def test_set_overrides_parse_values_as_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(MINIMAL))
    cfg = config.load(path, ["input.paths=['a/*.h5', 'b/*.h5']", "jacobian.batch_size=32", "output.path=elsewhere"])
    assert cfg.input.paths == ["a/*.h5", "b/*.h5"]
    assert cfg.jacobian.batch_size == 32
    assert cfg.output.path == "elsewhere"


def test_set_with_an_unknown_key_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(MINIMAL))
    with pytest.raises(config.ConfigError, match=r"jacobian.batchsize: unknown key"):
        config.load(path, ["jacobian.batchsize=3"])
    with pytest.raises(config.ConfigError, match=r"--set expects KEY=VALUE"):
        config.load(path, ["jacobian.batch_size"])


def test_unreadable_or_non_mapping_config_file(tmp_path):
    with pytest.raises(config.ConfigError, match=r"cannot read config file .*missing.yaml"):
        config.load(tmp_path / "missing.yaml")
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    with pytest.raises(config.ConfigError, match=r"list.yaml: expected a YAML mapping"):
        config.load(listing)


def test_shipped_configs_are_valid_and_demo_yaml_is_the_builtin_demo():
    configs = Path(__file__).parent.parent / "configs"
    for path in configs.glob("*.yaml"):
        config.load(path)
    assert config.load(configs / "demo.yaml") == config.validate(demo.demo_config())
