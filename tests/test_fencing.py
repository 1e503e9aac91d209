"""Nothing lost to a run that lost its folder (issue 36): a run paused past the lease's stale time and taken
over commits nothing more when it resumes, and a live run is never taken over on a guess (another PID
namespace on this host, a clock 400 s ahead). Real ``jacobeam run`` processes, paused with SIGSTOP, held
at fault points (``transforms.testing.faults``)."""

import json
import shutil

import pytest

from jacobeam.transforms.output.layout import LEASE
from jacobeam.transforms.testing import faults
from tests import takeover
from tests.services import JacobeamRuns

pytestmark = pytest.mark.slow

QUICK_LEASE = takeover.QUICK_LEASE


@pytest.fixture
def runs():
    started = JacobeamRuns()
    yield started
    started.stop()


def _files(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_run_paused_past_the_stale_time_and_taken_over_commits_nothing_when_it_resumes(tmp_path, runs):
    """Locally the fence is checked under the folder's lock, which the take-over takes too."""
    out = tmp_path / "out"
    takeover.paused_and_taken_over(tmp_path, runs, str(out), [], lambda: _files(out),
                                   lambda: json.loads((out / LEASE).read_text()))


@pytest.mark.parametrize("other", ["pid_namespace", "clock_400_s_ahead"])
def test_a_live_run_is_not_taken_over_on_a_guess(tmp_path, runs, other):
    """The first run is alive and holds the folder (held after planning). A second run in another PID
    namespace of this host (its pid means nothing here), or one whose clock is 400 s ahead (the
    heartbeat looks stale by the clocks), is refused with 75; the first then finishes."""
    takeover.write_data(tmp_path)
    out, go = tmp_path / "out", tmp_path / "go"
    config = takeover.config(tmp_path, "run", str(out), "tests.models:small_mlp")
    prefix, env = (), dict(QUICK_LEASE)
    if other == "pid_namespace":
        if shutil.which("unshare") is None:
            pytest.skip("no unshare")
        # A PID namespace of its own (as a container with this host name): a few processes first, so that
        # its pid inside is not one of the low pids every system has outside.
        prefix = ("unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc", "sh", "-c",
                  'for i in 1 2 3 4 5 6 7 8 9; do /bin/true; done; exec "$@"', "sh")
    first = runs.start(["-q", "run", config], tmp_path / "first", {**env, faults.HOLD_AT: f"plan:{go}"}, prefix)
    takeover.wait_for(tmp_path / "go.held", first, tmp_path / "first.err")
    holder = json.loads((out / LEASE).read_text())
    second_env = dict(QUICK_LEASE)
    if other == "pid_namespace":
        from jacobeam.transforms.output import lease

        if holder["pid_namespace"] == lease._machine()["pid_namespace"]:
            pytest.skip("unshare gave no PID namespace of its own here")
    else:
        second_env[faults.CLOCK_OFFSET] = "400"
    second = runs.start(["-q", "run", config], tmp_path / "second", second_env)
    assert second.wait(timeout=300) == 75, (tmp_path / "second.err").read_text()[-3000:]
    assert first.poll() is None
    assert json.loads((out / LEASE).read_text())["holder"] == holder["holder"]
    assert f"is being written by run {holder['holder']} " in (tmp_path / "second.err").read_text()
    go.touch()
    assert first.wait(timeout=300) == 0, (tmp_path / "first.err").read_text()[-3000:]
    assert (out / "manifest.json").exists() and not (out / LEASE).exists()
