"""The target pipelined over local ranks (MLX's ring backend on 127.0.0.1), DFlash on top.

The ranks are started as ``mlx.launch`` starts them (a hostfile and MLX_RANK); the CLI test runs
``mlx.launch`` itself. Answers must equal the single-process ones token for token (greedy, and
sampled with the same seed: the last rank draws exactly as one process does), and every rank's
caches must equal feeding the committed tokens directly.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import dflash_mlx
from dflash_mlx import tiny
from dflash_mlx.cache import restore, snapshot
from dflash_mlx.pipeline import stages
from dflash_mlx.pipeline.cycle import Upstream, _commit
from tests import subprocess_env
from tests.conftest import VOCAB, make_hf_moe_target, random_prompts

ROOT = Path(__file__).resolve().parents[1]
WORKER = [sys.executable, str(ROOT / "tests" / "pipeline_worker.py")]

pytestmark = pytest.mark.slow  # several processes (pipeline ranks) per test


def free_ports(n: int) -> list:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def hostfile(tmp_path: Path, ranks: int) -> Path:
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(ranks)]))
    return path


def _niced() -> None:
    # MLX's ring backend waits by polling its sockets: a rank waiting for another keeps a core
    # busy. Niced, the waiting ranks leave the cores to the tests running beside them.
    os.nice(10)


def launch(tmp_path: Path, ranks: int, argv: list, torch: bool = False, **popen) -> list:
    """``ranks`` processes of ``argv``, each given its rank as mlx.launch gives it. Torch is hidden
    from them (``subprocess_env``: about 1 s of CPU less per rank) unless ``torch``: the
    emulated-Metal workers' fixtures reach it."""
    hosts = hostfile(tmp_path, ranks)
    base = {**os.environ} if torch else subprocess_env()
    return [subprocess.Popen(argv, env={**base, "MLX_RANK": str(r), "MLX_HOSTFILE": str(hosts)},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_niced, **popen)
            for r in range(ranks)]


def finish(processes, timeout: float = 150):
    """Every rank's (returncode, stdout, stderr); all are killed if one outlives ``timeout``."""
    deadline = time.monotonic() + timeout
    results = []
    try:
        for p in processes:
            out, err = p.communicate(timeout=max(1, deadline - time.monotonic()))
            results.append((p.returncode, out, err))
    except subprocess.TimeoutExpired:
        for p in processes:
            p.kill()
        pytest.fail("a pipelined run hung:\n" + "\n".join(p.communicate()[1][-2000:] for p in processes))
    return results


@pytest.fixture(scope="module")
def pair(tmp_path_factory, hf_target_dir, target_config):
    draft = tmp_path_factory.mktemp("pipeline_draft")
    tiny.write_draft(draft, tiny.draft_config(target_config, block_size=8), seed=3)
    return hf_target_dir, draft


@pytest.fixture(scope="module")
def quantized_pair(tmp_path_factory, pair):
    """The dense target as mlx-lm's converter writes it with its mixed 4/6-bit recipe: per-layer
    overrides keyed by the checkpoint's own paths, which a rank must renumber with its layers."""
    from tests.test_mlx_layouts import mlx_lm_convert, multimodal

    source = multimodal(pair[0], tmp_path_factory.mktemp("pipeline_multimodal"))
    target = mlx_lm_convert(source, tmp_path_factory.mktemp("pipeline_mixed") / "target", "mixed_4_6", moe=False)
    quantization = json.loads((target / "config.json").read_text())["quantization"]
    assert quantization["language_model.model.layers.3.mlp.down_proj"]["bits"] == 6  # on the last rank, renumbered
    return target, pair[1]


@pytest.fixture(scope="module")
def moe_pair(tmp_path_factory):
    """A mixture-of-experts target in the published release's layout (fused experts, multimodal
    config) and a draft reading all of its layers."""
    target = make_hf_moe_target(tmp_path_factory.mktemp("pipeline_moe"), "fused", num_hidden_layers=4, seed=7)
    text = json.loads((target / "config.json").read_text())["text_config"]
    draft = tmp_path_factory.mktemp("pipeline_moe_draft")
    tiny.write_draft(draft, tiny.draft_config(text, block_size=8, target_layer_ids=[3, 0, 2]), seed=3)
    return target, draft


