"""A tiny pair whose target answers one fixed text, for testing what the server does with a
model's output formats (reasoning blocks, later tool calls) on the real decode path.

Every sublayer's output projection is zero, so the target's state at a token is that token's
embedding, and its head maps each token of a chain to the next one: a deterministic bigram
model. The chain starts at the generation prompt's last token, so the text must not repeat a
token (nor use that one). With ``loop`` the chain goes back to that token instead of ending:
the answer repeats forever, and only a cancellation (or the context's end) stops it."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from dflash_mlx import tiny
from dflash_mlx.scripted import point_head

# Qwen3.5's chat format (see the published template): tools in a system turn, the generation
# prompt opens <think>, enable_thinking=False closes it empty, earlier answers carry their
# reasoning_content and their calls, tool results come back as user turns.
QWEN35_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>"
    "{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n\nIf you choose to call a function ONLY reply in "
    "the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n"
    "<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and m.get('reasoning_content') %}<think>\n{{ m['reasoning_content'] }}\n</think>\n\n{% endif %}"
    "{{ m['content'] or '' }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>\n<function={{ c['function']['name'] }}>\n"
    "{% if c['function']['arguments'] is mapping %}{% for k, v in c['function']['arguments'].items() %}"
    "<parameter={{ k }}>\n{{ v }}\n</parameter>\n{% endfor %}{% endif %}</function>\n</tool_call>{% endfor %}"
    "<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n"
    "{% if enable_thinking is defined and not enable_thinking %}\n</think>\n\n{% endif %}{% endif %}"
)
# Tool-call pieces as single tokens, so that a scripted call repeats none (the parser needs no newlines).
TOOL_TOKENS = ["<function=get_weather>", "<parameter=city>", "</parameter>", "</function>"]


def write_scripted_pair(root: Path, reply: str, template: str = QWEN35_TEMPLATE, loop: bool = False,
                        max_position_embeddings: int = 4096) -> tuple[Path, Path]:
    from tokenizers import Tokenizer

    target_dir, draft_dir = root / "target", root / "draft"
    eos = tiny.write_tokenizer(target_dir, extra_special_tokens=TOOL_TOKENS)
    config = tiny.write_target(target_dir, tiny.target_config(512, eos_token_id=eos, max_position_embeddings=max_position_embeddings))
    tiny.write_draft(draft_dir, tiny.draft_config(config, block_size=16))
    (target_dir / "chat_template.jinja").write_text(template)
    tokenizer = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    newline = tokenizer.encode("\n", add_special_tokens=False).ids
    end = newline[-1:] if loop else [tokenizer.token_to_id("<|im_end|>")]
    chain = newline[-1:] + tokenizer.encode(reply, add_special_tokens=False).ids + end
    if len(set(chain[1:])) != len(chain) - 1 or chain[0] in chain[1:-1]:
        raise ValueError(f"the reply's tokens repeat (or use the prompt's last one): {chain}")
    point_head(target_dir, [chain])
    return target_dir, draft_dir


@contextmanager
def openai_client(pair, *options):
    """The official ``openai`` client of a scripted server running for the duration of the block."""
    import openai

    with running_server(pair, *options) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


@contextmanager
def running_server(pair, *options):
    """``dflash-mlx serve`` on the pair for the duration of the block; yields its URL."""
    from tests.test_server import start_server, stop_server

    process, url = start_server(*pair, *options)
    try:
        yield url
    finally:
        stop_server(process)
