"""docs/configuration.md is generated from the config models, and every key there is described."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jacobeam.pipeline import config, config_reference

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_committed_reference_is_current():
    committed = DOC.read_text(encoding="utf-8") if DOC.exists() else ""
    if committed != config_reference.render():
        pytest.fail(
            f"docs/configuration.md is {'out of date' if committed else 'missing'}: the config models in "
            f"pipeline/config/ changed. Regenerate it with `{config_reference.COMMAND}` and commit it.",
            pytrace=False,
        )


def test_every_leaf_key_has_a_description():
    leaves = {key.dotted: key for key in config_reference.leaf_keys()}
    # The walk reaches every level: top-level sections, their keys, and sections inside sections.
    assert {"model.path", "input.image.scale", "jacobian.labels.key", "jacobian.self_check.samples", "output.path"} <= set(leaves)
    assert not {"model", "input.image", "jacobian.self_check"} & set(leaves)
    assert [dotted for dotted, key in leaves.items() if not key.description.strip()] == []


def test_every_field_of_every_config_model_has_a_description_and_a_docstring():
    reached = config_reference.models()
    assert config.TopK in reached and config.SelfCheckConfig in reached  # inside a union, nested two deep
    missing = [f"{model.__name__}.{name}" for model in reached for name, field in model.model_fields.items()
               if not (field.description or "").strip()]
    assert missing == []
    assert [model.__name__ for model in reached if not (model.__doc__ or "").strip()] == []


def test_the_reference_shows_types_defaults_and_choices():
    keys = {key.dotted: key for key in config_reference.keys()}
    assert keys["output.path"].default == "required"
    assert keys["jacobian.labels"].default == "`null`"  # no default key: labels are given, or absent
    assert keys["jacobian.labels.key"].default == "`null`"  # one of key, folders and table is given
    assert keys["jacobian.labels.folders"].type == "bool"
    assert keys["jacobian.memory_budget"].default == "`2GiB`"
    assert keys["input.image.scale"].default == "`1/255`"
    assert keys["jacobian.jit_compile"].type == "bool or `auto`"
    assert keys["jacobian.mode"].type == "`auto`, `reverse`, `reverse_loop`, `forward` or `autotune`"
    assert "{top_k: int > 0}" in keys["jacobian.outputs"].type
    assert "`2GiB`" not in config_reference.render().split("## `model`")[0]  # sections get their own tables


def test_check_reports_a_stale_file_and_write_fixes_it(tmp_path, capsys):
    page = tmp_path / "configuration.md"
    assert config_reference.main(["--check", "--output", str(page)]) == 1  # missing
    page.write_text("# stale\n")
    assert config_reference.main(["--check", "--output", str(page)]) == 1
    assert config_reference.COMMAND in capsys.readouterr().err
    assert config_reference.main(["--output", str(page)]) == 0
    assert page.read_text() == config_reference.render()
    assert config_reference.main(["--check", "--output", str(page)]) == 0


@pytest.fixture(scope="module")
def imported_by_the_generator():
    """The top-level packages that importing the generator loads, in a fresh interpreter."""
    code = (
        "import json, sys\n"
        "import jacobeam.pipeline.config_reference\n"
        "print(json.dumps(sorted({name.split('.')[0] for name in sys.modules})))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


def test_importing_the_generator_does_not_import_tensorflow(imported_by_the_generator):
    assert not {"tensorflow", "keras"} & imported_by_the_generator


def test_importing_the_generator_does_not_import_apache_beam(imported_by_the_generator):
    assert "apache_beam" not in imported_by_the_generator
