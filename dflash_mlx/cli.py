"""The ``dflash-mlx`` command line."""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Annotated, List, Optional

import typer

app = typer.Typer(
    help="Lossless DFlash speculative decoding for Qwen3.5 models on MLX.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _fail(message: str) -> None:
    """One clear line and exit 1; with ``DFLASH_MLX_DEBUG=1``, the exception being handled (if
    any) is re-raised instead, traceback and all, for bug reports."""
    if os.environ.get("DFLASH_MLX_DEBUG") == "1" and sys.exc_info()[1] is not None:
        raise
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=1)


@app.callback()
def main() -> None:
    """Lossless DFlash speculative decoding for Qwen3.5 models on MLX."""



# Model and decoding options shared by chat, generate and bench.
Model = Annotated[Optional[str], typer.Option("--model", "-m", help="Target: local folder, Hugging Face repo id, a named pair (qwen3-4b, qwen3-8b, qwen3-coder-30b-a3b, llama-3.1-8b, gpt-oss-20b, gpt-oss-120b, gemma-4-26b-a4b, gemma-4-31b, gemma-4-12b: the target and z-lab's draft for it, downloaded as published), 'demo' (the tiny pair shipped in the package; works offline) or 'scripted' (a tiny pair with fixed answers for trying coding agents against serve, made on first use). Default: Qwopus3.5-9B-Coder, converted to MLX 4-bit on first use.")]
Draft = Annotated[Optional[str], typer.Option("--draft", "-d", help="DFlash draft folder or repo id. Default with the default model: z-lab's Qwen3.5-9B draft converted for Qwopus; with --model demo: the demo draft; with another --model: none (target alone).")]
DraftQuant = Annotated[str, typer.Option("--draft-quant", help="Quantize the draft at load: w4, w8, w4:gs32 … or none.")]
Exact = Annotated[bool, typer.Option("--exact", help="On an Apple GPU: every quantized layer runs one kernel for every row count, so greedy output is token for token the target's alone and a batched request its answer alone, whatever that costs. Default: where that costs a layer more than 3% (measured per layer, `dflash-mlx doctor --tune` prints it), the fastest kernel at each row count, whose only divergence is at the target's top-2 near-ties (`bench` reports them). No effect off Apple GPUs.")]
ServeExact = Annotated[bool, typer.Option("--exact/--fastest", help="On an Apple GPU: --exact (the server's default) runs every quantized layer through one kernel for every row count, so that a batched request is bit for bit its answer alone and greedy output the target's alone; --fastest takes the fastest kernel at each row count where exactness costs a layer more than 3% (a request's bits may then follow its batch-mates' rows, and greedy output may part from the target's at its top-2 near-ties). No effect off Apple GPUs.")]
DraftWindow = Annotated[str, typer.Option("--draft-window", help="The draft's context: keep only the last N tokens' features in its cache (its attention and the prompt's prefill stop growing with the context), or 'all'. Default 'auto': the demo draft its training window (1024 tokens), any other draft all of its context.")]
BlockTokens = Annotated[str, typer.Option("--block-tokens", "-b", help="Tokens per draft block: 'auto' (default) picks each cycle's size from the measured cost of a cycle and the draft's acceptance, down to 1 (plain decoding) when drafting does not pay; 'auto:N' caps it at N; N drafts exactly N every cycle (1 .. the draft's block size; 1 = the target alone).")]
MaxTokens = Annotated[int, typer.Option("--max-tokens", help="Stop an answer after this many tokens.")]
Temp = Annotated[float, typer.Option("--temp", help="Sampling temperature; 0 is greedy.")]
TopP = Annotated[float, typer.Option("--top-p", help="Nucleus sampling: keep the most likely tokens until their mass reaches this, in [0, 1] (1.0 or 0 = off). Filters apply in mlx-lm's order (top-p, min-p, top-k) to the untempered distribution; the temperature comes last.")]
TopK = Annotated[int, typer.Option("--top-k", help="Keep only the k most likely tokens (0 = off).")]
MinP = Annotated[float, typer.Option("--min-p", help="Drop tokens below min_p times the top probability, in [0, 1] (0 = off).")]
Seed = Annotated[Optional[int], typer.Option("--seed", help="Random seed for sampling.")]
Think = Annotated[bool, typer.Option("--think/--no-think", help="Thinking mode of the chat template (Qwen3.5 enable_thinking).")]


Stages = Annotated[Optional[str], typer.Option("--stages", help="Under mlx.launch (the target pipelined over the ranks): layers per rank, comma-separated in rank order (e.g. 10,14). Default: balanced by weight bytes, rank 0 counting the embedding and the last rank the head and the draft.")]
PeerTimeout = Annotated[float, typer.Option("--peer-timeout", help="Under mlx.launch: seconds a request may go without an answer from the other ranks before every rank stops with an error (a rank that dies is noticed at once).")]
PromptCacheDir = Annotated[Optional[Path], typer.Option("--prompt-cache-dir", envvar="DFLASH_MLX_PROMPT_CACHE_DIR", help="Folder of the prefix cache's disk tier: each prompt's caches (attention K/V, Gated DeltaNet states at its checkpoints, the draft's context) as safetensors, so that a restarted server or chat resumes a long prompt instead of prefilling it again. Several servers may share it. Default: prompt-cache/ under $DFLASH_MLX_HOME (~/.cache/dflash-mlx).")]
PromptCacheDiskGb = Annotated[float, typer.Option("--prompt-cache-disk-gb", help="Disk space for --prompt-cache-dir (GB); the least recently used entries go first. 0 turns the disk tier off. Under mlx.launch none is kept.")]


def _prompt_store(loaded, directory: Optional[Path], gb: float):
    """The prefix cache's disk tier for ``serve`` and ``chat`` (None: off, or pipelined)."""
    if gb < 0:
        _fail(f"--prompt-cache-disk-gb must not be negative (got {gb})")
    if gb == 0 or not loaded.runner.keeps_prompt_cache:
        return None
    from .prompt_store import PromptStore, default_directory

    return PromptStore.for_model(loaded, directory or default_directory(), int(gb * 1e9))


def _load(model: Optional[str], draft: Optional[str], draft_quant: str, stages: Optional[str] = None,
          peer_timeout: float = 30.0, reads_keyboard: bool = False, draft_window: str = "auto", exact: bool = False):
    """Load (or, for the default pair, first convert) the models; one clear line on failure.
    Under ``mlx.launch`` every rank loads its stage of the target (refused for a command that
    ``reads_keyboard``: mlx.launch forwards no standard input)."""
    from . import api
    from .defaults import SCRIPTED, resolve
    from .loading import CheckpointError

    if peer_timeout <= 0:
        _fail(f"--peer-timeout must be positive (got {peer_timeout})")
    window = _draft_window(draft_window)
    try:
        if model == SCRIPTED:
            from .agents import scripted_pair

            target_dir, draft_dir = scripted_pair()
            model, draft = str(target_dir), draft or str(draft_dir)
        else:
            model, draft = resolve(model, draft)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loaded = api.load(model, draft=draft, draft_quant=draft_quant, stages=stages, peer_timeout=peer_timeout,
                              draft_window=window, exact=exact)
    except (CheckpointError, ValueError) as e:
        _fail(str(e))
    runner = loaded[0].runner
    if reads_keyboard and not runner.reads_input:
        _fail("chat reads the keyboard, which mlx.launch does not forward: pipelined, use `generate --prompt` or `serve`")
    part = runner.describe(loaded[0].draft)
    if part is not None:
        typer.secho(part, dim=True, err=True)
    for w in caught:
        typer.secho(f"warning: {w.message}", fg=typer.colors.YELLOW, err=True)
    return loaded


