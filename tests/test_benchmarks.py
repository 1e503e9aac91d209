"""The benchmark suite (``python -m benchmarks``): its code path runs, and its rows agree numerically.

Nothing here times anything: speed is read from the suite's own output, never asserted.
"""

from pathlib import Path

import numpy as np
import pytest

from benchmarks.measure import Budget
from benchmarks.suite import WRONG, Plan, run_suite
from benchmarks.workloads import WORKLOADS, weights
from jacobeam.transforms.engine.models import build_cnn, build_mlp

# The CNN, because its layout (channels last, HWIO kernels, flatten order) is where a peer's
# translation of the weights would go wrong; peers run where installed (the `bench` extra).
ROWS = ("tf_eager_loop", "tf_batch_jacobian", "jax_jacrev", "torch_jacfwd", "engine", "pipeline_1proc")


def test_w1_and_w2_weights_are_jacobeams_builtin_weights():
    for name, build in (("mlp", build_mlp), ("cnn", build_cnn)):
        ours = [array for layer in weights(WORKLOADS[name]) for array in layer]
        builtin = build().get_weights()
        assert len(ours) == len(builtin)
        for mine, theirs in zip(ours, builtin):
            np.testing.assert_array_equal(mine, theirs)


@pytest.mark.slow
def test_suite_rows_run_and_agree_with_the_status_quo():
    plan = Plan(
        workloads=("cnn",),
        budget=Budget(repeats=1, seconds=0.0, max_call_seconds=0.0, probe=2),
        e2e_workloads=("cnn",),
        e2e_repeats=1,
        scale=0,
        rows=ROWS,
        samples=4,
        matmul_size=64,
        timeout_s=120.0,
    )
    report = run_suite(plan, say=lambda line: None)

    rows = report.workloads["cnn"]["rows"]
    assert {"tf_eager_loop", "tf_batch_jacobian", "engine", "pipeline_1proc"} <= {row["id"] for row in rows}
    assert rows[0]["id"] == "tf_eager_loop" and rows[0]["reference"]
    for row in rows:
        assert "error" not in row, row["error"]
        assert row["samples_per_second"] > 0 and row["peak_rss_mb"] > 0
        assert row["max_rel_error"] <= WRONG, (row["id"], row["max_rel_error"])
    assert next(row for row in rows if row["id"] == "engine")["vs_engine"] == 1.0


def test_side_by_side_rows_agree_and_are_ratios_to_the_first():
    from benchmarks import sidebyside

    rows = sidebyside.in_memory(WORKLOADS["mlp"], ["engine", "tf_batch_jacobian"], samples=256, repeats=1)

    assert [row["row"] for row in rows] == ["engine", "tf_batch_jacobian"]
    assert rows[0]["ratio"] == 1.0 and rows[0]["max_rel_error"] == 0.0
    assert rows[1]["max_rel_error"] <= WRONG and rows[1]["samples_per_second"] > 0


@pytest.mark.slow
def test_side_by_side_end_to_end_runs_the_pipeline_against_the_engine():
    from benchmarks import sidebyside

    rows = sidebyside.end_to_end(WORKLOADS["mlp"], samples=300, repeats=1)

    assert {row["row"]: row["ratio"] for row in rows}["engine in memory"] == 1.0
    assert all(row["samples_per_second"] > 0 for row in rows)


@pytest.mark.slow
def test_self_check_benchmark_times_the_pipeline_with_and_without_the_check():
    from benchmarks import selfcheck

    found = selfcheck.measure(WORKLOADS["mlp"], samples=300, samples_per_shard=128, repeats=1)

    assert found["shards"] == 3 and found["wall_on"] > 0 and found["wall_off"] > 0
    # The references are built beside the first batches: a first check finds them built, or builds them.
    assert 0 < found["checking"] < found["wall_on"] and (found["first_check"] or found["later_check"]) > 0
    assert found["max_rel_error"] < found["tolerance"] == 1e-4


def test_targets_say_whether_each_goal_is_met():
    from benchmarks.targets import Result, Sizes, table, tasks

    results = [
        Result("1 end to end", "mlp", 0.9, 0.8, True, "x", "a"),
        Result("3 set-up", "cnn", 4.0, 3.0, False, "batches", "b"),
        Result("1 end to end", "mobilenet_v2", 0.9, None, True, "x", "c"),
    ]
    assert [r.met for r in results] == [True, False, None]
    lines = table(results, "abc1234").splitlines()
    assert "abc1234" in lines[0]
    assert [(" yes " in line, " NO " in line) for line in lines[3:]] == [(True, False), (False, True), (False, False)]
    assert tasks(Sizes.quick(), {"setup:resnet50", "processes"}) == ["setup:resnet50", "processes:mlp"]


@pytest.mark.slow
def test_targets_measure_the_pipeline_and_set_up_against_the_hand_written_loop():
    from benchmarks import targets

    (end_to_end,) = targets.end_to_end("mlp", samples=256, repeats=1)
    assert end_to_end.goal == 0.9 and np.isfinite(end_to_end.measured)
    assert "hand-written loop" in end_to_end.detail
    (setup,) = targets.setup("mlp", repeats=1)
    assert setup.measured > 0 and setup.goal == 3.0 and not setup.at_least


@pytest.mark.slow
def test_the_quickstart_target_runs_the_readme_model_at_the_defaults_against_batch_jacobian():
    """The README quickstart's CNN on its bar images: the run at every default, and a hand-written loop
    whose Jacobians are a per-sample tape's."""
    from benchmarks import target_inputs, targets
    from benchmarks.workloads import quickstart
    from jacobeam.pipeline.config.jacobian import JacobianConfig
    from tests.reference import assert_close, tape_loop

    x, labels = target_inputs.samples_of("quickstart", 5)
    assert labels is None and x.shape == (5, 28, 28, 1) and set(np.unique(x)) == {0.0, 1.0}
    assert target_inputs.run_config("quickstart", "x.npy", Path("out")).jacobian == JacobianConfig()
    expected = tape_loop(quickstart(), x)
    assert_close(target_inputs.hand_written("quickstart")(x, None).reshape(expected.shape), expected, rtol=1e-5)
    (end_to_end,) = targets.end_to_end("quickstart", samples=300, repeats=1)
    assert end_to_end.goal == 0.9 and np.isfinite(end_to_end.measured)


@pytest.mark.slow
def test_the_incremental_benchmark_computes_only_the_new_samples_and_times_both_sides():
    from benchmarks import incremental

    found = incremental.measure(base=24, new=8, repeats=1)  # it stops if the increment computed other samples

    assert len(found["runs"]) == len(found["floors"]) == 1
    assert 0 < found["imports"] < found["floor"] and 0 < found["batch"] < found["floor"] and found["version"] > 0


@pytest.mark.slow
def test_the_parameter_side_benchmark_checks_each_rows_gradients_against_a_float64_tape():
    import json
    import subprocess
    import sys

    # In a process of its own, as the benchmark runs each row: W1's projected gradients take gigabytes.
    for task in ("trak", "grand"):
        done = subprocess.run([sys.executable, "-m", "benchmarks.parameters", "--row", "jacobeam", "--model", "mlp",
                               "--samples", "64", "--batch", "64", "--task", task], capture_output=True, text=True,
                              check=True)
        result = json.loads(done.stdout.strip().splitlines()[-1])
        assert result["error"] < 1e-5 and result["samples_per_second"] > 0 and result["path"] == "layer rules", task
