"""The CLI as people use it: chat in a pseudo-terminal, generate and bench in subprocesses."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pexpect
import pytest

from dflash_mlx import scripted, tiny
from dflash_mlx.api import load
from dflash_mlx.chat import ChatSession
from tests import subprocess_env
from tests.test_lossless import assert_lossless

ROOT = Path(__file__).resolve().parents[1]
STATS = re.compile(r"(\d+) tokens, [\d.]+ tok/s, [\d.]+ tokens/cycle, acceptance \d+%, blocks [\d:% ]+, prompt (\d+) new \+ (\d+) cached tokens")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny.write_pair(tmp_path_factory.mktemp("cli"))


@pytest.fixture(scope="module")
def endless_pair(tmp_path_factory):
    """A tiny pair whose target answers " the model block" over and over, never its end of turn:
    an answer that is still streaming whenever Ctrl-C comes, however fast the machine (the random
    tiny target ended its answer after 80 tokens, sometimes before the test's Ctrl-C arrived)."""
    from transformers import AutoTokenizer

    target, draft = tiny.write_pair(tmp_path_factory.mktemp("endless"))
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    generation_prompt_end = tokenizer.encode("\n")  # the last token of every generation prompt
    loop = tokenizer.encode(" the model block")
    scripted.point_head(target, [generation_prompt_end + loop + loop[:1]])
    return target, draft


def cli(*args, env=None, input=None):
    return subprocess.run(
        [sys.executable, "-m", "dflash_mlx.cli", *args], capture_output=True, text=True, cwd=ROOT,
        env=subprocess_env(**(env or {})), input=input, timeout=300,
    )


def in_process(*args, input=None):
    """The CLI run in this process (``typer.testing.CliRunner``): exit code, stdout, stderr apart."""
    from typer.testing import CliRunner

    from dflash_mlx.cli import app

    return CliRunner().invoke(app, list(args), input=input)


def _as_in_a_terminal():
    """A suite started in the background (``cmd &``) ignores SIGINT, and the child would inherit
    that: give it the default disposition a user's shell gives, so Ctrl-C reaches Python."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def spawn_chat(pair, *extra):
    target, draft = pair
    child = pexpect.spawn(
        sys.executable, ["-m", "dflash_mlx.cli", "chat", "-m", str(target), "-d", str(draft), "-b", "4", *extra],
        cwd=str(ROOT), env=subprocess_env(), encoding="utf-8", timeout=120, dimensions=(40, 200), preexec_fn=_as_in_a_terminal,
    )
    child.expect(">>> ")
    return child


def turn(child, text):
    child.sendline(text)
    child.expect(STATS)
    tokens, new, cached = (int(x) for x in child.match.groups())
    child.expect(">>> ")
    return tokens, new, cached


def test_chat_turns_reuse_the_cache_and_reset_forgets(pair):
    child = spawn_chat(pair, "--max-tokens", "20")
    question = "def fibonacci(n): " + "# a note on the sequence " * 8
    tokens, new1, cached = turn(child, question)
    assert cached == 0 and 0 < tokens <= 20
    tokens, new2, cached2 = turn(child, "class Stack:")
    # Turn 2 prefills only what is new: the first turn up to the last 64-token checkpoint before its
    # generation prompt (the template may render the answer differently in history; the answer's
    # states came from decoding, and are prefilled again) comes from the cache.
    tokenizer = load(str(pair[0]))[1]
    first = [{"role": "user", "content": question}]
    prompt1 = tokenizer.apply_chat_template(first, add_generation_prompt=True)
    stable = len(tokenizer.apply_chat_template(first, add_generation_prompt=False))
    assert 0 < stable // 64 * 64 <= cached2 <= len(prompt1) + tokens
    child.sendline("/stats")
    child.expect(r"2 turns, \d+ tokens")
    child.expect(">>> ")
    child.sendline("/reset")
    child.expect(r"\(conversation cleared\)")
    child.expect(">>> ")
    _, _, cached3 = turn(child, "class Stack:")
    assert cached3 == 0
    child.sendline("/help")
    child.expect("/reset")
    child.expect(">>> ")
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


@pytest.mark.slow  # a chat session in a pseudo-terminal
def test_ctrl_c_stops_the_answer_and_keeps_the_session(endless_pair):
    child = spawn_chat(endless_pair, "--max-tokens", "100000")
    first_cached = interrupted_turn(child, "tell me everything " + "about the fox " * 30)
    assert first_cached == 0
    # The stopped turn is in the history and its cache is reused (up to its last 64-token checkpoint).
    assert interrupted_turn(child, "shorter please") > 0
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def interrupted_turn(child, text):
    """Ask, press Ctrl-C once the answer streams, and return the turn's cached prompt tokens."""
    child.sendline(text)
    child.expect(text + "\r\n")
    child.expect(r"\S{5}")  # the answer is streaming
    child.sendintr()
    child.expect(r"\[stopped\]")
    child.expect(STATS)
    cached = int(child.match.group(3))
    child.expect(">>> ")
    return cached


def test_a_follow_up_turn_equals_a_fresh_run_on_the_whole_conversation(pair):
    from dflash_mlx import stream_generate

    target, draft = pair
    model, tokenizer = load(str(target), draft=str(draft))
    generation = dict(max_tokens=24, block_tokens=4)
    session = ChatSession(model, tokenizer, system="be brief", generation=generation)
    with open(os.devnull, "w") as devnull:
        session.ask("def fibonacci(n): " + "# a note on the sequence " * 8, out=devnull)
        messages = session.messages("class Stack:")
        second = session.ask("class Stack:", out=devnull)
    assert second.cached_prompt_tokens > 0
    fresh = [r.token for r in stream_generate(model, tokenizer, messages, enable_thinking=False, **generation)]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False)
    assert_lossless(model.target, mx.array(prompt), fresh, session.last_tokens)