@contextmanager
def _ranks(loaded):
    """This process's role: the leader (one process, or rank 0 under mlx.launch) runs the command
    (printing, serving) and then closes the runner, which lets the other ranks exit; a follower
    takes part in the leader's requests until then, and exits."""
    from . import api
    from .pipeline import PeerLost

    runner = loaded.runner
    if not runner.leads:
        try:
            api.serve_pipeline(loaded)
        except PeerLost as e:
            _fail(str(e))
        _exit_now()
    lost = False
    try:
        yield
    except PeerLost as e:
        lost = True
        _fail(str(e))
    finally:
        if not lost:
            runner.close()
    if not runner.exits_cleanly:
        _exit_now()


def _exit_now() -> None:
    """Exit 0 without running C++ static destructors: once a ring group was used from the server's
    worker thread, MLX 0.32 sometimes aborts at interpreter exit ("terminate called without an
    active exception"), after all the work is done."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _check_block_tokens(loaded, block_tokens: str):
    """The parsed setting, or one clear line naming the bad value."""
    from .block_policy import BlockTokens

    try:
        setting = BlockTokens.parse(block_tokens)
        setting.cap(loaded[0].draft_block_size)
    except ValueError as e:
        _fail(str(e).replace("block_tokens", "--block-tokens", 1).replace("a draft model", "a draft (--draft)"))
    return setting


def _sampling(temp: float, top_p: float, top_k: int, seed: Optional[int], min_p: float = 0.0) -> dict:
    """The sampling flags as ``stream_generate`` arguments (mlx-lm's ``make_sampler`` semantics)."""
    from .sampling import Sampler

    try:
        Sampler(temperature=temp, top_p=top_p, top_k=top_k, min_p=min_p)
    except ValueError as e:
        _fail(str(e))
    return dict(temp=temp, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed)


class LogLevel(str, Enum):
    """mlx_lm.server's --log-level choices."""

    DEBUG = "DEBUG"
    INFO = "INFO"
    WARNING = "WARNING"
    ERROR = "ERROR"
    CRITICAL = "CRITICAL"


# serve --max-tokens-default: server.engine.DEFAULT_ANSWER_TOKENS, repeated here so that --help
# imports no server (tests/test_user_install.py checks that the two agree).
DEFAULT_ANSWER_TOKENS = 32768

SAMPLING_PRECEDENCE = ("A request's own value wins; then this flag; then the target's generation_config.json; "
                       "then greedy with no filters (mlx_lm.server's defaults).")


def _sampling_defaults(temp: Optional[float], top_p: Optional[float], top_k: Optional[int], min_p: Optional[float]) -> dict:
    """serve's --temp/--top-p/--top-k/--min-p (None: not given), checked as the sampler checks them."""
    from .sampling import Sampler

    given = dict(temperature=temp, top_p=top_p, top_k=top_k, min_p=min_p)
    flags = dict(temperature="--temp", top_p="--top-p", top_k="--top-k", min_p="--min-p")
    for name, value in given.items():
        if value is not None:
            try:
                Sampler(**{name: value})
            except ValueError as e:
                _fail(f"{flags[name]} {value}: {e}")
    return given


def _json_object(flag: str, text: Optional[str]) -> dict:
    """A flag's JSON object (None: {}); anything else is one clear line naming the value."""
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except ValueError as e:
        _fail(f"{flag} {text!r} is not valid JSON ({e}); give an object, e.g. '{{\"enable_thinking\": false}}'")
    if not isinstance(value, dict):
        _fail(f"{flag} {text!r} must be a JSON object (e.g. '{{\"enable_thinking\": false}}'), not {type(value).__name__}")
    return value


def _draft_window(text: str):
    """``--draft-window``: ``auto``, ``all`` (None: the whole context) or a positive token count."""
    text = text.strip().lower()
    if text in ("auto", "all"):
        return None if text == "all" else "auto"
    if not text.isdigit() or int(text) < 1:
        _fail(f"--draft-window {text!r}: expected a positive token count, 'all' or 'auto'")
    return int(text)


@app.command()
def chat(
    model: Model = None,
    draft: Draft = None,
    draft_quant: DraftQuant = "none",
    draft_window: DraftWindow = "auto",
    block_tokens: BlockTokens = "auto",
    max_tokens: MaxTokens = 2048,
    temp: Temp = 0.0,
    top_p: TopP = 1.0,
    top_k: TopK = 0,
    min_p: MinP = 0.0,
    seed: Seed = None,
    system: Annotated[Optional[str], typer.Option("--system", help="System prompt.")] = None,
    think: Think = False,
    exact: Exact = False,
    prompt_cache_dir: PromptCacheDir = None,
    prompt_cache_disk_gb: PromptCacheDiskGb = 16.0,
) -> None:
    """Chat in the terminal; answers stream as they are committed. /help lists the commands."""
    from .chat import ChatSession, run_chat
    from .prompt_cache import PromptCachePool

    sampling = _sampling(temp, top_p, top_k, seed, min_p)
    loaded, tokenizer = _load(model, draft, draft_quant, reads_keyboard=True, draft_window=draft_window, exact=exact)
    _check_block_tokens((loaded, tokenizer), block_tokens)
    generation = dict(max_tokens=max_tokens, block_tokens=block_tokens, **sampling)
    store = _prompt_store(loaded, prompt_cache_dir, prompt_cache_disk_gb)
    # With the disk tier, a pool of one history in RAM (the conversation) over it.
    cache = {"cache": PromptCachePool(0, store=store)} if store is not None else {}
    session = ChatSession(loaded, tokenizer, system=system, think=think, generation=generation, **cache)
    run_chat(session, speculative=loaded.draft is not None)


@app.command()
def generate(
    model: Model = None,
    draft: Draft = None,
    prompt: Annotated[Optional[str], typer.Option("--prompt", "-p", help="The prompt; read from stdin when omitted (its final newline dropped).")] = None,
    draft_quant: DraftQuant = "none",
    draft_window: DraftWindow = "auto",
    block_tokens: BlockTokens = "auto",
    max_tokens: MaxTokens = 256,
    temp: Temp = 0.0,
    top_p: TopP = 1.0,
    top_k: TopK = 0,
    seed: Seed = None,
    min_p: MinP = 0.0,
    stop: Annotated[Optional[List[str]], typer.Option("--stop", help="Stop string (repeatable).")] = None,
    system: Annotated[Optional[str], typer.Option("--system", help="System prompt (with the chat template).")] = None,
    think: Think = False,
    chat_template: Annotated[bool, typer.Option("--chat-template/--no-chat-template", help="Wrap the prompt as a user message in the chat template.")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON record (text, tokens, timings, acceptance) instead of the text.")] = False,
    stages: Stages = None,
    peer_timeout: PeerTimeout = 30.0,
    exact: Exact = False,
) -> None:
    """Generate one completion: text to stdout, statistics to stderr."""
    sampling = _sampling(temp, top_p, top_k, seed, min_p)
    loaded, tokenizer = _load(model, draft, draft_quant, stages, peer_timeout, draft_window=draft_window, exact=exact)
    with _ranks(loaded):
        if prompt is None and not loaded.runner.reads_input:
            _fail("give the prompt with --prompt: mlx.launch does not forward standard input")
        if prompt is None:  # a file or `echo` ends with a newline that is not part of the request
            prompt = sys.stdin.read().removesuffix("\n")
        _generate(loaded, tokenizer, prompt, block_tokens, max_tokens, sampling, stop, system, think,
                  chat_template, as_json)


def _generate(loaded, tokenizer, prompt, block_tokens, max_tokens, sampling, stop, system, think,
              chat_template, as_json) -> None:
    from . import api
    from .block_policy import describe

    setting = _check_block_tokens((loaded, tokenizer), block_tokens)
    use_template = chat_template and tokenizer.chat_template is not None
    head = [{"role": "system", "content": system}] if system else []
    request = head + [{"role": "user", "content": prompt}] if use_template else prompt
    text, tokens, last = "", [], None
    try:
        for last in api.stream_generate(
            loaded, tokenizer, request, max_tokens=max_tokens, block_tokens=block_tokens,
            stop=stop, enable_thinking=think, **sampling,
        ):
            text += last.text
            tokens.append(last.token)
            if not as_json:
                sys.stdout.write(last.text)
                sys.stdout.flush()
    except (ValueError, TypeError) as e:
        _fail(str(e))
    stats = dict(
        prompt_tokens=last.prompt_tokens, prompt_tps=last.prompt_tps, generation_tokens=last.generation_tokens,
        generation_tps=last.generation_tps, peak_memory_gb=last.peak_memory, finish_reason=last.finish_reason,
        cycles=last.cycles, tokens_per_cycle=last.tokens_per_cycle, acceptance_rate=last.acceptance_rate,
        block_tokens=str(setting), block_histogram={str(b): n for b, n in sorted(last.block_histogram.items())},
        draft=loaded.draft_kind,
    )
    if as_json:
        print(json.dumps({"text": text, "tokens": tokens, **stats}))
    else:
        print()
        line = f"{last.generation_tokens} tokens, {last.generation_tps:.1f} tok/s"
        if loaded.draft_kind is not None:
            line += f", {last.tokens_per_cycle:.2f} tokens/cycle, acceptance {last.acceptance_rate:.0%}, {describe(last.block_histogram)}"
        typer.secho(line, dim=True, err=True)


@app.command()
def bench(
    model: Model = None,
    draft: Draft = None,
    draft_quant: DraftQuant = "none",
    draft_window: DraftWindow = "auto",
    block_tokens: Annotated[str, typer.Option("--block-tokens", "-b", help="Block settings to compare, comma-separated: sizes, 'auto', 'auto:N' (e.g. 4,8,auto). Default: 2, 3, 4, 8, 16 up to the draft's block size, the draft's own, and auto.")] = "",
    max_tokens: MaxTokens = 256,
    temp: Temp = 0.0,
    top_p: TopP = 1.0,
    top_k: TopK = 0,
    min_p: MinP = 0.0,
    seed: Seed = None,
    suite: Annotated[List[str], typer.Option("--suite", "-s", help="Built-in workload(s): edit (the answer copies the prompt), code (fresh code), prose. Repeatable.")] = ["edit", "code", "prose"],
    prompt_file: Annotated[Optional[Path], typer.Option("--prompt-file", help="Extra workload 'file': a text file (one prompt) or .jsonl ({\"prompt\": ...} per line).")] = None,
    context: Annotated[str, typer.Option("--context", help="Put this much real file context (Python standard library source) before each prompt, comma-separated token counts (e.g. 1k,4k,8k; k = 1024): shows how speedup and the chosen block move with context length. Default: none.")] = "",
    repeats: Annotated[int, typer.Option("--repeats", help="Measure each prompt this many times (each side: every prompt's median, then a row's prompts' tokens over their seconds). Runs on a busy or throttling machine differ by 10-20%; one repeat cannot tell 5% apart.")] = 3,
    chat_template: Annotated[bool, typer.Option("--chat-template/--no-chat-template", help="Wrap prompts in the chat template.")] = True,
    out: Annotated[Optional[Path], typer.Option("--out", help="Write all results as JSON here.")] = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Write a PNG: tok/s per suite side by side, and accepted lengths.")] = None,
    concurrency: Annotated[Optional[str], typer.Option("--concurrency", help="Instead of the block table: send this many requests at once (comma-separated levels, e.g. 1,2,4; the suites' prompts in turn), greedy, through DFlash batched, our target alone batched and mlx-lm's batch_generate on mlx-lm's build of the target: aggregate and per-request tokens per second, each request's answer checked against the request alone. The block setting is the first of --block-tokens (default auto).")] = None,
    mlx_lm: Annotated[bool, typer.Option("--mlx-lm/--no-mlx-lm", help="Also run mlx-lm's own stream_generate on mlx-lm's build of the target, as a second baseline (loads the target a second time; not under mlx.launch).")] = True,
    stages: Stages = None,
    peer_timeout: PeerTimeout = 30.0,
    exact: Exact = False,
) -> None:
    """Target alone vs DFlash, interleaved: speed, acceptance, block sizes used, identical outputs.

    With --temp > 0 both sides sample (same seed per run); outputs then differ by design and
    the 'identical' column is n/a. The auto rows share what they learn about cycle costs
    across prompts, as chat and the server do across requests. Under mlx.launch (the target
    pipelined) the table also gives the milliseconds per pass through the pipeline.
    """
    from . import bench as bench_lib

    sampling = _sampling(temp, top_p, top_k, seed, min_p)
    unknown = [s for s in suite if s not in bench_lib.SUITES]
    if unknown:
        _fail(f"unknown suite {unknown[0]!r}: choose from {', '.join(bench_lib.SUITES)}")
    if repeats < 1:
        _fail(f"--repeats {repeats}: at least 1")
    try:
        contexts = bench_lib.parse_context_sizes(context)
    except ValueError as e:
        _fail(f"--context {context!r}: {e}")
    workloads = {name: bench_lib.SUITES[name] for name in suite}
    if prompt_file is not None:
        if not prompt_file.is_file():
            _fail(f"--prompt-file {prompt_file} does not exist")
        workloads["file"] = bench_lib.load_prompt_file(prompt_file)
    levels = None
    if concurrency is not None:
        try:
            levels = [int(x) for x in concurrency.split(",") if x.strip()]
        except ValueError:
            levels = []
        if not levels or min(levels) < 1:
            _fail(f"--concurrency {concurrency!r}: comma-separated request counts, each at least 1 (e.g. 1,2,4)")
        if temp != 0:
            _fail("--concurrency compares greedy answers: leave --temp at 0")
    loaded, tokenizer = _load(model, draft, draft_quant, stages, peer_timeout, draft_window=draft_window, exact=exact)
    with _ranks(loaded):
        if levels is not None:
            if not loaded.runner.batches:
                _fail("--concurrency: a pipelined target serves one request at a time")
            _bench_concurrency(loaded, tokenizer, block_tokens, max_tokens, workloads, levels, repeats, chat_template,
                               mlx_lm)
            return
        _bench(loaded, tokenizer, block_tokens, max_tokens, temp, sampling, workloads, contexts, context, repeats,
               chat_template, out, plot, mlx_lm and loaded.runner.holds_whole_target, draft_quant)


def _bench_concurrency(loaded, tokenizer, block_tokens, max_tokens, workloads, levels, repeats, chat_template,
                       mlx_lm) -> None:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from . import bench as bench_lib

    if loaded.draft_kind is None:
        _fail("bench compares with DFlash: give a draft (--draft) or use the default model")
    block = str(_check_block_tokens((loaded, tokenizer), (block_tokens.split(",")[0].strip() or "auto")))
    prompts = [p for suite_prompts in workloads.values() for p in suite_prompts]
    chat = chat_template and tokenizer.chat_template is not None
    baseline = bench_lib.load_mlx_lm(loaded.target_path) if mlx_lm else None
    console = Console(stderr=True)
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("requests at once", total=len(levels) * repeats * (2 + (baseline is not None)))
        rows = bench_lib.concurrency_rows(loaded, tokenizer, prompts, levels, max_tokens, chat, block, baseline, repeats,
                                          lambda done, what: progress.update(task, completed=done, description=what))
    Console(width=None if sys.stdout.isatty() else 150).print(bench_lib.concurrency_table(rows))
    if not all(r["identical"] for r in rows):
        _fail("a request's answer in a batch differs from its answer alone: please report this")


def _bench(loaded, tokenizer, block_tokens, max_tokens, temp, sampling, workloads, contexts, context, repeats,
           chat_template, out, plot, mlx_lm, draft_quant) -> None:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from . import bench as bench_lib

    if loaded.draft_kind is None:
        _fail("bench compares with DFlash: give a draft (--draft) or use the default model")
    blocks = [b.strip() for b in block_tokens.split(",") if b.strip()] or bench_lib.default_blocks(loaded.draft_block_size)
    blocks = [str(_check_block_tokens((loaded, tokenizer), b)) for b in blocks]
    try:
        prefixes = {n: bench_lib.file_context(tokenizer, n) for n in contexts}
    except ValueError as e:
        _fail(f"--context {context!r}: {e}")
    chat = chat_template and tokenizer.chat_template is not None
    console = Console(stderr=True)
    jobs = [
        (name, n, i, bench_lib.with_context(prompt, prefixes[n]))
        for name, prompts in workloads.items() for n in contexts for i, prompt in enumerate(prompts) for _ in range(repeats)
    ]
    baseline = bench_lib.load_mlx_lm(loaded.target_path) if mlx_lm else None
    bench_lib.warm_up(loaded, tokenizer, blocks, chat, sampling, baseline)
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("bench", total=len(jobs) * (1 + (baseline is not None) + len(blocks)))
        runs = bench_lib.run_all(loaded, tokenizer, jobs, blocks, max_tokens, chat, sampling, baseline,
                                 lambda done, description: progress.update(task, completed=done, description=description))
        progress.update(task, completed=progress.tasks[0].total)
    if temp == 0:
        bench_lib.find_divergences(runs, bench_lib.prompt_tokens(tokenizer, jobs, chat), bench_lib.target_logits(loaded))
    rows = bench_lib.summarize(runs)
    table = bench_lib.table(rows, show_context=any(contexts), mlx_lm=baseline is not None, sampled=temp > 0,
                            pass_ms=loaded.runner.ranks > 1)
    Console(width=None if sys.stdout.isatty() else 200).print(table)
    backend = bench_lib.compute_backend()
    if bench_lib.reference_blas_only(backend):
        console.print(
            "[dim]MLX ran on the CPU with the reference BLAS its wheel bundles: a verify block "
            "pays every row's products in full. An optimised BLAS makes that cheap, e.g. "
            "LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 (see docs/benchmarks.md).[/dim]"
        )
    meta = dict(
        target=str(loaded.target_path), draft=str(loaded.draft_path), draft_kind=loaded.draft_kind, draft_quant=draft_quant, blocks=blocks,
        contexts=contexts, max_tokens=max_tokens, repeats=repeats, date=time.strftime("%Y-%m-%d %H:%M:%S"),
        backend=backend, ranks=loaded.runner.ranks, **sampling,
    )
    if out is not None:
        bench_lib.save_json(out, rows, runs, meta)
    if plot is not None:
        try:
            bench_lib.plot(plot, rows)
        except RuntimeError as e:
            _fail(str(e))
    if temp == 0 and not all(r["identical"] for r in rows):
        lines, real = bench_lib.divergence_report(rows)
        for line in lines:
            console.print(f"greedy divergence, {line}")
        if real:
            _fail("greedy DFlash output left the target alone's where the target's top two tokens were not a "
                  "floating-point near-tie: please report this with the lines above")
        console.print("every greedy divergence is at a near-tie of the target's top two tokens: a verify pass and a "
                      "decode step rounded differently there (docs/kernels.md lists where they can on a Mac)")


def served_name(model: Optional[str]) -> str:
    """The model id clients ask for: the repo id, ``demo``, or a local folder's name."""
    from . import defaults
    from .convert import DEFAULT_TARGET

    if model is None:
        return DEFAULT_TARGET
    if model in (defaults.DEMO, defaults.SCRIPTED):
        return model
    path = Path(model).expanduser()
    return path.name if path.exists() else model


@app.command()
def serve(
    model: Model = None,
    draft: Draft = None,
    draft_quant: DraftQuant = "none",
    draft_window: DraftWindow = "auto",
    block_tokens: BlockTokens = "auto",
    host: Annotated[str, typer.Option("--host", help="Interface to listen on (loopback by default: only this machine).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="TCP port.")] = 8080,
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="DFLASH_MLX_API_KEY", help="Require 'Authorization: Bearer KEY' on /v1 endpoints.")] = None,
    max_tokens: Annotated[Optional[int], typer.Option("--max-tokens", help="Cap on tokens generated per request, whatever the request asks. Default: none (each request's own max_tokens, up to the context; without one, --max-tokens-default).")] = None,
    max_tokens_default: Annotated[int, typer.Option("--max-tokens-default", help="Tokens an answer may have when the request gives no max_tokens (Codex, Continue, llm and Aider send none; Claude Code and opencode ask 32,000), still within the context and --max-tokens: one answer caught in a repetition loop stops here instead of holding a slot until the context is full.")] = DEFAULT_ANSWER_TOKENS,
    context_size: Annotated[Optional[int], typer.Option("--context-size", help="Context limit in tokens, prompt and answer together: a prompt that leaves no room for an answer is refused (400, with the numbers), answers stop where the context is full. Default: the longest context whose caches fit in this machine's memory (MLX's recommended working set on a Mac, physical memory elsewhere; doctor's estimate) beside the weights and --prompt-cache-gb, at most the target's max_position_embeddings; with --model demo, 65536 (its 4,096 cannot hold an agent's first request).")] = None,
    model_name: Annotated[Optional[str], typer.Option("--model-name", help="Model id clients ask for (default: the repo id, 'demo', or the target folder's name).")] = None,
    model_alias: Annotated[Optional[List[str]], typer.Option("--model-alias", help="Another model id to list in /v1/models and serve without a log line (repeatable). Any id a request names is served by the loaded model; ids that are neither this nor --model-name are logged once.")] = None,
    max_request_bytes: Annotated[int, typer.Option("--max-request-bytes", help="Reject request bodies larger than this.")] = 8 << 20,
    prompt_cache_gb: Annotated[float, typer.Option("--prompt-cache-gb", help="Memory for prefix caches kept between requests (GB): several token histories (a chat, an editor's completions) with their Gated DeltaNet checkpoints; the least recently used go first. The most recent one is always kept. Under mlx.launch none are kept.")] = 4.0,
    prompt_cache_dir: PromptCacheDir = None,
    prompt_cache_disk_gb: PromptCacheDiskGb = 16.0,
    temp: Annotated[Optional[float], typer.Option("--temp", help=f"Default sampling temperature (0: greedy) for requests that give none. {SAMPLING_PRECEDENCE}")] = None,
    top_p: Annotated[Optional[float], typer.Option("--top-p", help=f"Default nucleus sampling mass, in [0, 1] (0 or 1.0: off; filters in mlx-lm's order: top-p, min-p, top-k). {SAMPLING_PRECEDENCE}")] = None,
    top_k: Annotated[Optional[int], typer.Option("--top-k", help=f"Default top-k (0: off). {SAMPLING_PRECEDENCE}")] = None,
    min_p: Annotated[Optional[float], typer.Option("--min-p", help=f"Default min-p (0.0: off). {SAMPLING_PRECEDENCE}")] = None,
    chat_template_args: Annotated[Optional[str], typer.Option("--chat-template-args", help="""A JSON object of arguments for the chat template of every request, e.g. '{"enable_thinking": false}' (as mlx_lm.server); a request's own (chat_template_kwargs, or its thinking switch) win.""")] = None,
    log_level: Annotated[LogLevel, typer.Option("--log-level", case_sensitive=False, help="Logging level (as mlx_lm.server). At INFO a line per request: method and path, status, seconds, protocol, model, prompt tokens, reused (prefix-cache) tokens, generated tokens, finish reason; refusals (4xx) at WARNING.")] = LogLevel.INFO,
    allowed_origins: Annotated[str, typer.Option("--allowed-origins", help="Origins browsers may call the server from (CORS), comma-separated; '*' (the default, as mlx_lm.server): any.")] = "*",
    max_concurrent: Annotated[int, typer.Option("--max-concurrent", help="Generations decoded together: their draft blocks go through one draft pass and their rows through one target pass per cycle (an editor's completion does not wait for a chat answer to finish; each answer is the one it gets alone). 1: one at a time, the others wait. Under mlx.launch: 1.")] = 4,
    max_queue: Annotated[int, typer.Option("--max-queue", help="Requests that may wait for a slot beyond --max-concurrent; more are refused with a 503 and Retry-After.")] = 64,
    prefill_step_size: Annotated[Optional[int], typer.Option("--prefill-step-size", help="Prompt tokens per prefill chunk, a multiple of 64 (the recurrence's chunk), the same for every request: while a prompt comes in, the other streams pause for one chunk per round. Default: 2048, as mlx-lm's; 512 makes those pauses a quarter as long for a little more prefill time.")] = None,
    stages: Stages = None,
    peer_timeout: PeerTimeout = 30.0,
    exact: ServeExact = True,
) -> None:
    """Serve an OpenAI-compatible API (chat, completions with FIM, models, health, metrics) and
    Anthropic's Messages and OpenAI's Responses APIs."""
    import logging

    from .server import create_app, serve as run_server

    if prompt_cache_gb < 0:
        _fail(f"--prompt-cache-gb must not be negative (got {prompt_cache_gb})")
    if prompt_cache_disk_gb < 0:
        _fail(f"--prompt-cache-disk-gb must not be negative (got {prompt_cache_disk_gb})")
    if max_tokens is not None and max_tokens < 1:
        _fail(f"--max-tokens must be at least 1 (got {max_tokens})")
    if max_tokens_default < 1:
        _fail(f"--max-tokens-default must be at least 1 (got {max_tokens_default})")
    if context_size is not None and context_size < 1:
        _fail(f"--context-size must be at least 1 (got {context_size})")
    from . import defaults as named

    demo_context = context_size is None and named.context_size(model, None) is not None
    context_size = named.context_size(model, context_size)
    if max_concurrent < 1:
        _fail(f"--max-concurrent must be at least 1 (got {max_concurrent})")
    if max_queue < 0:
        _fail(f"--max-queue must not be negative (got {max_queue})")
    if prefill_step_size is not None and (prefill_step_size < 64 or prefill_step_size % 64):
        _fail(f"--prefill-step-size must be a positive multiple of 64 (got {prefill_step_size})")
    sampling = _sampling_defaults(temp, top_p, top_k, min_p)
    template_args = named.template_args(model, _json_object("--chat-template-args", chat_template_args))
    origins = [o.strip() for o in allowed_origins.split(",") if o.strip()]
    log_level = LogLevel(log_level).value
    logging.basicConfig(level=log_level, format="%(asctime)s - %(levelname)s - %(message)s")
    loaded, tokenizer = _load(model, draft, draft_quant, stages, peer_timeout, draft_window=draft_window, exact=exact)
    with _ranks(loaded):
        _check_block_tokens((loaded, tokenizer), block_tokens)
        if not loaded.runner.batches and max_concurrent > 1:
            typer.secho(f"--max-concurrent {max_concurrent}: a pipelined target serves one generation at a time "
                        "(its ranks run one request's cycle in lockstep); serving with 1", err=True)
            max_concurrent = 1
        name = model_name or served_name(model)
        app_ = create_app(
            loaded, tokenizer, name, api_key=api_key, max_tokens_cap=max_tokens, context_limit=context_size,
            max_request_bytes=max_request_bytes, block_tokens=block_tokens, prompt_cache_bytes=int(prompt_cache_gb * 1e9),
            sampling=sampling, chat_template_args=template_args, allowed_origins=origins, draft_quant=draft_quant,
            model_aliases=model_alias or (), max_concurrent=max_concurrent, max_queue=max_queue,
            max_tokens_default=max_tokens_default, prefill_step_size=prefill_step_size,
            prompt_store=_prompt_store(loaded, prompt_cache_dir, prompt_cache_disk_gb),
        )
        engine = app_.state.engine
        if demo_context:
            engine.context_source = "the demo pair's default; --context-size to change it"
        defaults = ", ".join(f"{k} {v}" for k, v in engine.sampling.items())
        typer.secho(f"serving {name!r} on http://{host}:{port}/v1; context limit {engine.context_limit} tokens "
                    f"({engine.context_source}); answers without max_tokens stop at {max_tokens_default} tokens; "
                    f"sampling defaults: {defaults}", err=True)
        run_server(app_, host, port, log_level)


@app.command()
def agent(
    client: Annotated[str, typer.Argument(help="claude (Claude Code), codex (Codex CLI) or opencode.")],
    args: Annotated[Optional[List[str]], typer.Argument(help="Given to the client, after --: e.g. -- -p 'fix the tests'.")] = None,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="What to serve, as for serve ('demo' gets --context-size 65536 unless given, as serve gives it); 'scripted': a tiny pair with fixed answers that calls the client's shell tool when asked to 'run the scripted tool' (made on first use, no download: a check that the client works against the server, in seconds).")] = None,
    draft: Draft = None,
    draft_quant: DraftQuant = "none",
    base_url: Annotated[Optional[str], typer.Option("--base-url", help="Use the server already running here (e.g. http://127.0.0.1:8080) instead of starting one.")] = None,
    port: Annotated[Optional[int], typer.Option("--port", help="Port for the server this command starts (default: a free one).")] = None,
    context_size: Annotated[Optional[int], typer.Option("--context-size", help="Given to the server this command starts.")] = None,
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="DFLASH_MLX_API_KEY", help="The server's API key, if it has one (default: a placeholder).")] = None,
    client_bin: Annotated[Optional[str], typer.Option("--client-bin", help="The client's executable (default: claude, codex or opencode on PATH).")] = None,
    serve_log: Annotated[Optional[Path], typer.Option("--serve-log", help="Where the started server's output goes (default: $DFLASH_MLX_HOME/agent-serve.log).")] = None,
) -> None:
    """Run a coding agent (Claude Code, Codex or opencode) against a local server: starts `serve`
    (or uses --base-url), runs the client with the base URL, the model name for every model it asks
    for, a placeholder key, the context window and its telemetry and update checks off (through its
    environment and command line; your configuration files are not touched), then stops the server."""
    import shutil
    import subprocess

    from . import agents

    if client not in agents.CLIENTS:
        _fail(f"unknown client {client!r}: choose from {', '.join(agents.CLIENTS)}")
    binary = client_bin or shutil.which(client)
    if binary is None:
        _fail(f"{client} is not on PATH: install {agents.DOCS[client]} (npm install -g {agents.PACKAGES[client]}), "
              "or give --client-bin")
    if base_url is not None:
        name, context = _server_info(base_url.rstrip("/"))
        raise typer.Exit(code=_run_client(agents, client, base_url.rstrip("/"), name, context, api_key, args, binary))
    serve_args, name, context = _agent_serve_args(client, model, draft, draft_quant, context_size)
    port = port or _free_port()
    url = f"http://127.0.0.1:{port}"
    from .paths import home

    log_path = serve_log or home() / "agent-serve.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        server = subprocess.Popen([sys.executable, "-m", "dflash_mlx.cli", "serve", *serve_args, "--port", str(port),
                                   *(["--api-key", api_key] if api_key else [])], stdout=log, stderr=subprocess.STDOUT)
        try:
            typer.secho(f"starting dflash-mlx serve on {url} (output: {log_path})", dim=True, err=True)
            if not _wait_for(url, server):
                _fail(f"the server stopped before answering: see {log_path}")
            code = _run_client(agents, client, url, name, context, api_key, args, binary)
        finally:
            server.terminate()
            try:
                server.wait(15)
            except subprocess.TimeoutExpired:
                server.kill()
    raise typer.Exit(code=code)


