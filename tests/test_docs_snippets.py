"""Every code block of the README and the docs is checked (``tests/docs_snippets.py`` says how): the
``python`` and ``sh`` ones run in ``tests/test_readme.py``; here the YAML configs validate, every
``jacobeam`` command line parses (Beam options and ``--set`` overrides too), and the Python that needs a
service CI cannot have compiles and imports what it names of jacobeam."""

from __future__ import annotations

import copy
import importlib

import pytest
import yaml

from jacobeam.pipeline import cli, config
from jacobeam.pipeline.config.loading import apply_override, parse_override
from jacobeam.transforms.errors import JacobeamError
from tests.docs_snippets import ROOT, jacobeam_commands, jacobeam_imports, snippets

SNIPPETS = snippets()
RUN_HERE = ("run", "validate", "synopsis")
# What a config fragment in the docs is laid over: the least a config must say.
MINIMAL = {"model": {"builtin": "mlp"}, "input": {"paths": ["data/*.npy"]}, "output": {"path": "out"}}


def test_every_block_says_how_it_is_checked():
    kinds = {"python", "sh", "yaml", "cron"}
    for snippet in SNIPPETS:
        assert snippet.kind in kinds, f"{snippet.name}: a block of a kind no test checks"
        assert snippet.how in RUN_HERE or snippet.how.startswith("needs "), f"{snippet.name}: {snippet.how!r}"
        if snippet.how == "validate":
            assert snippet.kind == "yaml", f"{snippet.name}: only YAML is validated"
    # The blocks that cannot run here are few and say what they need.
    assert sum(s.how.startswith("needs ") for s in SNIPPETS) <= 16


def _merged(base: dict, fragment: dict) -> dict:
    """``fragment``'s sections over ``base``'s, key by key; a model given replaces the minimal one (a
    config names exactly one)."""
    merged = copy.deepcopy(base)
    for section, values in fragment.items():
        if section == "model" or not isinstance(values, dict):
            merged[section] = values
        else:
            merged[section] = {**merged.get(section, {}), **values}
    return merged


@pytest.mark.parametrize("snippet", [s for s in SNIPPETS if s.kind == "yaml"], ids=lambda s: s.name)
def test_yaml_blocks_are_valid_configs(snippet):
    fragment = yaml.safe_load(snippet.body)
    assert isinstance(fragment, dict) and fragment, snippet.name
    validated = config.validate(_merged(MINIMAL, fragment), snippet.name)
    given = config.to_dict(validated)
    for section, values in fragment.items():  # what the block sets is what the config holds
        assert section in given
        for key in values if isinstance(values, dict) else ():
            assert key in given[section], f"{snippet.name}: {section}.{key} is not a config key"


def _commands():
    for snippet in SNIPPETS:
        if snippet.kind in ("sh", "cron"):
            for k, args in enumerate(jacobeam_commands(snippet)):
                yield pytest.param(snippet, args, id=f"{snippet.name}:{k}")


@pytest.mark.parametrize("snippet, args", list(_commands()))
def test_jacobeam_command_lines_parse(snippet, args):
    parser = cli._parser()
    argv, passthrough = cli._split_at_double_dash(args)
    try:
        parsed, beam_args = parser.parse_known_args(argv)
    except SystemExit as exit_:  # argparse: --help exits 0, a bad argument 2
        assert exit_.code == 0 and "--help" in argv, f"{snippet.name}: {args}"
        return
    cli._check_beam_args(beam_args + passthrough)  # inspect and verify take file-system options
    if parsed.command == "run":
        overrides = parsed.overrides
        raw = yaml.safe_load((ROOT / parsed.config).read_text()) if (ROOT / parsed.config).is_file() else copy.deepcopy(MINIMAL)
        for text in overrides:
            apply_override(raw, *parse_override(text))
        config.validate(raw, snippet.name, [])


@pytest.mark.parametrize("snippet", [s for s in SNIPPETS if s.kind == "python"], ids=lambda s: s.name)
def test_python_blocks_compile_and_name_what_jacobeam_has(snippet):
    compile(snippet.body, snippet.name, "exec")
    for module, names in jacobeam_imports(snippet.body):
        imported = importlib.import_module(module)
        missing = [name for name in names if not hasattr(imported, name)]
        assert not missing, f"{snippet.name}: {module} has no {missing}"


def test_a_wrong_command_line_in_the_docs_would_fail():
    """The checks above can fail: a renamed option or a misspelt config key is caught."""
    from tests.docs_snippets import Snippet

    bad_option = Snippet("x.md", 0, "sh", "jacobeam run configs/mnist_cnn.yaml --direct_num_worker 2\n", "run")
    (args,) = jacobeam_commands(bad_option)
    with pytest.raises(JacobeamError, match="did you mean --direct_num_workers"):
        test_jacobeam_command_lines_parse(bad_option, args)
    bad_key = Snippet("x.md", 0, "sh", "jacobeam run configs/mnist_cnn.yaml --set jacobian.batchsize=4\n", "run")
    (args,) = jacobeam_commands(bad_key)
    with pytest.raises(JacobeamError, match="batch_size"):
        test_jacobeam_command_lines_parse(bad_key, args)
    with pytest.raises(JacobeamError):
        test_yaml_blocks_are_valid_configs(Snippet("x.md", 0, "yaml", "input:\n  on_bad_sample: sometimes\n", "validate"))