@pytest.mark.slow  # several CLI subprocesses
def test_generate_json_and_stdin(pair):
    target, draft = pair
    done = cli("generate", "-m", str(target), "-d", str(draft), "--max-tokens", "12", "--json", "--no-chat-template", input="class Stack:")
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    assert len(record["tokens"]) <= 12 and record["finish_reason"] in ("length", "stop")
    assert record["block_tokens"] == "auto" and sum(record["block_histogram"].values()) == record["cycles"]
    alone = cli("generate", "-m", str(target), "-p", "class Stack:", "--max-tokens", "12", "--json", "--no-chat-template")
    assert json.loads(alone.stdout)["tokens"] == record["tokens"]


@pytest.mark.slow  # a whole bench in a subprocess
def test_bench_writes_json_and_png(pair, tmp_path):
    target, draft = pair
    done = cli(
        "bench", "-m", str(target), "-d", str(draft), "-b", "4,8,auto", "--suite", "edit", "--suite", "code",
        "--max-tokens", "16", "--out", str(tmp_path / "bench.json"), "--plot", str(tmp_path / "bench.png"),
        "--context", "48", "--repeats", "1",
    )
    assert done.returncode == 0, done.stderr
    results = json.loads((tmp_path / "bench.json").read_text())
    assert {r["context_tokens"] for r in results["summary"]} == {48} and results["meta"]["contexts"] == [48]
    assert "context" in done.stdout and "CPU speedup" in done.stdout and "TTFT s" in done.stdout
    rows = {(r["suite"], r["block_tokens"]) for r in results["summary"]}
    assert rows == {(s, b) for s in ("edit", "code") for b in ("4", "8", "auto")}
    for r in results["summary"]:
        assert r["identical"] and r["baseline_tps"] > 0 and r["dflash_tps"] > 0 and r["mlx_lm_tps"] > 0
        assert set(r) >= {"speedup", "speedup_vs_mlx_lm", "tokens_per_cycle", "acceptance_rate", "peak_memory_gb", "accepted_lengths", "block_shares"}
        # what a step and a cycle take, each side's time to first token, the speedup in CPU time
        assert r["step_ms"] > 0 and r["cycle_ms"] > 0 and r["baseline_ttft_s"] > 0 and r["dflash_ttft_s"] > 0
        assert r["cpu_speedup"] > 0
        assert sum(r["block_shares"].values()) == pytest.approx(1.0)
        # auto's rows show the share of its cycles' time spent exploring; fixed sizes explore nothing
        assert (0 <= r["probe_share"] <= 1) if r["block_tokens"] == "auto" else r["probe_share"] is None
        if r["block_tokens"] != "auto":  # the fixed size, and smaller ones only where max_tokens capped the last cycles
            sizes = {int(b) for b in r["block_shares"]}
            assert int(r["block_tokens"]) in sizes and max(sizes) == int(r["block_tokens"]), r["block_shares"]
    assert len(results["runs"]) == 2 * 2 * 5  # 2 prompts per suite x (2 baselines + 3 block settings)
    assert "mlx-lm" in done.stdout and "vs mlx-lm" in done.stdout.replace("\n", " ") and "probe" in done.stdout
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "dflash-mlx bench" in done.stdout
    # The numbers say what produced them: here MLX's CPU backend with its bundled reference BLAS.
    backend = results["meta"]["backend"]
    assert "cpu" in backend["device"].lower() and "blas" in backend["blas"].lower()
    assert "reference BLAS" in done.stderr


