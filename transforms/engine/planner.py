"""Choosing how to compute: the mode, XLA or not, double reverse, and block sizes, as one ``Plan``.

Each candidate path runs on a seeded probe batch; the plain graph of the first mode is the reference
every other path must agree with before it is trusted (a fast path can be wrong: forward mode through
max-pooling under XLA is, double reverse through image resizing is). Where nothing is timed, the
reference is the mode run eagerly (forward: the accumulator; reverse, where a faster path is tried beside
pfor's ``batch_jacobian``: one-hot cotangents through copies of the probe batch): no tracing, where pfor
takes seconds to trace on a deep model and most of set-up on a small one; and the paths run in the order
of preference, the first to agree being taken: what set-up costs is then one eager pass and, as a rule,
one traced path. A path that TensorFlow cannot run (no XLA kernel, no pfor or forward-mode rule) is left
out with a reason; an error raised by jacobeam's own code is a bug and surfaces as itself.

Agreement is judged per sample (``disagreement``): a sample whose Jacobian is small against the batch's
cannot hide a wrong derivative behind the batch's largest entry. The plan keeps the reference it was
checked against (``Planner.reference``), which the engine runs once more on its first real batch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from jacobeam.transforms.engine.blocks import MODES, ForwardModeUnsupported, Path
from jacobeam.transforms.engine.budget import Sizes
from jacobeam.transforms.engine.diagnostics import (
    AGREEMENT,
    capture_pfor_fallbacks,
    full_tracebacks,
    per_sample_relative_error,
    raised_by_jacobeam,
)
from jacobeam.transforms.engine.executor import Plan
from jacobeam.transforms.engine.layer_rules import NoLayerRule
from jacobeam.transforms.engine.operands import Operands
from jacobeam.transforms.errors import ModelError
from jacobeam.transforms.spec import EngineOptions

log = logging.getLogger(__name__)

# Errors with which TensorFlow says it cannot run a path (besides its own OpError).
_CANNOT_RUN = (tf.errors.OpError, ValueError, TypeError, NotImplementedError, LookupError)

Run = Callable[[Plan, Sequence[np.ndarray], "np.ndarray | None"], tuple[Plan, dict]]


def disagreement(result: dict, reference: dict) -> float:
    """How far one path's results are from the reference's (``{"output": (n, m), k: (n, r, c)}``): the
    largest per-sample relative error over the outputs and every differentiated input."""
    return max(per_sample_relative_error(result[k], reference[k]) for k in reference)


@dataclass
class _Search:
    """One ``Planner._first_good`` call's state, carried across its modes: the reference path's results
    and plan (the first path to run), and the best plan so far with its rank."""

    modes: list[str]
    notes: list[str]
    tried: list[dict[str, Any]]  # the telemetry's candidates
    timed: bool
    probe_samples: int
    reference_result: dict | None = None
    reference_plan: Plan | None = None
    best: tuple[tuple, Plan] | None = None


class Planner:
    """Finds the plan for one engine.

    ``size(mode)`` gives the block sizes of a mode within the memory budget; ``run(plan, xs, index)``
    computes with a plan (re-planning smaller on out-of-memory) and returns the plan it ended with and
    the results; ``forward(xs)`` evaluates the model; ``probe(n)`` gives ``n`` seeded samples.
    ``telemetry`` receives the candidates tried and the ops pfor could not vectorise. After ``choose``,
    ``reference`` is the plan of the reference path the chosen plan agreed with (its blocks traced, or
    the eager accumulator), or None where the chosen plan is the reference itself or nothing was compared.
    """

    def __init__(
        self,
        options: EngineOptions,
        operands: Operands,
        wrt: Sequence[int],
        source: str,
        size: Callable[[str], Sizes],
        run: Run,
        forward: Callable[[Sequence[np.ndarray]], np.ndarray],
        probe: Callable[[int], list[np.ndarray]],
        probe_samples: int,
        telemetry: dict[str, Any],
        layer_rules: bool = False,
        reverse_layer_rules: bool = False,
    ):
        self._options, self._operands, self._wrt, self._source = options, operands, wrt, source
        self._size, self._run, self._forward, self._probe = size, run, forward, probe
        self._probe_samples = probe_samples
        self._telemetry = telemetry
        self._layer_rules = layer_rules  # every layer of the model has a forward rule (layer_rules.unsupported)
        self._reverse_layer_rules = reverse_layer_rules  # and a reverse rule (reverse_layer_rules.reverse_unsupported)
        self.reference: Plan | None = None

    def choose(self) -> Plan:
        modes, reason = self._candidates()
        notes = [reason]
        plan = self._first_good(modes, notes)
        fallbacks = [mode for mode in ("reverse", "reverse_loop") if mode not in modes]
        if plan is None and self._options.mode in ("auto", "autotune") and fallbacks:
            # The plain loop over outputs is last: it needs neither forward-mode rules nor pfor.
            notes.append(f"{', '.join(modes)} failed: trying {', '.join(fallbacks)}")
            plan = self._first_good(fallbacks, notes)
        if plan is None:
            hint = "; use jit_compile auto or false" if self._options.jit_compile is True else ""
            raise ModelError(f"{self._source}: no way to compute Jacobians worked: {'; '.join(notes[1:])}{hint}")
        return plan

    def _candidates(self) -> tuple[list[str], str]:
        mode, kind, operands = self._options.mode, self._options.reduce.kind, self._operands
        if operands.left is not None:
            if mode == "autotune":
                modes = ["reverse", "reverse_loop"]
            else:
                modes = ["reverse_loop" if mode == "reverse_loop" else "reverse"]
            return modes, f"reduce {kind}: products with output-side vectors run in reverse mode"
        if mode in MODES:
            return [mode], f"mode {mode} (configured)"
        # Forward mode runs one JVP per column of J R (an input entry, or a product's input-side vector:
        # jvp, project, a basis over inputs), reverse mode one backward pass per output row, the product
        # with R following in numpy: a projection of one label's row is one backward pass, not 256 JVPs.
        if operands.right is not None:
            columns, what = len(operands.right), f"reduce {kind}: {len(operands.right)} input-side vectors"
        else:
            columns = sum(operands.sizes[k] for k in self._wrt)
            what = f"{columns} input entries"
        rows = operands.extent("reverse", 0)
        by_size = "forward" if columns <= rows else "reverse"
        reason = f"{what} vs {rows} output rows"
        if mode == "auto":
            return [by_size], f"mode auto: {by_size} ({reason})"
        return [by_size] + [m for m in MODES if m != by_size], "mode autotune: fastest path agreeing with the others"

    def _paths(self, mode: str) -> list[Path]:
        """Paths to try for ``mode``, the reference first. Forward mode's plain graph also runs by double
        reverse (faster, but only trusted where it agrees with the accumulator); not under XLA, where
        the accumulator's graph is the faster, nor where the plain graph is only a reference
        (``jit_compile: true``). Where every layer has a rule, it runs by layer rules too (trusted
        likewise); reverse mode too, beside pfor's ``batch_jacobian``."""
        jit_compile = self._options.jit_compile
        paths = [Path(mode, jit) for jit in {True: [False, True], False: [False], "auto": [False, True]}[jit_compile]]
        if mode == "forward" and jit_compile is not True:
            paths.insert(1, Path(mode, False, True))
            if self._layer_rules:
                paths.insert(2, Path(mode, False, layer_rules=True))
        if mode == "reverse" and jit_compile is not True and self._reverse_layer_rules:
            paths.insert(1, Path(mode, False, layer_rules=True))
        if (mode == "forward" or len(paths) > 1) and not self._timed:
            # Untimed, the vectorised accumulator (forward) or pfor's batch_jacobian (reverse, beside a faster
            # path) is only the last resort: the reference is the mode run eagerly (the plain graph under
            # jit_compile: true is only a reference, so it goes). On W1 tracing pfor was 2/3 of set-up.
            paths.insert(0, Path(mode, eager=True))
            if jit_compile is True:
                paths.remove(Path(mode))
        return paths

    @property
    def _timed(self) -> bool:
        return self._options.mode == "autotune" or self._options.jit_compile == "auto"

    def _first_good(self, modes: list[str], notes: list[str]) -> Plan | None:
        """Try each path; keep the best that works and agrees with the reference (untimed, the first in
        the order of preference that does).

        Best is the fastest per sample under ``autotune``; else the first mode, and with
        ``jit_compile: auto`` the faster of its plain graph and XLA (XLA is not always faster: it
        loses on max-pooling CNNs and wins on small dense chains). With ``jit_compile: true`` the plain
        graph runs too, on the probe only, as the reference XLA must agree with; it is never used.
        """
        timed = self._timed
        tried = self._telemetry.setdefault("candidates", [])
        first_tried = len(tried)
        # Paths are compared on the probe batch; a lone path only has to trace and run: two samples do.
        alone = not timed and len(modes) == 1 and len(self._paths(modes[0])) == 1
        search = _Search(modes, notes, tried, timed, 2 if alone else self._probe_samples)
        for mode in modes:
            if search.best is not None and not timed:
                break  # untimed, a later mode never ranks above a plan of an earlier one
            self._search_mode(mode, search)
        if search.best is None:
            return None
        plan, reference_plan = search.best[1], search.reference_plan
        self.reference = None if reference_plan is None or reference_plan.path == plan.path else reference_plan
        if timed:
            speeds = [
                f"{e['path']} {1e6 * e['seconds_per_sample']:.1f} us/sample"
                for e in tried[first_tried:]
                if "seconds_per_sample" in e
            ]
            notes.append(f"timed on a full batch: {', '.join(speeds)}")
        return Plan(plan.path, plan.sizes, (*notes, *plan.sizes.notes, *plan.reasons))

    def _search_mode(self, mode: str, search: _Search) -> None:
        """Try ``mode``'s paths in turn for ``_first_good``, until one ends the mode's search (``_judge``) or
        an op of the model has no forward-mode rule."""
        paths = self._ordered_paths(mode, search.timed)
        for path in paths:
            if search.reference_result is None and not search.timed and path is not paths[0] and path != Path(mode, path.jit):
                # A fast path is trusted only once it agrees with a reference: here none ran.
                search.notes.append(f"{path.label}: not tried, as no reference ran to check it against")
                search.tried.append({"path": path.label, "error": "no reference to check it against"})
                continue
            try:
                plan, result, seconds = self._try(path, search.timed, search.probe_samples)
            except NoLayerRule as err:
                search.notes.append(f"{path.label}: {err}")
                search.tried.append({"path": path.label, "error": str(err)})
                continue
            except ForwardModeUnsupported as err:
                if self._options.mode == "forward":
                    raise ModelError(f"{self._source}: {err}") from err
                search.notes.append(f"forward: {err}")
                search.tried.append({"path": path.label, "error": "an op has no forward-mode rule"})
                return
            except _CANNOT_RUN as err:
                if isinstance(err, ModelError) or raised_by_jacobeam(err):
                    raise
                self._cannot_run(path, err, search)
                continue
            if self._judge(path, mode, paths, plan, result, seconds, search):
                return

    def _ordered_paths(self, mode: str, timed: bool) -> list[Path]:
        """``mode``'s paths, the reference first. Untimed, the rest in the order of preference (layer
        rules, double reverse, the plain graph): the first path that agrees with the reference is taken,
        and the others are neither traced nor run."""
        paths = self._paths(mode)
        if timed:
            return paths
        return paths[:1] + sorted(paths[1:], key=lambda p: (not p.layer_rules, not p.double_reverse))

    def _cannot_run(self, path: Path, err: Exception, search: _Search) -> None:
        """A path TensorFlow cannot run: left out with its reason, or an error under ``jit_compile: true``
        where it is XLA's."""
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        if path.jit and self._options.jit_compile is True:
            raise ModelError(f"{self._source}: XLA compilation failed (jit_compile: true): {first_line}") from err
        log.warning("%s failed for %s, falling back: %s", path.label, self._source, first_line)
        search.notes.append(f"{path.label} failed: {first_line}")
        search.tried.append({"path": path.label, "error": first_line})

    def _judge(
        self, path: Path, mode: str, paths: list[Path], plan: Plan, result: dict, seconds: float, search: _Search
    ) -> bool:
        """Record a path that ran: the first to run is the reference, every other must agree with it; one
        that may be used (not only as a reference) becomes the best plan if it ranks above the best so far.
        True where the mode's search ends here (untimed: the most preferred path that agrees)."""
        options = self._options
        entry: dict[str, Any] = {"path": path.label}
        if search.timed:
            entry["seconds_per_sample"] = seconds
        if search.reference_result is None:
            search.reference_result, search.reference_plan = result, plan
        else:
            error = disagreement(result, search.reference_result)
            entry["relative_error"] = error
            if error > AGREEMENT[options.compute_dtype]:
                log.warning("%s disagrees with the reference path (relative error %.2g): not used", path.label, error)
                search.notes.append(f"{path.label} disagrees with the reference (relative error {error:.2g})")
                search.tried.append(entry)
                return False
        search.tried.append(entry)
        if path.eager or (options.jit_compile is True and not path.jit):
            entry["reference_only"] = True
            return False
        # Untimed, layer rules and then the double-reverse forward graph win over the accumulator's
        # graph they agree with.
        if options.mode == "autotune":
            rank: tuple = (seconds,)
        else:
            rank = (search.modes.index(mode), seconds, not path.layer_rules, not path.double_reverse)
        if search.best is None or rank < search.best[0]:
            search.best = (rank, plan)
        return not search.timed and path is not paths[0]

    def _try(self, path: Path, timed: bool, probe_samples: int) -> tuple[Plan, dict, float]:
        """Trace and run a path on a probe batch of ``probe_samples``: the plan it ran with (smaller if it
        ran out of memory), its results, and (``timed``) the best of two runs on one full batch per sample."""
        sizes = self._size(path.mode)
        plan = Plan(path, sizes)
        probe = self._probe(min(sizes.batch, probe_samples))
        with full_tracebacks(), capture_pfor_fallbacks() as fallbacks:
            plan, result = self._run(plan, probe, self._select(probe))
        for op in fallbacks.ops:
            if op not in self._telemetry["pfor_fallbacks"]:
                log.warning("pfor could not vectorise %s: it runs in a while_loop (slow)", op)
                self._telemetry["pfor_fallbacks"].append(op)
        if not timed:
            return plan, result, 0.0
        full = self._probe(plan.sizes.batch)
        index = self._select(full)
        timings = []
        for _ in range(2):
            began = time.perf_counter()
            plan, _ = self._run(plan, full, index)
            timings.append(time.perf_counter() - began)
        return plan, result, min(timings) / len(full[0])

    def _select(self, xs: Sequence[np.ndarray]) -> np.ndarray | None:
        """The output rows of probe samples; ``label`` selects output 0 of each (any valid row does)."""
        n = len(xs[0])
        return self._operands.select(n, self._forward(xs) if self._operands.selects_by_output else None, np.zeros(n, np.int64))