@pytest.fixture(scope="module")
def spec_and_answers(request):
    """The runs every pipelined world repeats, and what one process answers to each (per pair,
    and path: ``emulated`` runs the Metal kernels' emulator, in that process and on every rank)."""
    built = {}

    def build(pair_name: str, emulated: bool = False):
        if (pair_name, emulated) not in built:
            built[pair_name, emulated] = _spec_and_answers(request.getfixturevalue(pair_name), emulated)
        return built[pair_name, emulated]
    return build


def _spec_and_answers(pair, emulated: bool = False):
    model, tokenizer = dflash_mlx.load(str(pair[0]), draft=str(pair[1]))
    if emulated:
        from tests.test_emulated_metal import emulated_recurrence

        model.target.use_recurrence(emulated_recurrence())
    prompts = [p.tolist() for p in random_prompts(2, VOCAB, seed=5)]

    def answer(prompt, max_tokens, block_tokens, temp=0.0, seed=None, prefill_step_size=512):
        return [r.token for r in dflash_mlx.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens,
                                                            block_tokens=block_tokens, temp=temp, seed=seed,
                                                            prefill_step_size=prefill_step_size)]

    runs = []
    for prompt in prompts[: 1 if emulated else 2]:  # the emulator is slow: the emulated path runs fewer
        greedy = prompt + answer(prompt, 40, 1)
        for block in ("4",) if emulated else ("4", "auto", "1"):
            runs.append(dict(prompt=prompt, max_tokens=16, block_tokens=block, temp=0.0, seed=None, sequence=greedy))
    if not emulated:
        # The prefill chunked through the pipeline at the smallest step: 13 tokens, then the last alone (a
        # chunk that looks like a decode step).
        assert len(prompts[0]) == 14
        runs.append(dict(prompt=prompts[0], max_tokens=8, block_tokens="4", temp=0.0, seed=None, prefill_step_size=64,
                         sequence=prompts[0] + answer(prompts[0], 40, 1)))
        for seed in (3, 4):
            runs.append(dict(prompt=prompts[0], max_tokens=12, block_tokens="4", temp=1.0, seed=seed))
    # The oracle drafts the greedy continuation, wrong at a scheduled slot: every acceptance length
    # 0..3 in turn; stopping after 1..12 tokens checks the caches after every cycle.
    greedy = prompts[1] + answer(prompts[1], 40, 1)
    oracle = dict(sequence=greedy, block=4, schedule=[0, 1, 2, 3, 3, 1])
    for max_tokens in (3, 6, 9) if emulated else range(1, 13):
        runs.append(dict(prompt=prompts[1], max_tokens=max_tokens, block_tokens="4", temp=0.0, seed=None,
                         oracle=oracle, sequence=greedy))
    expected = [greedy[len(prompts[1]):][: r["max_tokens"]] if r.get("oracle") else
                answer(r["prompt"], r["max_tokens"], r["block_tokens"], r["temp"], r["seed"], r.get("prefill_step_size", 512))
                for r in runs]
    spec = dict(target=str(pair[0]), draft=str(pair[1]), runs=runs, emulated_metal=emulated)
    if emulated:  # both ranks hold Gated DeltaNet layers (the tiny target's 4th is attention)
        spec["stages"] = {"0": "2,2", "1": "2,2"}
    return spec, expected


@pytest.mark.parametrize("ranks,pair_name,emulated", [(3, "pair", False), (2, "moe_pair", False), (2, "pair", True)],
                         ids=["3-dense", "2-moe", "2-dense-emulated-metal"])
