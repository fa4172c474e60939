"""The measurement examples that docs/benchmarks.md cites still run against the library, at the
smallest settings (one of them once crashed on a renamed keyword and nobody saw it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests import subprocess_env

ROOT = Path(__file__).resolve().parents[1]


def run_example(*args: str) -> str:
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=subprocess_env(PYTHONUNBUFFERED="1"))
    assert done.returncode == 0, done.stderr
    return done.stdout


def rows(output: str, first: str):
    """The cells of the table rows whose first cell is ``first``."""
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in output.splitlines()
            if line.startswith(f"| {first} |")]


@pytest.mark.slow
def test_cycle_costs_example_measures_every_part():
    out = run_example("examples/cycle_costs.py", "--contexts", "512", "--repeats", "1")
    (row,) = rows(out, "512")
    assert len(row) == 11
    plain_step, plain_cycle, cycle = (float(cell) for cell in row[1:4])
    assert 0 < plain_step and 0 < plain_cycle < cycle  # a block of 4 costs more than a plain step


@pytest.mark.slow
def test_batch_cycle_costs_example_reports_cycles_rounds_and_layers():
    out = run_example("examples/batch_cycle_costs.py", "--sequences", "1,2", "--blocks", "1,2", "--cycles", "2",
                      "--repeats", "1", "--max-tokens", "8")
    one, two = rows(out, "1"), rows(out, "2")
    cycles = {(1, int(r[1])): r for r in one if len(r) == 5} | {(2, int(r[1])): r for r in two if len(r) == 5}
    assert set(cycles) == {(1, 1), (1, 2), (2, 1), (2, 2)}
    for (sequences, block), row in cycles.items():
        per_sequence = float(row[3])
        assert per_sequence == 1.0 if block == 1 else 1.0 <= per_sequence <= block  # a plain step commits one token
    assert "scheduler, no HTTP: 2 at once" in out
    layers = [r for r in one + two if len(r) == 8]  # six target layers and the draft pass
    assert [r[0] for r in layers] == ["1", "2"] and all(float(cell) > 0 for r in layers for cell in r[1:])


@pytest.mark.slow
def test_side_streams_example_times_both_ways():
    out = run_example("examples/side_streams.py", "--contexts", "512", "--repeats", "1")
    ways = {r[1]: r for r in rows(out, "512")}
    assert set(ways) == {"side streams", "one stream"}
    assert all(len(r) == 7 and all(float(cell) > 0 for cell in r[2:]) for r in ways.values())


def test_attention_costs_example_times_both_and_finds_them_identical():
    out = run_example("examples/attention_costs.py", "--keys", "40,100", "--rows", "1,4", "--repeats", "2")
    cells = [r for k in ("40", "100") for r in rows(out, k)]
    assert [(r[0], r[1]) for r in cells] == [("40", "1"), ("40", "4"), ("100", "1"), ("100", "4")]
    assert all(float(r[2]) > 0 and float(r[3]) > 0 and r[5] == "yes" for r in cells)