def _agent_serve_args(client: str, model: Optional[str], draft: Optional[str], draft_quant: str,
                      context_size: Optional[int]):
    """serve's arguments for ``agent``, the model name clients will use, and the context to tell
    them (serve applies the same rule for the demo, ``defaults.context_size``; the scripted pair's
    target holds ``scripted.CONTEXT`` positions)."""
    from . import defaults, scripted

    args = ["--draft-quant", draft_quant] + (["--model", model] if model else []) + (["--draft", draft] if draft else [])
    args += ["--context-size", str(context_size)] if context_size else []
    if model == defaults.SCRIPTED:
        return args, served_name(model), context_size or scripted.CONTEXT
    return args, served_name(model), defaults.context_size(model, context_size)


def _run_client(agents, client, url, name, context, api_key, args, binary) -> int:
    import subprocess

    launch = agents.launch(client, url, name, context, api_key, args or [], binary)
    return subprocess.call(launch.argv, env=agents.environment(launch))


def _get_json(url: str, timeout: float):
    """GET ``url``: (status, JSON body or None), with the standard library (``agent`` runs from a
    plain install, where no HTTP client package is guaranteed). Raises OSError when nothing answers."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            status, body = response.status, response.read()
    except urllib.error.HTTPError as e:  # an answer all the same
        status, body = e.code, e.read()
    try:
        return status, json.loads(body)
    except ValueError:
        return status, None


def _server_info(url: str):
    """The running server's model name and context limit (from /health)."""
    import http.client

    try:
        status, health = _get_json(f"{url}/health", timeout=10)
    except (OSError, ValueError, http.client.HTTPException) as e:  # ValueError: a URL urllib cannot parse
        _fail(f"no dflash-mlx server answers at {url}/health: {e}")
    if status != 200 or not isinstance(health, dict):
        _fail(f"no dflash-mlx server answers at {url}/health: HTTP {status}")
    return health.get("model"), health.get("context_limit")


