"""mlx-lm style API: ``load``, ``stream_generate``, ``generate``."""

from __future__ import annotations

import warnings
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Union

import mlx.core as mx
from mlx_lm.generate import wired_limit
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.tokenizer_utils import load as load_tokenizer

from . import defaults, device, loading, quantized, traffic
from .block_policy import BlockStats, BlockTokens
from .checkpoint_files import text_part
from .models.dflash import DFlashDraft, quantize_draft
from .models.qwen3_5 import Model as Target
from .prompt_cache import PromptCache, PromptCachePool
from .quant import parse_quant
from .sampling import Sampler
from .records import Cancelled
from .responses import GenerationResponse, Prompt, Responder, encode_prompt
from .runner import DecodeRequest, Local, Pipelined, PipelineLayout



@dataclass
class DFlashModel:
    """A target and, optionally, a bound DFlash draft."""

    target: Target
    draft: Optional[DFlashDraft] = None
    draft_window: Optional[int] = None
    target_path: Optional[Path] = None
    draft_path: Optional[Path] = None
    # What `block_tokens="auto"` learned on this pair: cycle costs (kept across requests) and the
    # last request's acceptance (the next one's prior).
    block_stats: BlockStats = field(default_factory=BlockStats)
    # The verify-matmul kernel's per-shape choices (Metal only; None: stock quantized_matmul).
    matmuls: Optional[quantized.QuantizedMatmuls] = None
    # Where requests run and what this process can do with them (``runner``): in this process, or
    # through the ranks of a pipeline (``mx.distributed``), where ``target`` is this rank's stage
    # and ``draft`` is on the last rank only.
    runner: Union[Local, Pipelined] = field(default_factory=Local)

    @property
    def draft_block_size(self) -> Optional[int]:
        """The draft's block size (None: no draft), on every rank of a pipeline."""
        return self.draft.block_size if self.draft is not None else self.runner.draft_block_size

    @property
    def draft_kind(self) -> Optional[str]:
        """``DFlash`` or ``DFlash2`` (None: no draft), on every rank of a pipeline."""
        return self.draft.kind if self.draft is not None else self.runner.draft_kind

    def use_quantized_matmuls(self, matmuls: Optional[quantized.QuantizedMatmuls],
                              cache: Optional[quantized.TuningCache] = None, everything: bool = False,
                              measure=quantized.wall_time, progress=None, stock_one=None) -> List[quantized.Timing]:
        """Route the pair's quantized layers through ``matmuls`` and time the shapes ``cache`` has
        no measurement for (all of them with ``everything``), each choosing one implementation for
        every row count (``quantized.Timing.choice``; ``stock_one``: where stock is one
        row-independent kernel, this GPU's rule by default). Returns the new timings."""
        self.matmuls = matmuls
        models = [m for m in (self.target, self.draft) if m is not None]
        for m in models:
            m.use_quantized_matmuls(matmuls)
        if matmuls is None:
            return []
        cache = cache or quantized.TuningCache.for_this_device()
        return quantized.tune_pair(matmuls, models, cache, everything=everything, measure=measure, progress=progress,
                                   stock_one=stock_one)