def test_pipelined_answers_equal_one_process_and_caches_hold_the_committed_tokens(tmp_path, spec_and_answers, ranks,
                                                                                   pair_name, emulated):
    """The dense target over 3 ranks (a middle rank relays); the mixture of experts over 2 (its
    draft's taps out of order); the dense one over 2 on the path a Mac runs (the Gated DeltaNet
    kernels, emulated, on every rank: verify, tape and replay)."""
    spec, expected = spec_and_answers(pair_name, emulated)
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    results = finish(launch(tmp_path, ranks, WORKER + [str(tmp_path / "spec.json"), str(tmp_path)], torch=emulated))
    for rank, (code, _, err) in enumerate(results):
        assert code == 0, f"rank {rank} failed:\n{err[-3000:]}"
    answers = json.loads((tmp_path / "answers.json").read_text())
    for run, want, got in zip(spec["runs"], expected, answers):
        label = {k: run[k] for k in ("max_tokens", "block_tokens", "temp", "seed")}
        assert got == want, f"{ranks} ranks, {label}{' (oracle)' if run.get('oracle') else ''}"
    checked = [r for r in spec["runs"] if r.get("sequence")]
    for rank in range(ranks):
        differences = json.loads((tmp_path / f"caches-{rank}.json").read_text())
        assert len(differences) == len(checked)
        assert max(differences) < 2e-5, f"rank {rank}: caches differ from direct feeding by {max(differences)}"
        if emulated:  # the kernels ran on every rank; none fell back
            report = json.loads((tmp_path / f"kernels-{rank}.json").read_text())
            assert report and set(report.values()) == {"ok"}, (rank, report)


def test_generate_under_mlx_launch_prints_what_one_process_prints(tmp_path, quantized_pair):
    """mlx.launch itself, on a quantized target (mlx-lm's mixed 4/6 bits: the last rank's layers
    carry overrides under their global numbers)."""
    pair = quantized_pair
    args = ["generate", "--model", str(pair[0]), "--draft", str(pair[1]), "--prompt", "def add(a, b):",
            "--max-tokens", "24", "--block-tokens", "4", "--json"]
    cli = [sys.executable, "-m", "dflash_mlx.cli"]
    model, tokenizer = dflash_mlx.load(str(pair[0]), draft=str(pair[1]))
    alone = [r.token for r in dflash_mlx.stream_generate(model, tokenizer, [{"role": "user", "content": "def add(a, b):"}],
                                                         max_tokens=24, block_tokens="4", enable_thinking=False)]
    port = free_ports(1)[0]
    launched = subprocess.run(["mlx.launch", "--backend", "ring", "-n", "2", "--starting-port", str(port),
                               *cli, *args], capture_output=True, text=True, timeout=150, preexec_fn=_niced,
                              env=subprocess_env())
    assert launched.returncode == 0, launched.stderr[-3000:]
    records = [json.loads(line) for line in launched.stdout.splitlines() if line.startswith("{")]
    assert len(records) == 1, f"only rank 0 prints: {launched.stdout!r}"
    assert records[0]["tokens"] == alone
    assert records[0]["draft"] == "DFlash"
    # Each rank says what it holds (the last rank also the head and the draft).
    assert "rank 0 of 2: layers 0-" in launched.stderr and "with the embedding, the head, the draft" in launched.stderr
    assert "rank 1 of 2: layers 2-3" in launched.stderr or "rank 1 of 2: layers 3-3" in launched.stderr


def test_serve_behind_rank_0(tmp_path, pair):
    import httpx

    model, tokenizer = dflash_mlx.load(str(pair[0]), draft=str(pair[1]))
    messages = [{"role": "user", "content": "count: one two"}]
    want = dflash_mlx.generate(model, tokenizer, messages, max_tokens=20, block_tokens="auto")
    port = free_ports(1)[0]
    cli = [sys.executable, "-m", "dflash_mlx.cli", "serve", "--model", str(pair[0]), "--draft", str(pair[1]),
           "--port", str(port), "--prompt-cache-gb", "1"]
    ranks = launch(tmp_path, 2, cli)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        for _ in range(300):
            try:
                if httpx.get(f"{url}/models", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        for _ in range(2):  # two requests: the ranks go back to waiting after each
            body = {"model": pair[0].name, "messages": messages, "max_tokens": 20, "temperature": 0}
            reply = httpx.post(f"{url}/chat/completions", json=body, timeout=60).json()
            assert "choices" in reply, reply
            assert reply["choices"][0]["message"]["content"] == want
        ranks[0].send_signal(signal.SIGINT)  # rank 0 stops serving and shuts the other ranks down
        results = finish(ranks, timeout=30)
    finally:
        for p in ranks:
            p.kill()
    assert [code for code, _, _ in results] == [0, 0], results[1][2][-2000:]


def _long_spec(tmp_path: Path, pair, peer_timeout: float) -> Path:
    runs = [dict(prompt=list(range(3, 40)), max_tokens=48, block_tokens="4", temp=0.0, seed=None)]
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(dict(target=str(pair[0]), draft=str(pair[1]), runs=runs, forever=True,
                                    peer_timeout=peer_timeout)))
    return path