def _wait_for(url: str, server) -> bool:
    """Wait until the server answers /health (a first use converts the default pair: no time limit)."""
    import http.client

    while server.poll() is None:
        try:
            if _get_json(f"{url}/health", timeout=1)[0] == 200:
                return True
        except (OSError, http.client.HTTPException):
            pass
        time.sleep(0.3)
    return False


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@app.command()
def doctor(
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="Target to check for memory (folder, repo id, 'demo' or a named pair such as qwen3-8b, as for serve); omit to check the machine only. Nothing is converted or downloaded beyond what loading the pair needs.")] = None,
    draft: Annotated[Optional[str], typer.Option("--draft", "-d", help="DFlash draft to include (with --model demo: the demo draft by default).")] = None,
    draft_quant: DraftQuant = "none",
    context: Annotated[int, typer.Option("--context", help="Context length (prompt + answer tokens) to size the caches for.")] = 8192,
    memory_gb: Annotated[Optional[float], typer.Option("--memory-gb", help="Memory to fit in, in GiB (default: MLX's recommended working set on a Mac, total memory elsewhere).")] = None,
    probe_tokens: Annotated[int, typer.Option("--probe-tokens", help="With a draft: tokens generated in each thinking mode to compare acceptance (0 = skip).")] = 48,
    tune: Annotated[bool, typer.Option("--tune", help="With --model: time MLX's stock quantized matmul against the verify kernels (per-row and tile) for every quantized matmul shape of the pair at 1..16 rows, print the table, what exactness (one kernel per layer for every row count) costs each shape and the pair, and which layers run what: exact where it costs a layer at most 3%, else the fastest at each row count (saved under $DFLASH_MLX_HOME; the first load of a pair on a GPU does this for shapes it has not seen; without --tune, doctor reads that saved table when it covers the pair). Off an Apple GPU there is nothing to tune.")] = False,
    exact: Exact = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    ranks: Annotated[int, typer.Option("--ranks", help="With --model: the memory of each rank of the target pipelined over this many machines (mlx.launch), each against this machine's budget.")] = 1,
    stages: Stages = None,
    prompt_cache_dir: PromptCacheDir = None,
    prompt_cache_disk_gb: PromptCacheDiskGb = 16.0,
) -> None:
    """Check this machine and a pair: device and GPU family, MLX versions, Metal, memory, each
    kernel's self-check, whether the pair fits at --context (or, with --ranks, each rank of a
    pipeline), and known acceptance killers; --tune re-times the quantized matmuls. Exits 1 when
    something is wrong, with the fix."""
    from . import doctor as doctor_lib
    from .loading import CheckpointError
    from .pipeline import stages as stages_lib

    if ranks < 1:
        _fail(f"--ranks must be at least 1 (got {ranks})")
    if (ranks > 1 or stages) and model is None:
        _fail("--ranks and --stages need --model (the pair to split)")
    try:
        counts = stages_lib.parse_counts(stages)
    except ValueError as e:
        _fail(str(e))

    if context < 1:
        _fail(f"--context must be at least 1 (got {context})")
    if memory_gb is not None and memory_gb <= 0:
        _fail(f"--memory-gb must be positive (got {memory_gb})")
    if probe_tokens < 0:
        _fail(f"--probe-tokens must be 0 or more (got {probe_tokens})")
    if model is None and draft is not None:
        _fail("--draft needs --model (the target it drafts for)")
    if tune and model is None:
        _fail("--tune needs --model (the pair whose quantized matmuls to time)")
    try:
        report = doctor_lib.diagnose(model, draft, draft_quant, context, memory_gb,
                                     probe_tokens, tune=tune, ranks=max(ranks, len(counts or [])), stages=counts,
                                     exact=exact, prompt_cache_dir=prompt_cache_dir,
                                     prompt_cache_disk_gb=prompt_cache_disk_gb)
    except (CheckpointError, ValueError) as e:
        _fail(str(e))
    if as_json:
        typer.echo(json.dumps(doctor_lib.as_json(report), indent=2))
    else:
        for line in doctor_lib.render(report):
            typer.echo(line)
    if report.failed:
        raise typer.Exit(code=1)