@dataclass
class RunTotals:
    """Statistics summed over finished generations (chat sessions, the server)."""

    runs: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    tokens: int = 0
    seconds: float = 0.0
    cycles: int = 0
    accepted: int = 0
    drafted: int = 0
    block_histogram: Dict[int, int] = field(default_factory=dict)

    def add(self, last: GenerationResponse) -> None:
        """Add a generation, given its last response (its counters are cumulative)."""
        self.runs += 1
        self.prompt_tokens += last.prompt_tokens
        self.cached_prompt_tokens += last.cached_prompt_tokens
        self.tokens += last.generation_tokens
        self.seconds += last.generation_tokens / last.generation_tps if last.generation_tps else 0.0
        self.cycles += last.cycles
        self.accepted += last.accepted_tokens
        self.drafted += last.drafted_tokens
        for block, cycles in last.block_histogram.items():
            self.block_histogram[block] = self.block_histogram.get(block, 0) + cycles

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_cycle(self) -> float:
        """Committed tokens per target step after the prompt (each run's first token comes from prefill)."""
        return (self.tokens - self.runs) / self.cycles if self.cycles else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def load(
    path_or_hf_repo: str,
    draft: Optional[str] = None,
    draft_quant: Optional[str] = None,
    draft_window: Union[None, int, str] = "auto",
    revision: Optional[str] = None,
    draft_revision: Optional[str] = None,
    draft_dtype: Any = "auto",
    matmuls: Any = "auto",
    stages: Union[None, str, Sequence[int]] = None,
    peer_timeout: float = 30.0,
    exact: bool = False,
) -> tuple[DFlashModel, TokenizerWrapper]:
    """Load a Qwen3.5 target (HF or MLX layout, local or from the Hub) and optionally a draft.

    ``"demo"`` loads the tiny pair shipped in the package, draft included.
    ``draft_quant``: ``w4``, ``w8``, ``w4:gs32``… quantizes the draft's linear layers.
    ``draft_window``: keep only that many recent context tokens in the draft's cache; None: all of
    them; ``"auto"``: the pair's default (``defaults.draft_window``: the demo draft's training
    window, the whole context for other drafts).
    ``draft_dtype``: the draft's activation dtype; ``"auto"`` is float32 on Apple GPUs without
    native bfloat16 (M1/M2, where 16-bit drafts lose most of their acceptance; see
    ``device.WITHOUT_NATIVE_BFLOAT16``) and the checkpoint's own elsewhere; None keeps it.
    ``matmuls``: ``"auto"`` routes quantized layers through the verify-matmul kernel on an Apple
    GPU where it measured faster (the first load of a pair's shapes on a device times them, a
    few seconds, cached under ``$DFLASH_MLX_HOME``); None keeps MLX's stock quantized matmul.
    ``exact``: every routed layer runs one implementation for every row count, so that a verify
    row is bit for bit its decode step whatever that costs; by default a layer where that costs
    more than ``quantized.EXACT_BUDGET`` of its share of a cycle runs the fastest at each row
    count (greedy output may then differ from the target alone at its top-2 near-ties).

    In a process group of several ranks (``mx.distributed.init()``, e.g. under ``mlx.launch``) the
    target is pipelined: each rank loads its stage's layers, balanced by weight bytes unless
    ``stages`` gives the layer count per rank (``"10,14"``), and the draft is on the last rank;
    ``peer_timeout``: seconds without an answer from the other ranks before a request fails.
    See ``serve_pipeline`` for the ranks other than 0, and docs/pipeline.md.
    """
    if path_or_hf_repo == defaults.DEMO:
        path_or_hf_repo, draft = defaults.demo(draft)
    if draft is None and parse_quant(draft_quant) is not None:
        raise ValueError("draft_quant was given but no draft")
    target_path = loading.resolve_path(path_or_hf_repo, revision)
    draft_path = loading.resolve_path(draft, draft_revision) if draft is not None else None
    if draft_window == "auto":
        draft_window = defaults.draft_window(draft_path)
    group = mx.distributed.init()
    layout = PipelineLayout(group, target_path, draft_path, stages) if group.size() > 1 else None
    target, config = loading.load_target(target_path, stage_of=layout.stage_of if layout else None)
    eos = config.get("eos_token_id") or text_part(config).get("eos_token_id")
    tokenizer = load_tokenizer(target_path, eos_token_ids=[eos] if isinstance(eos, int) else eos)
    model = DFlashModel(target, target_path=target_path, draft_window=draft_window, draft_path=draft_path)
    if layout is not None:
        model.runner = layout.runner(target, peer_timeout)
    if draft_path is not None and (layout is None or layout.stage.last):
        model.draft, draft_config = loading.load_draft(draft_path)
        model.draft.bind(target)
        warn_if_mask_is_a_token(model.draft.mask_token_id, tokenizer)
        warn_if_converted_for_another_tokenizer(draft_config, target_path)
        quantize_draft(model.draft, draft_quant)
        model.draft.compute_in(device.draft_activation_dtype() if draft_dtype == "auto" else draft_dtype)
        mx.eval(model.draft.parameters())
    if matmuls == "auto":
        matmuls = quantized.QuantizedMatmuls.for_this_process(exact=exact)
    elif exact and matmuls is not None and not matmuls.exact:
        raise ValueError("exact=True with a QuantizedMatmuls built with exact=False: build it with exact=True")
    if matmuls is not None:
        with TuningProgress() as progress:
            model.use_quantized_matmuls(matmuls, progress=progress)
    model.block_stats.costs.set_prior(traffic.auto_prior(model))  # on a Mac: modelled cycle costs until measured
    return model, tokenizer