@pytest.mark.slow  # a whole bench in a subprocess
def test_bench_context_sizes_and_real_file_context(pair):
    from dflash_mlx.bench import file_context, parse_context_sizes, with_context

    assert parse_context_sizes("1k, 4k,512") == [1024, 4096, 512] and parse_context_sizes("") == [0]
    for bad in ("4q", "-1", "k"):
        with pytest.raises(ValueError, match="context size"):
            parse_context_sizes(bad)
    tokenizer = load(str(pair[0]))[1]
    context = file_context(tokenizer, 300)
    assert "argparse" in context and abs(len(tokenizer.encode(context, add_special_tokens=False)) - 300) <= 8
    assert file_context(tokenizer, 300) == context  # the same files, in the same order
    assert with_context("Rename f.", context).endswith("Rename f.") and with_context("x", "") == "x"
    done = cli("bench", "-m", str(pair[0]), "-d", str(pair[1]), "--context", "4q", "--suite", "code")
    assert done.returncode == 1 and "--context '4q': context size '4q'" in done.stderr
    done = cli("bench", "-m", str(pair[0]), "-d", str(pair[1]), "--repeats", "0", "--suite", "code")
    assert done.returncode == 1 and "--repeats 0: at least 1" in done.stderr


def test_bench_notices_an_optimised_blas():
    from dflash_mlx.bench import reference_blas_only

    assert reference_blas_only({"device": "Device(cpu, 0)", "blas": "libblas-bd8a282c.so.3.10.0"})
    assert not reference_blas_only({"device": "Device(cpu, 0)", "blas": "libblas-bd8a282c.so.3.10.0, libopenblasp-r0.3.21.so"})
    # numpy's bundled OpenBLAS has prefixed symbols: MLX still uses the reference one.
    assert reference_blas_only({"device": "Device(cpu, 0)", "blas": "libblas-bd8a282c.so.3.10.0, libscipy_openblas64_-32a4.so"})
    assert not reference_blas_only({"device": "Device(gpu, 0)", "blas": "libblas.so.3"})
    assert not reference_blas_only({"device": "Device(cpu, 0)"})  # not Linux: no /proc/self/maps to read
    assert not reference_blas_only({"device": "Device(cpu, 0)", "blas": "none loaded"})  # e.g. a static build


@pytest.mark.parametrize("command", ["generate", "chat", "bench"])
def test_error_paths_are_one_clear_line(pair, tmp_path, command):
    target, draft = pair
    extra = ["-p", "x"] if command == "generate" else []
    cases = [
        (["-m", str(tmp_path / "missing")], f"no checkpoint folder at {tmp_path / 'missing'}"),
        (["-m", str(target), "-d", str(draft), "--draft-quant", "w9"], "bad quantization 'w9'"),
        (["-m", str(target), "-d", str(draft), "-b", "99"], "--block-tokens '99': more than the draft's block size 16"),
        (["-m", str(target), "-d", str(draft), "-b", "auto:x"], "--block-tokens 'auto:x': expected an integer, 'auto' or 'auto:N'"),
        (["-m", str(target), "--temp", "0.7", "--top-p", "1.5"], "top_p must be in [0, 1] (0 or 1 = off), got 1.5"),
        (["-m", str(target), "--min-p", "2"], "min_p must be in [0, 1] (0 = off), got 2.0"),
    ]
    for args, message in cases:  # in this process (the exit status and stderr are the CLI's own): fast
        done = in_process(command, *args, *extra, input="")
        lines = done.stderr.strip().splitlines()
        assert done.exit_code == 1 and len(lines) == 1 and message in lines[0], done.stderr
    # One case as a real process too: the console script's exit status and stderr.
    done = cli(command, *cases[0][0], *extra, input="")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1 and lines[0].startswith(f"error: {cases[0][1]}"), done.stderr


@pytest.mark.slow  # several CLI subprocesses
def test_debug_mode_re_raises_with_the_traceback(tmp_path):
    """DFLASH_MLX_DEBUG=1: the same bad input shows the exception and its traceback, for reports."""
    args = ("generate", "-m", str(tmp_path / "missing"), "-p", "x")
    plain = cli(*args)
    assert plain.returncode == 1 and "Traceback" not in plain.stderr
    debug = cli(*args, env={"DFLASH_MLX_DEBUG": "1"})
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "CheckpointError" in debug.stderr, debug.stderr


def test_default_model_offline_says_what_is_missing(tmp_path):
    done = cli("generate", "-p", "hi", env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "DFLASH_MLX_HOME": str(tmp_path / "home")})
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "Jackrong/Qwopus3.5-9B-Coder" in done.stderr and "huggingface-cli download" in done.stderr
    assert not any((tmp_path / "home").glob("*")) if (tmp_path / "home").exists() else True


