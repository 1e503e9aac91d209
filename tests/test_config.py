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
        ({**MINIMAL, "jacobian": {"wrt": "parameters", "objective": "Margin", "labels": {"key": "y"}}},
         r"^config: jacobian.objective: 'Margin' is not one of outputs, margin, or \{loss: .*; did you mean margin\?$"),
        ({**MINIMAL, "jacobian": {"wrt": "parameter", "objective": "margin", "labels": {"key": "y"}}},
         r"jacobian.objective: .*\(wrt is \['parameter'\]: did you mean parameters\?\)$"),
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


def test_malformed_yaml_is_one_line_naming_where(tmp_path):
    """PyYAML's message quotes the text over several lines with a caret; the error is one line."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {builtin: mlp\ninput: x\n")
    with pytest.raises(config.ConfigError) as found:
        config.load(bad)
    assert str(found.value) == (f"{bad} is not valid YAML: expected ',' or '}}', but got ':' at line 2, column 6 "
                                "(while parsing a flow mapping)")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(MINIMAL))
    with pytest.raises(config.ConfigError) as found:
        config.load(path, ["input.paths=[unclosed"])
    assert str(found.value) == ("--set input.paths: value '[unclosed' is not valid YAML: expected ',' or ']', but got "
                                "'<stream end>' at line 1, column 10 (while parsing a flow sequence)")


def test_shipped_configs_are_valid_and_demo_yaml_is_the_builtin_demo():
    configs = Path(__file__).parent.parent / "configs"
    for path in configs.glob("*.yaml"):
        config.load(path)
    assert config.load(configs / "demo.yaml") == config.validate(demo.demo_config())


def _file(tmp_path, raw=MINIMAL):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _message(path, overrides=()):
    with pytest.raises(config.ConfigError) as caught:
        config.load(path, overrides)
    return str(caught.value)


def test_a_problem_set_by_an_override_is_blamed_on_the_override_not_the_file(tmp_path):
    path = _file(tmp_path)
    assert _message(path, ["jacobian.batchsize=8"]) == "--set jacobian.batchsize: unknown key; did you mean batch_size?"
    assert _message(path, ["jacobian={batchsize: 8}"]) == "--set jacobian.batchsize: unknown key; did you mean batch_size?"
    assert _message(path, ["jacobian.batch_size=0"]) == (
        "--set jacobian.batch_size: Input should be greater than 0 (got 0)"
    )
    assert _message(path, ["foo"]) == "--set expects KEY=VALUE (e.g. output.path=out/), got 'foo'"
    assert _message(path, ["foo=1"]) == "--set foo: unknown key"
    # The file's own problems name the file; an override of another key does not take them over.
    path = _file(tmp_path, {**MINIMAL, "jacobian": {"batchsize": 8}})
    assert _message(path, ["jacobian.mode=forward"]) == f"{path}: jacobian.batchsize: unknown key; did you mean batch_size?"
    assert _message(path, ["jacobian.mode=forwrd"]) == (
        f"{path} is not valid:\n"
        "  --set jacobian.mode: Input should be 'auto', 'reverse', 'reverse_loop', 'forward' or 'autotune' "
        "(got 'forwrd'); did you mean forward?\n"
        "  jacobian.batchsize: unknown key; did you mean batch_size?"
    )


@pytest.mark.parametrize(
    "raw, message",
    [
        ({**MINIMAL, "jacobain": {}}, "jacobain: unknown key; did you mean jacobian?"),
        ({**MINIMAL, "output": {"path": "o", "samples_per_shrad": 3}}, "output.samples_per_shrad: unknown key; "
         "did you mean samples_per_shard?"),
        ({**MINIMAL, "input": {"paths": "x", "image": {"chanels": 1}}}, "input.image.chanels: unknown key; "
         "did you mean channels?"),
        ({**MINIMAL, "jacobian": {"self_check": {"sample": 1}}}, "jacobian.self_check.sample: unknown key; "
         "did you mean samples?"),
        ({**MINIMAL, "jacobian": {"zzz": 1}}, "jacobian.zzz: unknown key"),
    ],
)
def test_an_unknown_key_suggests_the_closest_key_of_its_section(raw, message):
    with pytest.raises(config.ConfigError) as caught:
        config.validate(raw)
    assert str(caught.value) == f"config: {message}"


@pytest.mark.parametrize("outputs", ["foo", [-1], {"top_kk": 2}, {"top_k": 0}, 2.5])
def test_a_bad_outputs_value_lists_what_is_accepted(tmp_path, outputs):
    path = _file(tmp_path, {**MINIMAL, "jacobian": {"outputs": outputs}})
    assert _message(path) == (
        f"{path}: jacobian.outputs: {outputs!r} is not one of all, argmax, label, a list of output indices such "
        "as [3, 7], or {top_k: K}"
    )


def test_a_list_key_takes_a_single_string_validated_as_a_list_of_one(tmp_path):
    path = _file(tmp_path)
    cfg = config.load(path, ["jacobian.aggregate=mean_abs", "jacobian.wrt=image", "input.paths=a/*.npy"])
    assert (cfg.jacobian.aggregate, cfg.jacobian.wrt, cfg.input.paths) == (["mean_abs"], ["image"], ["a/*.npy"])
    assert config.load(path, ["jacobian.wrt=all"]).jacobian.wrt == "all"
    assert _message(path, ["jacobian.aggregate=mean_ab"]) == (
        "--set jacobian.aggregate[0]: Input should be 'mean', 'mean_abs' or 'jtj' (got 'mean_ab'); did you mean mean_abs?"
    )
    assert _message(path, ["jacobian.aggregate=mean", "jacobian.reduce=vjp", "jacobian.vectors=u.npy"]) == (
        "--set jacobian.aggregate: needs the Jacobian, which reduce: vjp never forms"
    )


def test_problems_of_overrides_alone_are_listed_one_per_line_under_the_overrides(tmp_path):
    assert _message(_file(tmp_path), ["jacobian.threads=0", "output.compresion=gzip"]) == (
        "the --set overrides are not valid:\n"
        "  --set jacobian.threads: 0 is not one of auto, or a positive integer\n"
        "  --set output.compresion: unknown key; did you mean compression?"
    )


def test_a_path_in_the_home_folder_is_expanded_as_a_shell_would(tmp_path, monkeypatch):
    """``~/...`` in a config file or a quoted ``--set`` (which no shell expands): the user's home, for every
    path key; ``output.path=~/out`` made a folder named ``~`` in the working directory. Remote URLs stay."""
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump({
        "model": {"path": "~/m.keras"},
        "input": {"paths": "~/data/*.npy"},
        "jacobian": {"labels": {"table": "~/labels.csv"}, "reduce": "vjp", "vectors": "~/u.npy"},
        "output": {"path": "gs://bucket/~out"},
    }))
    loaded = config.load(cfg, ["output.path=~/out"])
    assert loaded.model.path == str(tmp_path / "m.keras")
    assert loaded.input.paths == [str(tmp_path / "data" / "*.npy")]
    assert loaded.jacobian.labels.table == str(tmp_path / "labels.csv")
    assert loaded.jacobian.vectors == str(tmp_path / "u.npy")
    assert loaded.output.path == str(tmp_path / "out")
    assert config.load(cfg, []).output.path == "gs://bucket/~out"