class TuningProgress:
    """A progress bar on stderr while the first load on a GPU times the pair's matmul shapes."""

    def __enter__(self):
        from rich.console import Console
        from rich.progress import Progress

        self._bar = Progress(console=Console(stderr=True), transient=True)
        self._task = None
        return self._update

    def _update(self, done: int, total: int) -> None:
        if self._task is None:
            self._bar.start()
            self._task = self._bar.add_task("timing quantized matmuls on this GPU (first use; cached)", total=total)
        self._bar.update(self._task, completed=done)

    def __exit__(self, *exc):
        if self._task is not None:
            self._bar.stop()
        return False


def warn_if_mask_is_a_token(mask_token_id: int, tokenizer) -> Optional[str]:
    """A mask id that is a real token of the target's tokenizer makes the draft misread text."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    if mask_token_id >= len(hf):
        return None
    token = hf.convert_ids_to_tokens(mask_token_id)
    message = (
        f"draft mask_token_id {mask_token_id} is the real token {token!r} of the target's tokenizer: "
        "the draft cannot tell masked slots from that token (convert the draft for this tokenizer)"
    )
    warnings.warn(message, stacklevel=3)
    return message


def warn_if_converted_for_another_tokenizer(draft_config: Dict[str, Any], target_path: Path) -> Optional[str]:
    """A converted draft records its target's tokenizer; a different one deserves a warning."""
    from .convert import METADATA_KEY, tokenizer_fingerprint

    meta = draft_config.get(METADATA_KEY) or {}
    recorded = meta.get("target_tokenizer_sha256")
    if not recorded or tokenizer_fingerprint(target_path) == recorded:
        return None
    message = (
        f"this draft was converted for the tokenizer of {meta.get('target')!r}, which differs from the loaded "
        "target's; re-run `dflash-mlx convert` for this target"
    )
    warnings.warn(message, stacklevel=3)
    return message


def stream_generate(
    model: Union[DFlashModel, Target],
    tokenizer: TokenizerWrapper,
    prompt: Prompt,
    max_tokens: int = 256,
    block_tokens: Union[None, int, str] = "auto",
    sampler: Optional[Sampler] = None,
    temp: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: Optional[int] = None,
    stop: Optional[Sequence[str]] = None,
    use_draft: bool = True,
    prefill_step_size: Optional[int] = None,
    enable_thinking: Optional[bool] = None,
    prompt_cache: Union[None, PromptCache, PromptCachePool] = None,
    checkpoint_at: Sequence[int] = (),
    cancelled: Optional[Callable[[], bool]] = None,
    constraint=None,
) -> Iterator[GenerationResponse]:
    """Yield one response per generated token, as ``mlx_lm.stream_generate`` does.

    With a draft (and ``use_draft``) the tokens come from DFlash speculative decoding; the
    output is exactly what the target alone produces (greedy) or follows its distribution
    (sampling). ``from_draft`` is True for drafted tokens that the target accepted.
    ``block_tokens``: ``"auto"`` (default) picks each cycle's block size from measured cycle
    costs and acceptance, down to 1 (plain decoding) when drafting does not pay; ``"auto:N"``
    caps it at N; an integer N drafts exactly N tokens per cycle (1: the target alone). A sampled
    request with a ``seed`` drafts whole blocks (N, or the cap), so that it is reproducible.
    Sampling (``temp`` > 0, or ``sampler``) follows mlx-lm's ``make_sampler``: see ``Sampler``.
    Each request draws from its own generator, seeded by ``seed`` (or OS entropy when None);
    MLX's global generator is neither used nor advanced.
    ``prompt_cache`` (a ``PromptCache``, or a ``PromptCachePool`` of several) keeps the caches
    between calls: a prompt that shares a prefix with an earlier one (the next chat turn, the
    same file context) only prefills the rest; ``checkpoint_at`` lists prompt positions worth a
    checkpoint (e.g. where the next turn's prompt will start to differ).
    ``cancelled``: polled before every prefill chunk and every cycle; when it returns True the
    request stops there (the cache keeps what was fed and committed) and nothing more is yielded.
    ``prefill_step_size``: prompt tokens per prefill chunk (default: this backend's,
    ``prefill.default_prefill_step``). The request runs through the one decode protocol
    (``driver.Driver``) as a batch of one: the same computation as in a server's batch.

    ``constraint``: a structured output's grammar (``grammar.Grammars.for_tokenizer(tokenizer,
    vocab).json_schema(schema)`` and the like): every token, drafted or not, is one the grammar
    allows, and the answer is exactly the target's under it (greedy: constrained target-only
    decoding; sampled: its constrained distribution).

    Pipelined (``model.runner``): on rank 0 this sends the request to the other ranks and yields
    the answer (``logprobs`` None: they stay on the last rank); on every other rank it takes part
    in that one request and yields nothing (each rank runs the same script).
    """
    if not isinstance(model, DFlashModel):  # a bare target, of any family
        model = DFlashModel(model)
    if not model.runner.leads:  # a pipeline's other ranks take part in rank 0's request
        model.runner.follow(model)
        return
    request = _decode_request(model, tokenizer, prompt, max_tokens, block_tokens, sampler, temp, top_p, top_k, min_p,
                              seed, use_draft, prefill_step_size, enable_thinking)
    if constraint is not None:
        request = dataclasses.replace(request, constraint=constraint)
    run = model.runner.start(model, request, prompt_cache, checkpoint_at, cancelled)
    respond = Responder(tokenizer, request.prompt.size, stop or [], max_tokens)
    # As mlx-lm does: the weights wired in memory while generating (Metal; a no-op elsewhere).
    try:
        with wired_limit(model.target):
            for commit in run.steps:
                if respond.n == 0:
                    respond.start(run.reused, run.started)
                yield from respond(commit)
                if respond.finished:
                    return
    except Cancelled:
        return
    finally:
        run.close()  # abandons the cycle in flight: the caches hold exactly the recorded tokens


