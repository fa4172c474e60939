"""Text from a request's commits: the prompt's token ids (``encode_prompt``), and per-token
responses as mlx-lm's ``stream_generate`` yields them (``Responder``: detokenized text, stop
strings, finish reasons, acceptance statistics)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Union

import mlx.core as mx
from mlx_lm.generate import GenerationResponse as MlxLmResponse
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .reasoning import partial_suffix
from .records import Commit

Prompt = Union[str, Sequence[int], Sequence[Dict[str, Any]], mx.array]


@dataclass
class GenerationResponse(MlxLmResponse):
    """mlx-lm's response plus acceptance statistics of the run so far."""

    cycles: int = 0  # target steps taken after the prompt
    accepted_tokens: int = 0  # drafted tokens that were accepted
    drafted_tokens: int = 0  # drafted tokens that were verified
    tokens_per_cycle: float = 0.0  # committed tokens per target step
    cached_prompt_tokens: int = 0  # prompt tokens reused from a PromptCache (not prefilled)
    block_tokens: int = 0  # size of the cycle that committed this token (0: the prompt's token)
    block_histogram: Dict[int, int] = field(default_factory=dict)  # cycles so far per block size
    stop_sequence: Optional[str] = None  # the stop string that ended the answer, if one did

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0


def encode_prompt(tokenizer: TokenizerWrapper, prompt: Prompt, enable_thinking: Optional[bool] = None) -> mx.array:
    """Token ids for a string, a list of ids, or chat messages (chat template applied)."""
    if isinstance(prompt, mx.array):
        return prompt.reshape(-1)
    if isinstance(prompt, str):
        bos = tokenizer.bos_token
        add_special = bos is None or not prompt.startswith(bos)
        return mx.array(tokenizer.encode(prompt, add_special_tokens=add_special))
    prompt = list(prompt)
    if prompt and isinstance(prompt[0], dict):
        extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, **extra)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return mx.array(ids)
    if not all(isinstance(t, int) for t in prompt):
        raise TypeError("prompt must be a string, a list of token ids or a list of chat messages")
    return mx.array(prompt)


class _StopText:
    """Incremental text with stop strings; holds back what could still become one."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.matched: Optional[str] = None  # the stop string that ended the text

    def push(self, segment: str) -> tuple[str, bool]:
        self.pending += segment
        for s in self.stops:
            i = self.pending.find(s)
            if i >= 0:
                out, self.pending, self.matched = self.pending[:i], "", s
                return out, True
        hold = max((partial_suffix(self.pending, s) for s in self.stops), default=0)
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class Responder:
    """Turns a request's commits, as they come, into per-token responses: text (detokenized, stop
    strings held back), finish reasons and statistics. ``finished`` once a response carries a
    finish reason. ``start`` says, before the first commit, how many prompt tokens a prompt cache
    held and when the prefill began (the prompt's tokens per second)."""

    def __init__(self, tokenizer, prompt_tokens: int, stop: Sequence[str], max_tokens: int):
        self.detokenizer = tokenizer.detokenizer
        self.detokenizer.reset()
        self.stop_text = _StopText(stop)
        self.eos = set(tokenizer.eos_token_ids)
        self.prompt_tokens, self.max_tokens = prompt_tokens, max_tokens
        self.reused = 0
        self.tic = time.perf_counter()
        self.prompt_tps = 0.0
        self.n = self.cycles = self.accepted = self.drafted = 0
        self.histogram: Dict[int, int] = {}
        self.finished = False

    def start(self, reused: int, started: Optional[float]) -> None:
        self.reused = reused
        if started is not None:
            self.tic = started

    def __call__(self, commit: Commit) -> List[GenerationResponse]:
        if self.n == 0:
            self.prompt_tps = (self.prompt_tokens - self.reused) / (time.perf_counter() - self.tic)
            self.tic = time.perf_counter()
        else:
            self.cycles += 1
            self.histogram = {**self.histogram, commit.drafted + 1: self.histogram.get(commit.drafted + 1, 0) + 1}
        self.accepted += commit.accepted
        self.drafted += commit.drafted
        out = []
        for i, token in enumerate(commit.tokens):
            out.append(self._token(commit, i, token))
            if self.n % 256 == 0:
                mx.clear_cache()  # MLX's buffer cache handed back every 256 tokens, as mlx-lm does
            if self.finished:
                break
        return out

    def _token(self, commit: Commit, i: int, token: int) -> GenerationResponse:
        self.n += 1
        n, detokenizer, stop_text = self.n, self.detokenizer, self.stop_text
        finish = None
        if token in self.eos:
            detokenizer.finalize()
            text, finish = stop_text.push(detokenizer.last_segment)[0] + stop_text.flush(), "stop"
        else:
            detokenizer.add_token(token)
            text, stopped = stop_text.push(detokenizer.last_segment)
            if stopped:
                finish = "stop"
            elif n >= self.max_tokens:
                detokenizer.finalize()
                text += stop_text.push(detokenizer.last_segment)[0] + stop_text.flush()
                finish = "length"
        self.finished = finish is not None
        elapsed = time.perf_counter() - self.tic
        cycles = self.cycles
        return GenerationResponse(
            text=text,
            token=token,
            logprobs=commit.logprobs[i] if commit.logprobs is not None else None,
            from_draft=i < commit.accepted,
            prompt_tokens=self.prompt_tokens,
            prompt_tps=self.prompt_tps,
            generation_tokens=n,
            generation_tps=n / elapsed if elapsed > 0 else 0.0,
            peak_memory=mx.get_peak_memory() / 1e9,
            finish_reason=finish,
            cycles=cycles,
            accepted_tokens=self.accepted,
            drafted_tokens=self.drafted,
            tokens_per_cycle=(n - 1) / cycles if cycles else 0.0,
            cached_prompt_tokens=self.reused,
            block_tokens=commit.drafted + 1 if cycles else 0,
            block_histogram=self.histogram,
            stop_sequence=stop_text.matched,
        )
