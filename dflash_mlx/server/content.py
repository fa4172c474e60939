"""Content the target cannot read: one policy for every route.

The targets served here read text: Qwen3.5's checkpoints ship a vision tower, which the loaders
drop (docs/server.md says what serving images would take). A request part that carries an image,
a document or audio, wherever it stands (a message's content, a tool's result, a function call's
output), is refused with a 400 that names the part, e.g. ``messages[2].content[1]: image content
('image_url') is not supported by this text-only target``. Never dropped: an answer given as if
the picture had not been sent reads as the model's answer about it.
"""

from __future__ import annotations

from typing import Any

from .errors import APIError

# Each API's part types for what a text-only target cannot read, and what each carries.
UNREADABLE = {
    # OpenAI chat completions
    "image_url": "image", "input_audio": "audio", "file": "file",
    # OpenAI Responses
    "input_image": "image", "input_file": "file",
    # Anthropic Messages
    "image": "image", "document": "document",
}


def check_part(part: Any, where: str) -> None:
    """Refuse ``part`` (a content part or block, at ``where`` in the request) if it carries
    something the target cannot read; anything else passes."""
    kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
    if isinstance(kind, str) and kind in UNREADABLE:
        raise APIError(400, f"{where}: {UNREADABLE[kind]} content ({kind!r}) is not supported by this text-only target",
                       param=where, code="unsupported_content")


def check_parts(content: Any, where: str) -> None:
    """``check_part`` on every part of a list ``content`` (a string or None has none)."""
    if isinstance(content, list):
        for j, part in enumerate(content):
            check_part(part, f"{where}[{j}]")