@app.command("train-draft")
def train_draft_command(
    context: typer.Context,
    model: Annotated[str, typer.Option("--model", "-m", help="Target to train a draft for (anything `load` accepts).")],
    data: Annotated[List[Path], typer.Option("--data", help="Training text: .txt/.py/... files, or .jsonl with a 'text' field per line (repeatable).")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Output folder: the draft in z-lab's layout (+ training_state/ for --resume).")],
    layers: Annotated[int, typer.Option("--layers", help="Draft decoder layers.")] = 2,
    taps: Annotated[str, typer.Option("--taps", help="Target layers whose outputs the draft reads, comma-separated (e.g. 1,3,5); default: spread evenly, one per draft layer.")] = "",
    block_size: Annotated[int, typer.Option("--block-size", help="Draft block size (tokens per block, first one the anchor).")] = 8,
    steps: Annotated[int, typer.Option("--steps", help="Optimizer steps in total (a resumed run continues up to this).")] = 1000,
    seq_len: Annotated[int, typer.Option("--seq-len", help="Tokens per training window.")] = 256,
    anchors: Annotated[int, typer.Option("--anchors", help="Blocks (random anchor positions) per window and step.")] = 16,
    learning_rate: Annotated[float, typer.Option("--learning-rate", "--lr", help="Peak AdamW learning rate (warmup, then cosine decay).")] = 3e-4,
    labels: Annotated[str, typer.Option("--labels", help="'target': learn the target's greedy choices (what verification accepts); 'corpus': learn the text itself.")] = "target",
    mask_token_id: Annotated[Optional[int], typer.Option("--mask-token-id", help="Mask id (default: the last embedding row, if the tokenizer never produces it).")] = None,
    seed: Annotated[int, typer.Option("--seed", help="Random seed (windows, anchors, init).")] = 0,
    save_every: Annotated[int, typer.Option("--save-every", help="Write the draft and the resume state every N steps.")] = 200,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the run saved in --out.")] = False,
    block_only_layers: Annotated[int, typer.Option("--block-only-layers", help="The last N draft layers see only the block (layer type block_attention, ours only: z-lab's loaders refuse such a draft), gathering from the anchor slot what earlier layers read from the context.")] = 0,
    causal: Annotated[bool, typer.Option("--causal", help="Causal attention inside the block (slot k sees slots 0..k); written as is_causal, where z-lab's loaders read it.")] = False,
    init: Annotated[str, typer.Option("--init", help="'random', or 'content-match': the first layer starts as a lookup of the position before the anchor (tied-embedding targets; taps must include the last layer).")] = "random",
    answers_only: Annotated[bool, typer.Option("--answers-only", help="Anchor blocks only in assistant answers of chat text, one chat per window from its start.")] = False,
    decay_gamma: Annotated[float, typer.Option("--decay-gamma", help="Slot k of a block weighs exp(-(k-1)/gamma) in the loss.")] = 4.0,
    arch: Annotated[str, typer.Option("--arch", help="'dflash', or 'dflash2': per-sublayer dynamic convolutions and a candidate selector (started as the DFlash draft they wrap; the selector learns a top-K cross-entropy, our objective: z-lab's recipe is unpublished).")] = "dflash",
    conv_kernel_size: Annotated[int, typer.Option("--conv-kernel-size", help="DFlash2: slots each convolution reaches back along the block.")] = 2,
    conv_group_size: Annotated[int, typer.Option("--conv-group-size", help="DFlash2: channels sharing one dynamic kernel (must divide the hidden size).")] = 16,
    selector_rank: Annotated[int, typer.Option("--selector-rank", help="DFlash2: rank of the selector's codebooks (each holds a row per vocabulary token).")] = 256,
    selector_top_k: Annotated[int, typer.Option("--selector-top-k", help="DFlash2: candidates per slot the selector chooses among.")] = 16,
    from_draft: Annotated[Optional[str], typer.Option("--from-draft", help="Start from this trained draft for the target (folder, Hugging Face repo id, or 'demo') instead of a new one; its layers, taps, block size and mask (and a DFlash2 draft's convolutions and selector) are kept. With --arch dflash2 a DFlash draft becomes the DFlash2 draft that wraps it, of the --conv-*/--selector-* shape.")] = None,
) -> None:
    """Train a DFlash (or DFlash2) draft for a target (block-diffusion objective, target frozen)."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    from .train import DFlash2Shape, TrainConfig, check_run, parse_taps, train_draft

    try:  # train's own checks, before the target loads
        dflash2 = DFlash2Shape.for_arch(arch, conv_kernel_size, conv_group_size, selector_rank, selector_top_k)
        tap_ids = parse_taps(taps)
        check_run(data, out, resume, from_draft is not None)
    except ValueError as e:
        _fail(str(e))
    start = None
    if from_draft is not None:
        shaped = [f"--{name.replace('_', '-')}" for name in ("layers", "taps", "block_size", "mask_token_id",
                                                             "block_only_layers", "causal", "init")
                  if context.get_parameter_source(name).name != "DEFAULT"]
        if shaped:
            _fail(f"{shaped[0]}: the draft given with --from-draft decides its own shape")
        from .defaults import DEMO, demo
        from .loading import CheckpointError, resolve_path

        try:
            start = Path(demo()[1]) if from_draft == DEMO else resolve_path(from_draft)
        except CheckpointError as e:
            _fail(f"--from-draft {from_draft}: {e}")
    loaded, tokenizer = _load(model, None, "none")
    config = TrainConfig(
        seq_len=seq_len, anchors=anchors, block_size=block_size, steps=steps, learning_rate=learning_rate,
        seed=seed, save_every=save_every, labels=labels, answers_only=answers_only, decay_gamma=decay_gamma,
    )
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    try:
        with Progress(*columns) as progress:
            task = progress.add_task("training", total=steps)

            def on_step(step: int, loss: float) -> None:
                progress.update(task, completed=step, description=f"loss {loss:.3f}")

            losses = train_draft(
                loaded.target, tokenizer, data, out, config, num_layers=layers, mask_token_id=mask_token_id,
                resume=resume, on_step=on_step, taps=tap_ids, block_only_layers=block_only_layers, causal=causal,
                init=init, dflash2=dflash2, start=start,
            )
    except (ValueError, RuntimeError) as e:
        _fail(str(e))
    if losses:
        head, tail = losses[: max(1, len(losses) // 10)], losses[-max(1, len(losses) // 10) :]
        typer.echo(f"loss {sum(head) / len(head):.3f} -> {sum(tail) / len(tail):.3f}; draft written to {out}")


@app.command()
def convert(
    out: str = typer.Option(..., "--out", "-o", help="Output folder for the MLX draft (must not exist unless --force)."),
    draft: str = typer.Option("z-lab/Qwen3.5-9B-DFlash", "--draft", "-d", help="z-lab draft: Hugging Face repo id or local folder."),
    target: str = typer.Option("Jackrong/Qwopus3.5-9B-Coder", "--target", "-t", help="Target whose tokenizer the draft will serve (repo id or folder); only its config and tokenizer are fetched."),
    quant: str = typer.Option("none", "--quant", "-q", help="Quantize the draft: w4, w8, w4:gs32 … or none."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Draft revision (branch, tag or commit)."),
    target_revision: Optional[str] = typer.Option(None, "--target-revision", help="Target revision (branch, tag or commit)."),
    base_tokenizer: str = typer.Option("Qwen/Qwen3.5-9B", "--base-tokenizer", help="Tokenizer the draft was trained with, to name the target's extra tokens; 'none' skips that check."),
    force: bool = typer.Option(False, "--force", help="Replace the output folder if it exists."),
) -> None:
    """Fetch a z-lab draft, check it against a target's tokenizer, write a ready MLX draft.

    Honours HF_HOME, HF_TOKEN, HF_ENDPOINT and HF_HUB_OFFLINE; a dropped connection resumes
    from the bytes already received (a new run starts an unfinished file over).
    """
    from .convert import convert_draft
    from .loading import CheckpointError

    try:
        path, report = convert_draft(
            out, draft=draft, target=target, quant=quant, revision=revision, target_revision=target_revision,
            base_tokenizer=None if base_tokenizer.lower() == "none" else base_tokenizer, force=force,
        )
    except (CheckpointError, ValueError) as e:
        _fail(str(e))
    for check in report.checks:
        colour = {"ok": typer.colors.GREEN, "warning": typer.colors.YELLOW}.get(check["status"], typer.colors.RED)
        typer.secho(f"{check['status']:>7}  {check['check']}: {check['detail']}", fg=colour, err=True)
    if report.warnings:
        typer.secho(f"WARNING: {len(report.warnings)} suspicious fit(s), recorded in {path}/config.json", fg=typer.colors.YELLOW, bold=True, err=True)
    typer.echo(str(path))


@app.command("convert-target")
def convert_target(
    model: str = typer.Option(..., "--model", "-m", help="Hugging Face Qwen3.5 checkpoint: repo id or local folder."),
    out: str = typer.Option(..., "--out", "-o", help="Output folder for the MLX checkpoint (must not exist unless --force)."),
    quant: str = typer.Option("none", "--quant", "-q", help="Quantize: w4, w8, w4:gs32 … or none."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Revision (branch, tag or commit)."),
    force: bool = typer.Option(False, "--force", help="Replace the output folder if it exists."),
) -> None:
    """Convert a Hugging Face Qwen3.5 target (dense or mixture of experts) to a text-only MLX
    checkpoint (vision tower and MTP dropped), streamed tensor by tensor (large ones 64 MB of rows
    at a time): memory stays near one 512 MB shard; the progress line shows the peak."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .loading import CheckpointError
    from .target_conversion import convert_target as run

    peak = [0]
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("peak {task.fields[peak]}"), console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task("converting tensors", total=None, peak="-")

        def progress(done: int, total: int, peak_bytes: int) -> None:
            peak[0] = peak_bytes
            bar.update(task, completed=done, total=total, peak=f"{peak_bytes / 1024**3:.2f} GB resident")

        try:
            path = run(model, out, quant=quant, revision=revision, force=force, progress=progress)
        except (CheckpointError, ValueError) as e:
            bar.stop()
            _fail(str(e))
    typer.secho(f"peak resident memory {peak[0] / 1024**3:.2f} GB", err=True)
    typer.echo(str(path))


if __name__ == "__main__":
    app()
