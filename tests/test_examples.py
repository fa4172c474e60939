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


@pytest.mark.slow  # runs an example
def test_auto_replay_records_what_a_verified_run_accepts(tmp_path):
    """The record's premise: a cycle of size b after n committed tokens accepts
    ``min(taken[n - 1], b - 1)``, whatever ran before it. The record comes from plain steps that
    shadow; a real run at block 4 (verify passes, rollbacks, hand-offs) must accept exactly what it
    predicts, cycle by cycle, on the prompt the demo draft copies."""
    import json

    from dflash_mlx import load
    from dflash_mlx.api import encode_prompt
    from dflash_mlx.bench import SUITES
    from dflash_mlx.sampling import Sampler
    from dflash_mlx.speculative import speculative

    records = tmp_path / "records.json"
    run_example("examples/auto_replay.py", "record", "--context", "0", "--suite", "edit", "--max-tokens", "48",
                "--out", str(records))
    recorded = json.loads(records.read_text())["suites"]["edit"][0]
    model, tokenizer = load("demo")
    prompt = encode_prompt(tokenizer, [{"role": "user", "content": SUITES["edit"][0]}])
    commits = list(speculative(model.target, model.draft, prompt, Sampler(0.0), 4, draft_window=model.draft_window,
                               max_tokens=48, stop_tokens=set(tokenizer.eos_token_ids)))
    assert [t for c in commits for t in c.tokens] == recorded["answer"]
    predicted, n = [], 1
    while n < len(recorded["answer"]):
        accepted = min(recorded["taken"][n - 1], min(4, 48 - n) - 1)
        predicted.append(accepted)
        n += accepted + 1
    assert [c.accepted for c in commits[1:]] == predicted
    assert sum(predicted) > len(predicted)  # the draft copies here: the check has hits to get right

    replayed = run_example("examples/auto_replay.py", "replay", str(records), "--seeds", "2", "--repeats", "1")
    assert "edit: replayed speedup" in replayed


@pytest.mark.slow
def test_agent_replay_reuses_the_shared_head_across_sessions_and_a_restart():
    """The scripted pair behind ``serve``: every turn but the cold ones reuses most of its prompt,
    and after the restart each session's first turn comes from disk: it recomputes its task's tokens
    and under 64 more (Claude Code's), or from the head pinned before it (Codex's: its task is longer)."""
    out = run_example("examples/agent_replay.py", "--model", "scripted", "--turns", "2", "--max-tokens", "16")
    table = {(r[0], r[1], int(r[2])): r for r in (rows(out, p) for p in ("cold", "warm", "alternating", "restart"))
             for r in r}
    assert len(table) == 12
    for (phase, agent, turn), r in table.items():
        prompt, reused, source = int(r[3]), int(r[4]), r[5]
        if (phase, turn) == ("cold", 1) or (phase, agent, turn) == ("alternating", "codex", 1):
            assert reused == 0
        elif phase == "restart" and turn == 1:
            assert source == "disk" and prompt - reused < (64 + 64 if agent == "claude" else 512), r  # its task's tokens too
        else:
            assert prompt - reused < prompt / 8 + 64, r
