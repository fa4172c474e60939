"""Interactive chat: streamed answers, multi-turn history, cache reuse between turns."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Union

from .api import DFlashModel, GenerationResponse, RunTotals, stream_generate
from .block_policy import describe
from .prompt_cache import PromptCache, PromptCachePool
from .reasoning import splitters

HELP = """Commands:
  /think   thinking on or off (the model's reasoning is shown dimmed)
  /reset   forget the conversation (and its caches)
  /stats   statistics of this session
  /help    this help
  /exit    leave (Ctrl-D works too)
Ctrl-C stops the answer being written and keeps the session."""

DIM, RESET = "\033[2m", "\033[0m"


def summary(totals: RunTotals) -> str:
    text = f"{totals.runs} turns, {totals.tokens} tokens, {totals.tokens_per_second:.1f} tok/s"
    if totals.drafted:
        text += f", {totals.tokens_per_cycle:.2f} tokens/cycle, acceptance {totals.acceptance_rate:.0%}"
        text += f", {describe(totals.block_histogram)}"
    return text


def answer_line(r: GenerationResponse, speculative: bool) -> str:
    """The one dim line after each answer."""
    line = f"{r.generation_tokens} tokens, {r.generation_tps:.1f} tok/s"
    if speculative:
        line += f", {r.tokens_per_cycle:.2f} tokens/cycle, acceptance {r.acceptance_rate:.0%}, {describe(r.block_histogram)}"
    line += f", prompt {r.prompt_tokens - r.cached_prompt_tokens} new + {r.cached_prompt_tokens} cached tokens"
    return line


@dataclass
class ChatSession:
    model: DFlashModel
    tokenizer: object
    system: Optional[str] = None
    think: bool = False
    generation: Dict = field(default_factory=dict)  # max_tokens, block_tokens, sampling
    history: List[Dict[str, str]] = field(default_factory=list)
    cache: Union[PromptCache, PromptCachePool] = field(default_factory=PromptCache)  # a pool: over a disk tier
    stats: RunTotals = field(default_factory=RunTotals)
    last_tokens: List[int] = field(default_factory=list)

    def reset(self) -> None:
        self.history.clear()
        self.cache.reset()

    def messages(self, user: str) -> List[Dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.history + [{"role": "user", "content": user}]

    def ask(self, user: str, out=sys.stdout) -> Optional[GenerationResponse]:
        """Stream one answer to ``out``; Ctrl-C ends it early and keeps what was written."""
        text, last = "", None
        messages = self.messages(user)
        # The next turn's prompt repeats this one up to the end of the user's message (the
        # template may render this answer differently): checkpoint there.
        stable = self.tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=True)
        stream = stream_generate(
            self.model, self.tokenizer, messages, prompt_cache=self.cache, checkpoint_at=[len(stable)],
            enable_thinking=self.think, **self.generation,
        )
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                    enable_thinking=self.think)
        splitter = splitters(self.tokenizer, prompt)()  # the family's reasoning format (reasoning.chat_format)
        self.last_tokens, reasoning = [], ""

        def show(thought: str, answer: str) -> None:
            nonlocal text, reasoning
            if thought:
                out.write(f"{DIM}{thought}{RESET}")
            out.write(answer)
            out.flush()
            text, reasoning = text + answer, reasoning + thought

        stopped = False
        try:
            for last in stream:
                self.last_tokens.append(last.token)
                show(*splitter.push(last.text))
        except KeyboardInterrupt:
            stream.close()
            stopped = True
        show(*splitter.flush())
        out.write(" [stopped]\n" if stopped else "\n")
        answer = {"role": "assistant", "content": text}
        if reasoning:
            answer["reasoning_content"] = reasoning  # the template decides whether earlier reasoning is shown again
        self.history += [{"role": "user", "content": user}, answer]
        if last is not None:
            self.stats.add(last)
        return last


def run_chat(session: ChatSession, speculative: bool) -> None:
    print("dflash-mlx chat. /help for commands, Ctrl-D to leave.", flush=True)
    while True:
        try:
            user = input(">>> ")
        except EOFError:
            print()
            return
        except KeyboardInterrupt:
            print()
            continue
        command = user.strip()
        if not command:
            continue
        if command in ("/exit", "/quit"):
            return
        if command == "/help":
            print(HELP)
        elif command == "/reset":
            session.reset()
            print("(conversation cleared)")
        elif command == "/stats":
            print(summary(session.stats))
        elif command == "/think":
            session.think = not session.think
            print(f"(thinking {'on' if session.think else 'off'})")
        elif command.startswith("/"):
            print(f"unknown command {command}; /help lists them")
        else:
            last = session.ask(user)
            if last is not None:
                print(f"{DIM}{answer_line(last, speculative)}{RESET}", flush=True)