def _decode_request(model: DFlashModel, tokenizer, prompt: Prompt, max_tokens: int, block_tokens, sampler, temp: float,
                    top_p: float, top_k: int, min_p: float, seed: Optional[int], use_draft: bool,
                    prefill_step_size: Optional[int], enable_thinking: Optional[bool]) -> DecodeRequest:
    """``stream_generate``'s arguments checked (before anything runs or leaves this process) and
    made a request for the decode loop, the sampler with the request's own generator."""
    if sampler is None:
        sampler = Sampler(temp, top_p=top_p, top_k=top_k, min_p=min_p)
    elif not isinstance(sampler, Sampler):
        raise TypeError("sampler must be a dflash_mlx.Sampler: rejection sampling needs its probabilities")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    sampler = sampler.for_request(seed)  # the request's own generator: MLX's global one is never touched
    ids = encode_prompt(tokenizer, prompt, enable_thinking)
    if use_draft:
        BlockTokens.parse(block_tokens).cap(model.draft_block_size)
    return DecodeRequest(ids, max_tokens, block_tokens, sampler, seed, use_draft, prefill_step_size,
                         set(tokenizer.eos_token_ids))


def serve_pipeline(model: DFlashModel) -> None:
    """On a pipeline's ranks other than 0: take part in every request rank 0 sends, until rank 0
    calls ``model.runner.close()`` (the CLI's ``generate``, ``serve`` and ``bench`` do)."""
    model.runner.follow(model, forever=True)


def generate(
    model: Union[DFlashModel, Target],
    tokenizer: TokenizerWrapper,
    prompt: Prompt,
    verbose: bool = False,
    **kwargs,
) -> str:
    """The whole completion as a string (``verbose`` streams it and prints statistics)."""
    text = ""
    last = None
    for last in stream_generate(model, tokenizer, prompt, **kwargs):
        if verbose:
            print(last.text, end="", flush=True)
        text += last.text
    if verbose and last is not None:
        print()
        print("=" * 10)
        print(f"Prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.3f} tokens-per-sec")
        print(f"Generation: {last.generation_tokens} tokens, {last.generation_tps:.3f} tokens-per-sec")
        if last.cycles and last.drafted_tokens:
            print(
                f"Speculation: {last.tokens_per_cycle:.2f} tokens/cycle, "
                f"acceptance {last.acceptance_rate:.1%} over {last.cycles} cycles"
            )
        print(f"Peak memory: {last.peak_memory:.3f} GB")
    return text
