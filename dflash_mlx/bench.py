"""Target-only vs DFlash, side by side, on workloads that mirror real use.

Two baselines: our target-only loop (the same model code DFlash verifies with) and mlx-lm's
own ``stream_generate`` on mlx-lm's build of the target (what a Mac user runs without us).
Runs alternate (baselines, each block setting, next prompt, ...), in an order rotated per
prompt, so that thermal or background drift hits every setting alike. Greedy runs should give
identical outputs: where one does not, the bench reports the first divergence with the target's
top-2 logit gap at that position, and counts it a failure only when that gap is not a near-tie
(``first_divergence``; ``docs/kernels.md`` lists where a verify pass and a decode step can round
differently on a Mac).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from mlx_lm.generate import batch_generate as mlx_lm_batch_generate

from .api import DFlashModel, encode_prompt, stream_generate
from .scheduler import batch_generate

_EDIT_SOURCE = '''import json
from pathlib import Path


def load_records(path):
    """Read one JSON record per line, skipping blank lines."""
    records = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            records.append(json.loads(line))
    return records


def summarize(records):
    totals = {}
    for record in records:
        key = record["category"]
        totals[key] = totals.get(key, 0) + record["amount"]
    return dict(sorted(totals.items()))


def main(path):
    records = load_records(path)
    for category, amount in summarize(records).items():
        print(f"{category:20} {amount:10.2f}")
'''

SUITES: Dict[str, List[str]] = {
    "edit": [
        "Rename the function `summarize` to `total_by_category` everywhere in this file. "
        "Reply with the whole updated file and nothing else.\n\n```python\n" + _EDIT_SOURCE + "```",
        "Add type hints to every function of this file without changing anything else. "
        "Reply with the whole updated file.\n\n```python\n" + _EDIT_SOURCE + "```",
    ],
    "code": [
        "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring and tests.",
        "Write a Python class implementing an LRU cache with get and put in O(1), with type hints.",
    ],
    "prose": [
        "Explain in three paragraphs how speculative decoding makes language models faster.",
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    ],
}


@dataclass
class Run:
    suite: str
    prompt_index: int
    mode: str  # "baseline" (our target-only loop), "mlx_lm" (mlx-lm's stream_generate) or "dflash"
    block_tokens: Optional[str]  # "4", "auto", "auto:8"; None for the baseline
    tokens: int
    tps: float
    prompt_tps: float
    tokens_per_cycle: float
    acceptance_rate: float
    peak_memory_gb: float
    context_tokens: int = 0  # real file context put before the prompt
    prompt_tokens: int = 0
    accepted_lengths: List[int] = field(default_factory=list)
    block_histogram: Dict[int, int] = field(default_factory=dict)  # cycles per block size
    output: List[int] = field(default_factory=list)
    divergence: Optional[Dict] = None  # greedy: the first token that left the target alone's (``Divergence``)
    cycle_seconds: float = 0.0  # auto: the wall time of its cycles (``BlockStats.seconds`` over the run)
    probe_seconds: float = 0.0  # ... of which the cycles that explored (probes, shadows, optimistic choices)
    cpu_ms_per_token: float = 0.0  # this process's CPU time per token after the first (what a neighbour's load does not stretch)


def measure(
    model: DFlashModel, tokenizer, prompt, use_draft: bool, block_tokens, max_tokens, chat: bool, sampling=None
) -> Run:
    request = [{"role": "user", "content": prompt}] if chat else prompt
    tokens, lengths, accepted, cycles, last = [], [], 0, 0, None
    kwargs = dict(sampling or {})
    if use_draft:
        kwargs["block_tokens"] = block_tokens
    stats = model.block_stats
    seconds, probing, cpu = stats.seconds, stats.probe_seconds, None
    for last in stream_generate(model, tokenizer, request, max_tokens=max_tokens, use_draft=use_draft, **kwargs):
        cpu = time.process_time() if cpu is None else cpu  # from the first token: the prefill is not counted
        tokens.append(last.token)
        if last.cycles != cycles:
            lengths.append(last.accepted_tokens - accepted)
            accepted, cycles = last.accepted_tokens, last.cycles
    return Run(
        suite="", prompt_index=0, mode="dflash" if use_draft else "baseline",
        block_tokens=str(block_tokens) if use_draft else None,
        tokens=last.generation_tokens, tps=last.generation_tps, prompt_tps=last.prompt_tps,
        tokens_per_cycle=last.tokens_per_cycle, acceptance_rate=last.acceptance_rate,
        peak_memory_gb=last.peak_memory, prompt_tokens=last.prompt_tokens,
        accepted_lengths=lengths if use_draft else [],
        block_histogram=dict(last.block_histogram) if use_draft else {}, output=tokens,
        cycle_seconds=stats.seconds - seconds, probe_seconds=stats.probe_seconds - probing,
        cpu_ms_per_token=_cpu_ms(cpu, len(tokens)),
    )


def _cpu_ms(since: Optional[float], tokens: int) -> float:
    """Milliseconds of this process's CPU time per token since ``since`` (the first token's)."""
    return 1e3 * (time.process_time() - since) / (tokens - 1) if since is not None and tokens > 1 else 0.0


def load_mlx_lm(target_path: Path):
    """The target as mlx-lm builds it: a Qwen3.5 target with mlx-lm's ``qwen3_5`` / ``qwen3_5_moe``
    classes whatever the config calls the model (text-only checkpoints say ``*_text``, some Qwen3.8
    re-exports ``qwen3_8``: names mlx-lm's loader does not map itself); the other families
    (``qwen3``, ``qwen3_moe``, ``llama``) with the classes mlx-lm's loader picks itself."""
    from mlx_lm.models import qwen3_5, qwen3_5_moe
    from mlx_lm.utils import load_model

    from .loading import read_config, target_family, target_kind

    config = read_config(target_path)
    if target_family(config) not in ("qwen3_5", "qwen3_5_moe"):
        return load_model(Path(target_path))[0]
    module = qwen3_5_moe if target_kind(config) == "moe" else qwen3_5
    model, _ = load_model(Path(target_path), get_model_classes=lambda config: (module.Model, module.ModelArgs))
    return model


def mlx_lm_sampler_arguments(sampling: Dict) -> Dict:
    """Our sampling arguments (``stream_generate``'s ``temp``, ``top_p``, ``top_k``, ``min_p``) as
    mlx-lm's ``make_sampler`` keywords: the same distribution (``Sampler`` follows ``make_sampler``,
    "off" values included: top_p 0 or 1, top_k 0, min_p 0)."""
    from .sampling import Sampler

    ours = Sampler(sampling.get("temp", 0.0), top_p=sampling.get("top_p", 1.0), top_k=sampling.get("top_k", 0),
                   min_p=sampling.get("min_p", 0.0))
    return dict(temp=ours.temperature, top_p=ours.top_p, min_p=ours.min_p, min_tokens_to_keep=ours.min_tokens_to_keep,
                top_k=ours.top_k)


def measure_mlx_lm(model, tokenizer, prompt, max_tokens: int, chat: bool, sampling=None) -> Run:
    """One run of ``mlx_lm.stream_generate`` on the same prompt tokens and sampling."""
    import mlx.core as mx
    from mlx_lm.generate import stream_generate as mlx_lm_stream_generate
    from mlx_lm.sample_utils import make_sampler

    sampling = dict(sampling or {})
    if sampling.get("seed") is not None:
        mx.random.seed(sampling["seed"])  # mlx-lm draws from the global generator: that is its API
    sampler = make_sampler(**mlx_lm_sampler_arguments(sampling))
    ids = encode_prompt(tokenizer, [{"role": "user", "content": prompt}] if chat else prompt).tolist()
    tokens, last = [], None
    for last in mlx_lm_stream_generate(model, tokenizer, ids, max_tokens=max_tokens, sampler=sampler):
        tokens.append(last.token)
    return Run(
        suite="", prompt_index=0, mode="mlx_lm", block_tokens=None, tokens=last.generation_tokens,
        tps=last.generation_tps, prompt_tps=last.prompt_tps, tokens_per_cycle=1.0, acceptance_rate=0.0,
        peak_memory_gb=last.peak_memory, prompt_tokens=last.prompt_tokens, output=tokens,
    )


def run_all(model: DFlashModel, tokenizer, jobs, blocks: List[str], max_tokens: int, chat: bool, sampling=None,
            mlx_lm_model=None, progress=None) -> List[Run]:
    """Every job (suite, context, prompt index, prompt) under every setting: the baselines and each
    block setting, rotated per job. ``progress(done, description)`` is told each run as it starts."""
    settings = [("baseline", None)] + ([("mlx_lm", None)] if mlx_lm_model is not None else []) + [("dflash", b) for b in blocks]
    runs = []
    for k, (name, context, index, prompt) in enumerate(jobs):
        # Rotated per job: a machine that slows down over a run (heat, a burst budget, a
        # neighbour) must not always hit the same setting, as it would the last one.
        for mode, block in settings[k % len(settings):] + settings[: k % len(settings)]:
            if progress is not None:
                label = {"baseline": "target alone", "mlx_lm": "mlx-lm"}.get(mode, f"block {block}")
                progress(len(runs), f"{name}{f' +{context}' if context else ''} #{index + 1}: {label}")
            if mode == "mlx_lm":
                run = measure_mlx_lm(mlx_lm_model, tokenizer, prompt, max_tokens, chat, sampling)
            else:
                run = measure(model, tokenizer, prompt, mode == "dflash", block, max_tokens, chat, sampling)
            run.suite, run.prompt_index, run.context_tokens = name, index, context
            runs.append(run)
    return runs


def warm_up(model: DFlashModel, tokenizer, blocks: List[str], chat: bool, sampling=None, mlx_lm_model=None) -> None:
    """Compile every block size (and mlx-lm's graphs) outside the timings, and let auto measure
    cycle costs first, as a chat session would have."""
    for size in range(1, model.draft_block_size + 1):
        measure(model, tokenizer, "warm up", True, size, 8, chat, sampling)
    if any(b.startswith("auto") for b in blocks):
        measure(model, tokenizer, "warm up", True, "auto", 64, chat, sampling)
    if mlx_lm_model is not None:
        measure_mlx_lm(mlx_lm_model, tokenizer, "warm up", 8, chat, sampling)


def table(rows: List[Dict], show_context: bool, mlx_lm: bool, sampled: bool, pass_ms: bool = False):
    """The summary as a rich table (what ``dflash-mlx bench`` prints): with the milliseconds of a
    plain step of the target alone and of a DFlash cycle (``pass_ms``, a pipelined target: named
    per pass, one trip through every rank) and, with ``show_context``, each side's time to first
    token (target/DFlash)."""
    from rich.table import Table

    from .block_policy import describe

    out = Table(title="dflash-mlx bench (sampled)" if sampled else "dflash-mlx bench (greedy)")
    columns = ["suite", *(["context"] if show_context else []), "block", "target tok/s", *(["mlx-lm tok/s"] if mlx_lm else []),
               "DFlash tok/s", "speedup", "CPU speedup", *(["vs mlx-lm"] if mlx_lm else []), "tokens/cycle", "acceptance",
               "blocks used", "probe time", "ms/pass: target/DFlash" if pass_ms else "ms/step/cycle",
               *(["TTFT s"] if show_context else []), "peak GB", "identical"]
    for column in columns:
        out.add_column(column, justify="right")
    for r in rows:
        shares = {int(b): share for b, share in r["block_shares"].items()}
        out.add_row(
            r["suite"], *([str(r["context_tokens"])] if show_context else []), r["block_tokens"],
            f"{r['baseline_tps']:.1f}", *([f"{r['mlx_lm_tps']:.1f}"] if mlx_lm else []),
            f"{r['dflash_tps']:.1f}", f"{r['speedup']:.2f}x",
            "-" if r.get("cpu_speedup") is None else f"{r['cpu_speedup']:.2f}x",
            *([f"{r['speedup_vs_mlx_lm']:.2f}x"] if mlx_lm else []),
            f"{r['tokens_per_cycle']:.2f}", f"{r['acceptance_rate']:.0%}", describe(shares).removeprefix("blocks "),
            "-" if r.get("probe_share") is None else f"{r['probe_share']:.1%}",
            f"{_ms(r.get('step_ms'))}/{_ms(r.get('cycle_ms'))}",
            *([f"{_seconds(r.get('baseline_ttft_s'))}/{_seconds(r.get('dflash_ttft_s'))}"] if show_context else []),
            f"{r['peak_memory_gb']:.2f}", "n/a" if sampled else _identical(r),
        )
    return out


def _seconds(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.1f}"


_ms = _seconds  # milliseconds, shown alike


def _identical(row: Dict) -> str:
    """DFlash's outputs against the target's alone; mlx-lm's are named only where they differ."""
    mlx_lm = " (mlx-lm: NO)" if row.get("mlx_lm_identical") is False else ""
    if row["identical"]:
        return "yes" + mlx_lm
    divergences = row.get("divergences") or []
    return ("near-tie" if divergences and all(d["near_tie"] for d in divergences) else "NO") + mlx_lm


def default_blocks(draft_block_size: int) -> List[str]:
    """The fixed sizes worth a row (2, 3, 4, 8, 16 and the draft's own, up to it) and ``auto``."""
    fixed = sorted({b for b in (2, 3, 4, 8, 16, draft_block_size) if 2 <= b <= draft_block_size})
    return [str(b) for b in fixed] + ["auto"]


def parse_context_sizes(text: str) -> List[int]:
    """``"1k,4k,8k"`` -> ``[1024, 4096, 8192]`` (``k`` is 1024 tokens); empty -> ``[0]``."""
    sizes = []
    for item in (t.strip().lower() for t in text.split(",")):
        if not item:
            continue
        try:
            size = int(item.removesuffix("k")) * (1024 if item.endswith("k") else 1)
        except ValueError:
            raise ValueError(f"context size {item!r}: expected a token count such as 512, 1k or 4k") from None
        if size < 0:
            raise ValueError(f"context size {item!r} is negative")
        sizes.append(size)
    return sizes or [0]


CONTEXT_MODULES = ("argparse", "dataclasses", "inspect", "functools", "typing", "pathlib", "textwrap", "enum")


def file_context(tokenizer, tokens: int) -> str:
    """About ``tokens`` tokens of real Python source (this interpreter's standard library, the same
    files in the same order every run), cut on a token boundary."""
    import importlib

    if tokens == 0:
        return ""
    ids: List[int] = []
    for name in CONTEXT_MODULES:
        path = Path(importlib.import_module(name).__file__)
        ids += tokenizer.encode(f"# {path.name}\n{path.read_text()}\n", add_special_tokens=False)
        if len(ids) >= tokens:
            return tokenizer.decode(ids[:tokens])
    raise ValueError(f"the standard library files used as context hold only {len(ids)} tokens, fewer than {tokens}")


def with_context(prompt: str, context: str) -> str:
    """The prompt after a block of repository files, as an editor's assistant sends it."""
    if not context:
        return prompt
    return f"Files from the repository, for context:\n\n```python\n{context}\n```\n\n{prompt}"


NO_BLAS_LOADED = "none loaded"


def compute_backend() -> Dict[str, str]:
    """What produced the numbers: MLX's device and, on Linux, the BLAS libraries the process loaded
    (MLX's Linux CPU wheel bundles the reference BLAS; a preloaded OpenBLAS changes the speedups)."""
    import platform

    import mlx.core as mx

    info = {"device": str(mx.default_device()), "mlx": mx.__version__, "platform": platform.platform()}
    maps = Path("/proc/self/maps")
    if maps.exists():
        loaded = {Path(line.split()[-1]).name for line in maps.read_text().splitlines() if "blas" in line.lower() and "/" in line}
        info["blas"] = ", ".join(sorted(loaded)) or NO_BLAS_LOADED
    return info


def reference_blas_only(backend: Dict[str, str]) -> bool:
    """On a Linux CPU with only the bundled reference BLAS: verify blocks pay their rows in full.

    numpy's own OpenBLAS (``libscipy_openblas*``) does not count: its symbols are prefixed, so
    MLX cannot use it."""
    libs = [name.strip().lower() for name in backend.get("blas", "").split(",") if name.strip() not in ("", NO_BLAS_LOADED)]
    optimised = any(name.startswith(("libopenblas", "libmkl", "libblis")) for name in libs)
    return "cpu" in backend["device"].lower() and bool(libs) and not optimised


def load_prompt_file(path: Path) -> List[str]:
    """A ``.jsonl`` file holds one ``{"prompt": ...}`` per line; any other file is one prompt."""
    text = path.read_text()
    if path.suffix == ".jsonl":
        return [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()]
    return [text]


# A greedy divergence is a near-tie when the two tokens are the target's top two at that position
# and their logits lie within this many units in the last place of the logits' dtype (at the top
# logit's magnitude): a verify pass and a decode step summing in different orders can swap them.
NEAR_TIE_ULPS = 8
_MANTISSA_BITS = {"float32": 23, "float16": 10, "bfloat16": 7}


def ulp(value: float, dtype: str) -> float:
    """The spacing of ``dtype``'s numbers at ``value``."""
    bits = _MANTISSA_BITS.get(dtype, 23)
    return 2.0 ** (math.floor(math.log2(abs(value))) - bits) if value else 2.0 ** (-126 - bits)


@dataclass
class Divergence:
    position: int  # index in the generated tokens
    expected: Optional[int]  # the target alone's token there (None: it had stopped)
    got: Optional[int]  # DFlash's (None: it had stopped)
    top2: Optional[Tuple[int, int]] = None  # the target's two best tokens there (None: not computed)
    gap: Optional[float] = None  # their logit difference
    near_tie: bool = False
    ulps: Optional[float] = None  # the gap in units in the last place of the logits' dtype

    def describe(self) -> str:
        where = f"token {self.position}: {self.got} instead of {self.expected}"
        if self.gap is None:
            return where + " (the target's logits there were not computed)"
        kind = "a near-tie" if self.near_tie else "not a near-tie"
        return where + f" (target top-2 {self.top2}, gap {self.gap:.3g} = {self.ulps:.1f} ulp: {kind})"


def first_divergence(prompt: Sequence[int], expected: Sequence[int], got: Sequence[int],
                     logits_at: Optional[Callable[[List[int]], "object"]]) -> Optional[Divergence]:
    """Where ``got`` first leaves ``expected`` (greedy outputs after ``prompt``), with the target's
    top-2 logits at that position from ``logits_at(tokens)`` (the target's next-token logits after
    ``tokens``, [V]); None if they agree."""
    import mlx.core as mx
    import numpy as np

    n = min(len(expected), len(got))
    j = next((i for i in range(n) if expected[i] != got[i]), n)
    if j == n and len(expected) == len(got):
        return None
    out = Divergence(j, expected[j] if j < len(expected) else None, got[j] if j < len(got) else None)
    if logits_at is None:
        return out
    logits = logits_at(list(prompt) + list(expected[:j]))
    dtype = str(logits.dtype).split(".")[-1]
    values = np.array(logits.astype(mx.float32)).reshape(-1)
    second, first = (int(i) for i in np.argsort(values)[-2:])
    out.top2, out.gap = (first, second), float(values[first] - values[second])
    out.ulps = out.gap / ulp(float(values[first]), dtype)
    out.near_tie = {out.expected, out.got} == {first, second} and out.ulps <= NEAR_TIE_ULPS
    return out


def find_divergences(runs: List[Run], prompts: Dict[tuple, Sequence[int]],
                     logits_at: Optional[Callable[[List[int]], "object"]]) -> List[Divergence]:
    """Each greedy DFlash run's first divergence from the target alone on the same prompt
    (``prompts``: (suite, context tokens, prompt index) -> its tokens), kept on the run."""
    found = []
    for run in runs:
        if run.mode != "dflash":
            continue
        key = (run.suite, run.context_tokens, run.prompt_index)
        base = [r for r in runs if r.mode == "baseline" and (r.suite, r.context_tokens, r.prompt_index) == key]
        if not base:
            continue
        divergence = first_divergence(prompts[key], base[-1].output, run.output, logits_at)
        run.divergence = None if divergence is None else asdict(divergence)
        if divergence is not None:
            found.append(divergence)
    return found


def divergence_report(rows: List[Dict]) -> Tuple[List[str], bool]:
    """Lines naming each divergence (suite, block, prompt), and whether any is not a near-tie."""
    lines, real = [], False
    for r in rows:
        for d in r["divergences"]:
            fields = {k: v for k, v in d.items() if k != "prompt_index"}
            divergence = Divergence(**{**fields, "top2": tuple(d["top2"]) if d["top2"] else None})
            real = real or not divergence.near_tie
            lines.append(f"{r['suite']} block {r['block_tokens']} prompt {d['prompt_index'] + 1}: {divergence.describe()}")
    return lines, real


def target_logits(model: DFlashModel) -> Optional[Callable[[List[int]], "object"]]:
    """The target's next-token logits after a token list (one forward pass), for the divergence
    report; None when this process holds only part of the target (a pipeline's rank)."""
    if not model.runner.holds_whole_target or model.target is None:
        return None
    import mlx.core as mx

    return lambda tokens: model.target(mx.array(tokens)[None])[0, -1]


def prompt_tokens(tokenizer, jobs, chat: bool) -> Dict[tuple, List[int]]:
    """(suite, context tokens, prompt index) -> the prompt's tokens as ``measure`` sends them."""
    out = {}
    for name, context, index, prompt in jobs:
        request = [{"role": "user", "content": prompt}] if chat else prompt
        out[(name, context, index)] = encode_prompt(tokenizer, request).tolist()
    return out


def _block_order(block: str):
    return (1, block) if block.startswith("auto") else (0, int(block))


def _rate(runs: List[Run]) -> float:
    """Tokens per second over a row's prompts: each prompt's median over its repeats (tokens and
    seconds), then all its prompts' tokens over all their seconds, as a user running them one after
    another would see. A median pooled over the runs of prompts of different speeds (`edit` at 4k:
    answers of 22 and 63 tokens) lands between two clusters, on their edges: the slowest run of the
    fast prompt and the fastest of the slow one, whatever the other runs did."""
    tokens = seconds = 0.0
    for index in sorted({r.prompt_index for r in runs}):
        mine = [r for r in runs if r.prompt_index == index]
        rate = statistics.median(r.tps for r in mine)
        if not rate:
            return 0.0
        count = statistics.median(r.tokens for r in mine)
        tokens, seconds = tokens + count, seconds + count / rate
    return tokens / seconds if seconds else 0.0


def _cpu_ms_per_token(runs: List[Run]) -> float:
    """CPU milliseconds per token over a row's prompts, weighted as ``_rate`` weighs them."""
    tokens = cpu = 0.0
    for index in sorted({r.prompt_index for r in runs}):
        mine = [r for r in runs if r.prompt_index == index]
        count = statistics.median(r.tokens for r in mine)
        tokens, cpu = tokens + count, cpu + count * statistics.median(r.cpu_ms_per_token for r in mine)
    return cpu / tokens if tokens else 0.0


def summarize(runs: List[Run]) -> List[Dict]:
    """One row per suite, context length and block setting: each side's rate from the medians of
    every prompt's repeats (``_rate``; the baseline is not reduced to one repeat per prompt),
    identical-output check, and the share of cycles at each block size."""
    rows = []
    keys = {(r.suite, r.context_tokens, r.block_tokens) for r in runs if r.mode == "dflash"}
    for suite, context, block in sorted(keys, key=lambda k: (k[0], k[1], _block_order(k[2]))):
        spec = [r for r in runs if (r.suite, r.context_tokens, r.block_tokens, r.mode) == (suite, context, block, "dflash")]
        base = [r for r in runs if (r.suite, r.context_tokens, r.mode) == (suite, context, "baseline")]
        mlx_lm = [r for r in runs if (r.suite, r.context_tokens, r.mode) == (suite, context, "mlx_lm")]
        reference = {r.prompt_index: r.output for r in base}
        base_tps, spec_tps = _rate(base), _rate(spec)
        mlx_lm_tps = _rate(mlx_lm) if mlx_lm else None
        histogram: Dict[int, int] = {}
        for s in spec:
            for b, n in s.block_histogram.items():
                histogram[b] = histogram.get(b, 0) + n
        total = sum(histogram.values()) or 1
        rows.append({
            "suite": suite,
            "context_tokens": context,
            "block_tokens": block,
            "baseline_tps": base_tps,
            "dflash_tps": spec_tps,
            "speedup": spec_tps / base_tps if base_tps else 0.0,
            "mlx_lm_tps": mlx_lm_tps,
            "speedup_vs_mlx_lm": spec_tps / mlx_lm_tps if mlx_lm_tps else None,
            "mlx_lm_identical": all(m.output == reference[m.prompt_index] for m in mlx_lm) if mlx_lm else None,
            "tokens_per_cycle": statistics.mean(s.tokens_per_cycle for s in spec),
            "acceptance_rate": statistics.mean(s.acceptance_rate for s in spec),
            "peak_memory_gb": max(r.peak_memory_gb for r in spec + base + mlx_lm),
            # what a plain step and a cycle take (per token alone; per cycle: its committed tokens over
            # DFlash's rate), and the time to the first token of each side (medians over the runs)
            "step_ms": 1e3 / base_tps if base_tps else None,
            "cycle_ms": 1e3 * statistics.mean(s.tokens_per_cycle for s in spec) / spec_tps if spec_tps else None,
            # the same ratio in CPU time per token: on a shared machine wall time stretches with the
            # neighbours' load, CPU time much less (MLX's CPU backend computes on this process's threads)
            "cpu_speedup": (_cpu_ms_per_token(base) / cpu_spec if (cpu_spec := _cpu_ms_per_token(spec)) else None),
            "baseline_ttft_s": _ttft(base),
            "dflash_ttft_s": _ttft(spec),
            "identical": all(s.output == reference[s.prompt_index] for s in spec),
            "divergences": [{**s.divergence, "prompt_index": s.prompt_index} for s in spec if s.divergence],
            "block_shares": {str(b): n / total for b, n in sorted(histogram.items())},
            # auto: the share of its cycles' time that went to exploring (bounded by the controller's budget)
            "probe_share": (sum(s.probe_seconds for s in spec) / cycle_time
                            if (cycle_time := sum(s.cycle_seconds for s in spec)) else None),
            "accepted_lengths": [n for s in spec for n in s.accepted_lengths],
        })
    return rows


def _ttft(runs: List[Run]) -> Optional[float]:
    """Median seconds to the first token (the prompt's prefill) over ``runs``."""
    times = [r.prompt_tokens / r.prompt_tps for r in runs if r.prompt_tps]
    return statistics.median(times) if times else None


def save_json(path: Path, rows: List[Dict], runs: List[Run], meta: Dict) -> None:
    path.write_text(json.dumps({"meta": meta, "summary": rows, "runs": [asdict(r) for r in runs]}, indent=2))


def plot(path: Path, rows: List[Dict]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("--plot needs matplotlib: pip install 'dflash-mlx[plot]'") from e
    labels = [
        r["suite"] + (f" +{r['context_tokens']}" if r["context_tokens"] else "") + f"\nblock {r['block_tokens']}"
        for r in rows
    ]
    fig, (speed, hist) = plt.subplots(1, 2, figsize=(12, 4.5))
    x = range(len(rows))
    speed.bar([i - 0.2 for i in x], [r["baseline_tps"] for r in rows], width=0.4, label="target alone")
    speed.bar([i + 0.2 for i in x], [r["dflash_tps"] for r in rows], width=0.4, label="DFlash")
    for i, r in zip(x, rows):
        speed.text(i + 0.2, r["dflash_tps"], f"{r['speedup']:.2f}x", ha="center", va="bottom", fontsize=8)
    speed.set_xticks(list(x), labels, fontsize=8)
    speed.set_ylabel("tokens/s")
    speed.set_title("Decode speed")
    speed.legend()
    top = max((max(r["accepted_lengths"], default=0) for r in rows), default=0)
    for r, label in zip(rows, labels):
        if r["accepted_lengths"]:
            hist.hist(r["accepted_lengths"], bins=range(top + 2), alpha=0.5, label=label.replace("\n", ", "), align="left")
    hist.set_xticks(range(top + 1))
    hist.set_xlabel("drafted tokens accepted per cycle")
    hist.set_ylabel("cycles")
    hist.set_title("Accepted lengths")
    hist.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def concurrency_rows(model: DFlashModel, tokenizer, prompts: List[str], levels: List[int], max_tokens: int, chat: bool,
                     block_tokens: str, mlx_lm_model=None, repeats: int = 1, progress=None) -> List[Dict]:
    """Requests sent at once, ``c`` of each level (the prompts in turn): DFlash batched, our target
    alone batched and (``mlx_lm_model``) mlx-lm's ``batch_generate``, run in turn, greedy. Per row:
    the aggregate tokens per second (every request's tokens over the batch's wall time, prefill
    included, the same clock for all three), the median request's own rate, and whether each
    request's tokens equal its answer alone (ours: the request alone through the same engine)."""
    ids = [encode_prompt(tokenizer, [{"role": "user", "content": p}] if chat else p).tolist() for p in prompts]
    alone = {i: batch_generate(model, tokenizer, [ids[i]], max_tokens, block_tokens=block_tokens).token_ids[0]
             for i in range(min(len(ids), max(levels)))}
    rows, done = [], 0
    for level in levels:
        batch = [ids[i % len(ids)] for i in range(level)]
        expected = [alone[i % len(ids)] for i in range(level)]
        for _ in range(repeats):
            for mode in ("dflash", "target", *(["mlx_lm"] if mlx_lm_model is not None else [])):
                tic = time.perf_counter()
                if mode == "mlx_lm":
                    out = mlx_lm_batch_generate(mlx_lm_model, tokenizer, batch, max_tokens=max_tokens, return_token_ids=True)
                    tokens, rates = out.token_ids, []
                else:
                    out = batch_generate(model, tokenizer, batch, max_tokens, block_tokens=block_tokens, use_draft=mode == "dflash")
                    tokens, rates = out.token_ids, [r.generation_tps for r in out.responses if r is not None]
                seconds = time.perf_counter() - tic
                same = [_same_answer(t, e, tokenizer) for t, e in zip(tokens, expected)]
                rows.append(dict(concurrency=level, mode=mode, seconds=seconds, tokens=sum(len(t) for t in tokens),
                                 aggregate_tps=sum(len(t) for t in tokens) / seconds,
                                 request_tps=statistics.median(rates) if rates else None, identical=all(same)))
                done += 1
                if progress is not None:
                    progress(done, f"{mode} x{level}")
    return rows


def _same_answer(got: Sequence[int], expected: Sequence[int], tokenizer) -> bool:
    """Equal answers, but for a final end-of-sequence token (mlx-lm's batch_generate leaves it out)."""
    eos = set(tokenizer.eos_token_ids)
    strip = lambda t: list(t[:-1]) if t and t[-1] in eos else list(t)  # noqa: E731
    return strip(got) == strip(expected)


def concurrency_table(rows: List[Dict]):
    """Medians per (concurrency, mode) over repeats, against DFlash at concurrency 1 and the
    target alone at the same concurrency."""
    from rich.table import Table

    grouped: Dict[tuple, List[Dict]] = {}
    for r in rows:
        grouped.setdefault((r["concurrency"], r["mode"]), []).append(r)
    median = {k: statistics.median(r["aggregate_tps"] for r in v) for k, v in grouped.items()}
    table = Table(title="requests at once: tokens per second (aggregate: every request's tokens over the wall time)")
    for name in ("requests", "engine", "aggregate tok/s", "per request tok/s", "vs target batched", "vs mlx-lm batched",
                 "vs 1 request", "identical"):
        table.add_column(name, justify="right")
    names = {"dflash": "DFlash", "target": "target alone", "mlx_lm": "mlx-lm batch_generate"}
    for (level, mode), runs in sorted(grouped.items(), key=lambda kv: (kv[0][0], ["dflash", "target", "mlx_lm"].index(kv[0][1]))):
        rate = median[(level, mode)]
        rates = [r["request_tps"] for r in runs if r["request_tps"] is not None]
        ratio = lambda other: f"{rate / median[other]:.2f}x" if other in median and other != (level, mode) else "-"  # noqa: E731
        table.add_row(str(level), names[mode], f"{rate:.1f}", f"{statistics.median(rates):.1f}" if rates else "-",
                      ratio((level, "target")), ratio((level, "mlx_lm")), ratio((1, mode)),
                      "yes" if all(r["identical"] for r in runs) else "NO")
    return table
