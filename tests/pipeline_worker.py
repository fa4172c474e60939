"""One rank of a pipelined run in the tests, started as ``mlx.launch`` starts one (MLX_RANK,
MLX_HOSTFILE): ``python tests/pipeline_worker.py SPEC OUT``.

SPEC (JSON): ``target``, ``draft``, ``peer_timeout``, ``stages`` (rank -> ``--stages``),
``emulated_metal`` (the Metal kernels' emulator on every rank), ``forever`` and ``runs``, each with
``prompt``, ``max_tokens``, ``block_tokens``, ``temp``, ``seed``, optionally ``prefill_step_size`` and ``oracle``
(``sequence``, ``block``, ``schedule``: the last rank drafts with tests' ``OracleDraft``) and
``sequence`` (the prompt and its greedy continuation: every rank then compares its caches with
feeding that sequence directly). Rank 0 writes the answers to OUT/answers.json; every rank writes
OUT/caches-RANK.json, the largest difference per run. ``forever``: repeat the runs until killed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

import dflash_mlx  # noqa: E402
from dflash_mlx.loading import load_target  # noqa: E402
from dflash_mlx.pipeline import PeerLost, StageError  # noqa: E402
from tests.test_lossless import OracleDraft, _cache_tensors  # noqa: E402


def cache_difference(model, full_target, sequence) -> float:
    """Largest difference between this rank's caches and those of feeding the committed tokens
    (as many as the caches hold) directly through the whole target."""
    pipeline = model.runner.pipeline
    held = pipeline.cache[0].offset
    direct = full_target.make_cache()
    full_target(mx.array(sequence[:held])[None], direct)
    mine = _cache_tensors(pipeline.cache)
    want = _cache_tensors(direct[pipeline.stage.start : pipeline.stage.end])
    worst = 0.0
    for (name, offset, got), (_, want_offset, expected) in zip(mine, want):
        if offset != want_offset:
            return float("inf")
        worst = max(worst, float(np.max(np.abs(got - expected))) if got.size else 0.0)
    return worst


def main(spec_path: str, out: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    stages = (spec.get("stages") or {}).get(os.environ["MLX_RANK"])  # per rank: a disagreement is an error
    model, tokenizer = dflash_mlx.load(spec["target"], draft=spec["draft"], peer_timeout=spec.get("peer_timeout", 30),
                                       stages=stages)
    pipeline = model.runner.pipeline
    full_target, _ = load_target(Path(spec["target"]))
    if spec.get("emulated_metal"):  # every rank runs the Gated DeltaNet kernels a Mac runs, emulated
        from tests.test_emulated_metal import emulated_recurrence

        model.target.use_recurrence(emulated_recurrence())
        full_target.use_recurrence(emulated_recurrence())
    real_draft = model.draft
    answers, differences = [], []
    while True:
        for run in spec["runs"]:
            oracle = run.get("oracle")
            if oracle and pipeline.stage.last:
                model.draft = OracleDraft(oracle["sequence"], oracle["block"], oracle["schedule"])
                model.draft.target_layer_ids = pipeline.taps
            tokens = [r.token for r in dflash_mlx.stream_generate(
                model, tokenizer, run["prompt"], max_tokens=run["max_tokens"], block_tokens=run["block_tokens"],
                temp=run["temp"], seed=run["seed"], prefill_step_size=run.get("prefill_step_size", 512))]
            model.draft = real_draft
            answers.append(tokens)
            if run.get("sequence"):
                differences.append(cache_difference(model, full_target, run["sequence"]))
            if spec.get("forever"):
                print(f"rank {pipeline.rank}: request done", flush=True)
        if not spec.get("forever"):
            break
    if pipeline.drives:
        Path(out, "answers.json").write_text(json.dumps(answers))
    Path(out, f"caches-{pipeline.rank}.json").write_text(json.dumps(differences))
    if spec.get("emulated_metal"):
        recurrence = next(l.linear_attn.recurrence for l in model.target.layers if l.is_linear)
        Path(out, f"kernels-{pipeline.rank}.json").write_text(json.dumps(recurrence.metal.report()))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(*sys.argv[1:]))
    except (PeerLost, StageError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
