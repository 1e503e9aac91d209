"""Plain-text tables of a run: one per workload, plus the W1 scaling runs."""

from __future__ import annotations

from typing import Any

from benchmarks.suite import WRONG, Report

COLUMNS = (
    "row", "batch", "timed", "samples/s", "x engine", "first call s", "peak RSS MB", "GFLOP/s", "max rel err", "notes"
)


def _number(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _speed(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.1f}" if value < 100 else f"{value:,.0f}"


def _error(row: dict[str, Any]) -> str:
    if row.get("reference"):
        return "reference"
    text = f"{row['max_rel_error']:.1e}"
    return f"{text} WRONG" if row["wrong"] else text


def _cells(row: dict[str, Any]) -> list[str]:
    if "error" in row:
        return [row["label"], *["-"] * 8, "failed: " + row["error"].splitlines()[0]]
    gflops = row.get("gflops")
    return [
        row["label"],
        str(row.get("batch", 256)),
        _number(row.get("timed_samples", row.get("samples"))),
        _speed(row["samples_per_second"]),
        "-" if row.get("vs_engine") is None else f"{row['vs_engine']:.3g}",
        _number(row.get("first_call_seconds"), 2),
        _number(row["peak_rss_mb"]),
        "-" if gflops is None else f"{gflops:.1f} ({row['percent_of_peak']:.0f}%)",
        _error(row),
        row.get("note", ""),
    ]


def _table(header: tuple[str, ...], lines: list[list[str]]) -> str:
    """Columns padded to their widest cell: text columns (first, last) to the left, numbers right."""
    widths = [max(len(cell) for cell in column) for column in zip(header, *lines)]

    def render(cells: list[str]) -> str:
        last = len(cells) - 1
        padded = [c.ljust(w) if i in (0, last) else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(padded).rstrip()

    return "\n".join([render(list(header)), render(["-" * w for w in widths]), *map(render, lines)])


def _shape(dims: list[int]) -> str:
    return "[" + ", ".join(map(str, dims)) + "]"


def workload_table(name: str, report: Report) -> str:
    found = report.workloads[name]
    jacobian = _shape(found["output_shape"] + found["input_shape"])
    peak = max(found["matmul_gflops"].values()) if found["matmul_gflops"] else None
    title = (
        f"{found['key']} {name}: x{_shape(found['input_shape'])} -> J{jacobian}, {found['samples']:,} samples; "
        + (f"float32 matmul peak now {peak:,.0f} GFLOP/s; " if peak else "")
        + f"a max rel err over {WRONG:g} against the reference marks a row WRONG"
    )
    return title + "\n" + _table(COLUMNS, [_cells(row) for row in found["rows"]])


def scaling_table(report: Report) -> str:
    lines = [
        [f"{item['samples']:,}", _speed(item["samples_per_second"]), _number(item["peak_rss_mb"]),
         _number(item["pipeline_wall_seconds"], 1), _number(item["bytes_per_second"] / 1e6)]
        for item in report.scaling
    ]
    header = ("samples", "samples/s", "peak RSS MB", "pipeline wall s", "MB/s written")
    return "W1 mlp end to end, in-process (runner.run): scaling\n" + _table(header, lines)