def test_serve_refuses_a_negative_prompt_cache_budget_before_loading():
    done = cli("serve", "--model", "demo", "--prompt-cache-gb", "-1")
    assert done.returncode == 1 and "--prompt-cache-gb must not be negative (got -1.0)" in done.stderr
    assert "--prompt-cache-gb" in cli("serve", "--help").stdout and "--mlx-lm" in cli("bench", "--help").stdout


def test_serve_and_bench_refuse_bad_concurrency_settings_before_loading():
    done = in_process("serve", "--model", "demo", "--max-concurrent", "0")
    assert done.exit_code == 1 and "--max-concurrent must be at least 1 (got 0)" in done.stderr
    done = in_process("serve", "--model", "demo", "--max-queue", "-2")
    assert done.exit_code == 1 and "--max-queue must not be negative (got -2)" in done.stderr
    done = in_process("bench", "--model", "demo", "--concurrency", "1,x")
    assert done.exit_code == 1 and "--concurrency '1,x'" in done.stderr
    done = in_process("bench", "--model", "demo", "--concurrency", "2", "--temp", "0.7")
    assert done.exit_code == 1 and "leave --temp at 0" in done.stderr
    help_text = in_process("serve", "--help").stdout
    assert "--max-concurrent" in help_text and "--max-queue" in help_text


def test_serve_log_level_origins_and_context_size():
    done = in_process("serve", "-m", "missing", "--log-level", "LOUD")  # mlx_lm.server's choices only
    assert done.exit_code == 2 and "--log-level" in done.stderr
    import typer

    from dflash_mlx.cli import app

    helps = {p.opts[0]: p.help for p in typer.main.get_command(app).commands["serve"].params}  # what --help shows
    assert "a line per request" in helps["--log-level"] and "'*'" in helps["--allowed-origins"]
    done = in_process("serve", "-m", "missing", "--context-size", "0")
    assert done.exit_code == 1 and "--context-size must be at least 1 (got 0)" in done.stderr
    assert "fit" in helps["--context-size"]


def test_serve_refuses_bad_defaults_before_loading(tmp_path):
    """serve's sampling defaults and chat template arguments: a bad value is one line naming it,
    exit 1, before any model is loaded (the model named here does not exist)."""
    missing = str(tmp_path / "missing")
    cases = [
        (["--chat-template-args", "{enable_thinking: false}"], "--chat-template-args '{enable_thinking: false}' is not valid JSON"),
        (["--chat-template-args", "[1]"], "--chat-template-args '[1]' must be a JSON object"),
        (["--temp", "-1"], "--temp -1.0: temperature must be >= 0"),
        (["--top-p", "1.5"], "--top-p 1.5: top_p must be in [0, 1]"),
        (["--min-p", "-0.5"], "--min-p -0.5: min_p must be in [0, 1]"),
    ]
    for args, message in cases:
        done = in_process("serve", "-m", missing, *args)
        lines = done.stderr.strip().splitlines()
        assert done.exit_code == 1 and len(lines) == 1 and message in lines[0], done.stderr
    import typer

    from dflash_mlx.cli import app

    helps = {p.opts[0]: p.help for p in typer.main.get_command(app).commands["serve"].params}  # what --help shows
    for flag in ("--temp", "--top-p", "--top-k", "--min-p"):
        assert "A request's own value wins; then this flag; then the target's generation_config.json" in helps[flag]
    assert "enable_thinking" in helps["--chat-template-args"]


def test_draft_window_flag_and_the_pairs_default(tmp_path):
    """--draft-window: a bad value is one line before loading; the demo draft keeps its training
    window unless told ('all': the whole context, N: the last N tokens), any other draft its whole
    context (docs/design.md, "The draft's context")."""
    from dflash_mlx import defaults

    for bad in ("0", "-3", "x"):
        done = in_process("generate", "-m", str(tmp_path / "missing"), "--draft-window", bad, "-p", "hi")
        assert done.exit_code == 1 and f"--draft-window {bad!r}" in done.stderr, done.stderr
    assert load("demo")[0].draft_window == defaults.DEMO_DRAFT_WINDOW == 1024
    assert load("demo", draft_window=None)[0].draft_window is None
    assert load("demo", draft_window=256)[0].draft_window == 256
    target_dir, _ = defaults.demo()
    tiny.write_draft(tmp_path / "draft", tiny.draft_config(json.loads(Path(target_dir, "config.json").read_text())))
    assert load(target_dir, draft=str(tmp_path / "draft"))[0].draft_window is None
    done = in_process("generate", "-m", "demo", "--draft-window", "all", "-p", "def add(a, b):", "--max-tokens", "8", "--json")
    assert done.exit_code == 0, done.stderr