def _wait_for_requests(process) -> None:
    """Until rank 0 reports a finished request (the pipeline is working)."""
    for line in process.stdout:
        if "request done" in line:
            return
    pytest.fail("the pipeline never finished a request")


def test_a_killed_rank_stops_the_others_with_a_clear_error(tmp_path, pair):
    ranks = launch(tmp_path, 3, WORKER + [str(_long_spec(tmp_path, pair, 30)), str(tmp_path)])
    _wait_for_requests(ranks[0])
    ranks[1].kill()
    killed_at = time.monotonic()
    results = finish([ranks[0], ranks[2]], timeout=20)
    assert time.monotonic() - killed_at < 15
    for code, _, err in results:
        assert code == 1 and "the pipeline lost a rank ([ring] connection to a peer was lost); every rank stops" in err, err[-2000:]
        assert err.count("the pipeline lost a rank") == 1


def test_an_unreachable_rank_stops_the_others_after_the_peer_timeout(tmp_path, pair):
    ranks = launch(tmp_path, 2, WORKER + [str(_long_spec(tmp_path, pair, 2)), str(tmp_path)])
    _wait_for_requests(ranks[0])
    ranks[1].send_signal(signal.SIGSTOP)  # alive, sockets open, silent: what a machine off the network looks like
    stopped_at = time.monotonic()
    try:
        (code, _, err), = finish([ranks[0]], timeout=20)
    finally:
        ranks[1].kill()
    assert time.monotonic() - stopped_at < 10
    assert code == 1 and "no answer from the other ranks of the pipeline for 2 s" in err, err[-2000:]


def test_ranks_that_split_the_target_differently_refuse_to_start(tmp_path, pair):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(dict(target=str(pair[0]), draft=str(pair[1]), runs=[], stages={"0": "1,3", "1": "2,2"})))
    results = finish(launch(tmp_path, 2, WORKER + [str(spec), str(tmp_path)]), timeout=60)
    for rank, (code, _, err) in enumerate(results):
        assert code == 1 and "other ranks differently: every machine needs the same checkpoint" in err, err[-2000:]


# -- the pieces, without processes -------------------------------------------------------------

def test_stages_balance_weight_bytes_with_the_embedding_and_the_head():
    assert stages.plan([10] * 8, 2) == [(0, 4), (4, 8)]
    # The last rank also holds the head and the draft: it gets fewer layers.
    assert stages.plan([10] * 8, 2, last_extra=20) == [(0, 5), (5, 8)]
    assert stages.plan([10] * 8, 2, first_extra=20) == [(0, 3), (3, 8)]
    assert stages.plan([10] * 9, 3) == [(0, 3), (3, 6), (6, 9)]
    assert stages.plan([1, 1, 1, 1, 50, 1], 2) == [(0, 4), (4, 6)]
    assert stages.plan([10] * 6, 3, counts=[1, 2, 3]) == [(0, 1), (1, 3), (3, 6)]


@pytest.mark.parametrize("counts,world,message", [
    ([3, 3], 3, "lists 2 stages for 3 ranks"),
    ([5, 5], 2, "add up to the target's 6 layers"),
    ([6, 0], 2, "at least one layer"),
    (None, 7, "7 ranks for a target of 6 layers"),
])
def test_bad_stage_splits_are_clear_errors(counts, world, message):
    with pytest.raises(stages.StageError, match=message):
        stages.plan([10] * 6, world, counts=counts)


def test_stage_counts_parse_or_name_the_bad_value():
    assert stages.parse_counts("10, 14") == [10, 14]
    assert stages.parse_counts(None) is None
    with pytest.raises(stages.StageError, match="'10;14'"):
        stages.parse_counts("10;14")


