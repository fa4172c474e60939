"""The ``dflash-mlx`` command line."""

from __future__ import annotations

import json
import sys
import warnings
from typing import List, Optional

import typer

app = typer.Typer(
    help="Lossless DFlash speculative decoding for Qwen3.5 models on MLX.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=1)


@app.callback()
def main() -> None:
    """Lossless DFlash speculative decoding for Qwen3.5 models on MLX."""


@app.command()
def generate(
    model: str = typer.Option(..., "--model", "-m", help="Target: a local checkpoint folder or a Hugging Face repo id."),
    draft: Optional[str] = typer.Option(None, "--draft", "-d", help="DFlash draft folder or repo id; without it the target runs alone."),
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="The prompt; read from stdin when omitted."),
    draft_quant: str = typer.Option("none", "--draft-quant", help="Quantize the draft: w4, w8, w4:gs32 … or none."),
    block_tokens: Optional[int] = typer.Option(None, "--block-tokens", "-b", help="Tokens per draft block (1 .. the draft's block size; default: the draft's)."),
    max_tokens: int = typer.Option(256, "--max-tokens", help="Stop after this many generated tokens."),
    temp: float = typer.Option(0.0, "--temp", help="Sampling temperature; 0 is greedy."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass (1.0 = off)."),
    top_k: int = typer.Option(0, "--top-k", help="Keep only the k most likely tokens (0 = off)."),
    min_p: float = typer.Option(0.0, "--min-p", help="Drop tokens below min_p times the top probability (0 = off)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed for sampling."),
    stop: Optional[List[str]] = typer.Option(None, "--stop", help="Stop string (repeatable)."),
    chat_template: bool = typer.Option(True, "--chat-template/--no-chat-template", help="Wrap the prompt as a user message in the chat template."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON record (text, tokens, timings, acceptance) instead of the text."),
) -> None:
    """Generate one completion: text to stdout, statistics to stderr."""
    from . import api
    from .loading import CheckpointError

    if prompt is None:
        prompt = sys.stdin.read()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loaded, tokenizer = api.load(model, draft=draft, draft_quant=draft_quant)
        for w in caught:
            typer.secho(f"warning: {w.message}", fg=typer.colors.YELLOW, err=True)
        use_template = chat_template and tokenizer.chat_template is not None
        request = [{"role": "user", "content": prompt}] if use_template else prompt
        text, tokens, last = "", [], None
        for last in api.stream_generate(
            loaded, tokenizer, request, max_tokens=max_tokens, block_tokens=block_tokens,
            temp=temp, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed, stop=stop,
        ):
            text += last.text
            tokens.append(last.token)
            if not as_json:
                sys.stdout.write(last.text)
                sys.stdout.flush()
    except (CheckpointError, ValueError, TypeError) as e:
        _fail(str(e))
    stats = dict(
        prompt_tokens=last.prompt_tokens, prompt_tps=last.prompt_tps, generation_tokens=last.generation_tokens,
        generation_tps=last.generation_tps, peak_memory_gb=last.peak_memory, finish_reason=last.finish_reason,
        cycles=last.cycles, tokens_per_cycle=last.tokens_per_cycle, acceptance_rate=last.acceptance_rate,
    )
    if as_json:
        print(json.dumps({"text": text, "tokens": tokens, **stats}))
    else:
        print()
        line = f"{last.generation_tokens} tokens, {last.generation_tps:.1f} tok/s"
        if draft:
            line += f", {last.tokens_per_cycle:.2f} tokens/cycle, acceptance {last.acceptance_rate:.0%}"
        typer.secho(line, dim=True, err=True)


if __name__ == "__main__":
    app()
