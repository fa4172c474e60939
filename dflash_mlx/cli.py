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

    Honours HF_HOME, HF_TOKEN, HF_ENDPOINT and HF_HUB_OFFLINE; interrupted downloads resume.
    """
    from .convert import ConversionError, convert_draft

    try:
        path, report = convert_draft(
            out, draft=draft, target=target, quant=quant, revision=revision, target_revision=target_revision,
            base_tokenizer=None if base_tokenizer.lower() == "none" else base_tokenizer, force=force,
        )
    except (ConversionError, ValueError) as e:
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
    """Convert a Hugging Face Qwen3.5 target to a text-only MLX checkpoint (vision tower and MTP dropped)."""
    from .convert import ConversionError, convert_target as run

    try:
        path = run(model, out, quant=quant, revision=revision, force=force)
    except (ConversionError, ValueError) as e:
        _fail(str(e))
    typer.echo(str(path))


if __name__ == "__main__":
    app()