def test_a_stage_names_only_its_own_tensors():
    stage = stages.Stage(rank=1, world=3, start=2, end=4, embedding=False)
    assert stage.local_name("model.layers.3.mlp.up_proj.weight") == "model.layers.1.mlp.up_proj.weight"
    assert stage.local_name("model.layers.3") == "model.layers.1"
    assert stage.local_name("model.layers.4.mlp.up_proj.weight") is None
    assert stage.local_name("model.layers.1.mlp.up_proj.weight") is None
    assert stage.local_name("model.embed_tokens.weight") is None
    assert stage.local_name("lm_head.weight") is None
    last = stages.Stage(rank=2, world=3, start=4, end=6, embedding=True)
    assert last.local_name("lm_head.weight") == "lm_head.weight"
    assert last.local_name("model.embed_tokens.scales") == "model.embed_tokens.scales"


def test_the_upstream_stand_in_passes_rollbacks_and_restores_on():
    upstream = Upstream()
    upstream.offset = 10
    undo = snapshot([upstream])
    upstream.offset += 4  # a verify pass of 4
    upstream.trim(2)  # rollback keeps 2
    assert (upstream.offset, upstream.take(), upstream.take()) == (12, 2, 0)
    restore([upstream], undo)
    assert (upstream.offset, upstream.take()) == (10, 2)


def test_rank_0_reads_the_commits_from_the_headers():
    first = _commit(None, 0, 7)
    assert (first.tokens, first.drafted) == ([7], 0)
    verified = _commit((4, [7, 8, 9, 10], 3), trim=1, next_token=11)  # 2 of 3 drafts accepted
    assert (verified.tokens, verified.drafted, verified.accepted) == ([8, 9, 11], 3, 2)
    plain = _commit((1, [5], 0), trim=0, next_token=6)
    assert (plain.tokens, plain.drafted, plain.accepted) == ([6], 0, 0)
    padded = _commit((2, [5, 5], 0), trim=1, next_token=6)  # a GPU's plain step: its second row padding
    assert (padded.tokens, padded.drafted, padded.accepted) == ([6], 0, 0)
    rejected = _commit((2, [5, 5], 1), trim=1, next_token=6)  # the same rows, a draft of one rejected
    assert (rejected.tokens, rejected.drafted, rejected.accepted) == ([6], 1, 0)


def test_rank_0_counts_only_what_the_draft_proposed_under_a_gpus_rules(target, draft, monkeypatch):
    """Under a GPU's row rules (``min_rows=2``: a plain step padded to two rows) the decoder tells
    the target each pass's proposals (the header's ``proposed``), and rank 0's commits read from
    the headers carry the one-process commits' tokens and stats: the padding is not drafted."""
    from dflash_mlx.sampling import Sampler
    from dflash_mlx.speculative import speculative
    from tests.test_lossless import ScriptedBlock, take

    passes, forward = [], type(target).forward

    def recording(self, x, *args, proposed=(), **kwargs):
        if proposed:  # the decoder's passes (not the prefill's)
            passes.append((x.shape[1], x[0].tolist(), list(proposed)))
        return forward(self, x, *args, proposed=proposed, **kwargs)

    monkeypatch.setattr(type(target), "forward", recording)
    script = ScriptedBlock([(1, 0), (2, 0), (1, 0), (4, 0)])
    prompt = random_prompts(1, VOCAB, seed=3)[0]
    _, commits = take(speculative(target, draft, prompt, Sampler(), block_tokens=script, min_rows=2), 12)
    cycles = commits[1:]  # the first token is the prefill's
    assert [count for count, _, _ in passes[:4]] == [2, 2, 2, 4] and len(passes) >= len(cycles) >= 8
    for (count, tokens, proposed), commit in zip(passes, cycles):
        assert proposed == [commit.drafted]
        read = _commit((count, tokens, proposed[0]), count - len(commit.tokens), commit.tokens[-1])
        assert (read.tokens, read.drafted, read.accepted) == (commit.tokens, commit.drafted, commit.accepted)
    assert sum(c.drafted for c in cycles) < sum(count - 1 for count, _, _ in passes[: len(cycles)])  # padding there
