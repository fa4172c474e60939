"""Request fields the server does not use, and hosted tools it cannot run: the policy.

- Fields the API documents are accepted. Where one does not apply to a local server (billing and
  caching hints, metadata, service tiers, ``prompt_cache_key``...), it is ignored with a log line;
  where ignoring it would change what the answer means (``previous_response_id``, ``n`` > 1,
  schemas the grammar engine cannot compile, penalties...), the request is refused with a 400 that names it.
- Fields the API does not document are ignored with a log line, as llama.cpp's server and
  ``mlx_lm.server`` ignore what they do not read: clients add their own (Codex's
  ``client_metadata``), and a refusal would stop the client at its first request.
- Hosted tools (``web_search``, ``file_search``, ``code_interpreter``, MCP servers...) run on the
  provider's side, which a local server has not: they are left out of the prompt, logged, and named
  in the ``x-dflash-ignored-tools`` response header.

Content blocks and parts a route leaves out of the prompt (Messages' blocks, inside a
``tool_result`` too; chat completions' and Responses' non-text parts, such as a ``refusal``) are
logged the same way and counted by route and type in /metrics (``dflash_dropped_content_blocks_total``).

The log line is INFO on every request and WARNING the first time a route sees a field (or a tool
type), so that the default output says it once.
"""

from __future__ import annotations

import logging
import re
from typing import Dict, Iterable, Optional, Tuple

LOG = logging.getLogger("dflash_mlx.server")
IGNORED_TOOLS_HEADER = "x-dflash-ignored-tools"


class IgnoredFields:
    """The server's log of what requests sent that it ignores (one per engine): INFO each time,
    WARNING the first time a route sees a field, so that the default output says it once."""

    def __init__(self):
        self.seen: set = set()
        # Content blocks left out of prompts, by (route, block type): /metrics counts them. Updated
        # by the routes' handlers, on the event loop only.
        self.dropped: Dict[Tuple[str, str], int] = {}

    def note(self, route: str, fields: Iterable[str], what: str = "fields") -> None:
        """Log the ``fields`` of a request to ``route`` that the server ignores."""
        fields = sorted({str(f) for f in fields})
        if not fields:
            return
        new = [f for f in fields if (route, what, f) not in self.seen]
        self.seen.update((route, what, f) for f in new)
        level = logging.WARNING if new else logging.INFO
        LOG.log(level, "%s: ignored %s: %s (see docs/server.md, unknown fields)", route, what, ", ".join(fields))

    def drop(self, route: str, kinds: Iterable[str], what: str = "content blocks") -> None:
        """Log the content blocks of a request to ``route`` that the prompt leaves out (``kinds``:
        one block type per block) and count each one, so that /metrics shows what models never saw."""
        kinds = [str(k) for k in kinds]
        for kind in kinds:
            self.dropped[(route, kind)] = self.dropped.get((route, kind), 0) + 1
        self.note(route, kinds, what)

    def prometheus(self, model: str) -> str:
        """The dropped blocks' counter in Prometheus' text format (its header alone before any)."""
        out = ["# HELP dflash_dropped_content_blocks_total Content blocks left out of prompts (logged), by route and type",
               "# TYPE dflash_dropped_content_blocks_total counter"]
        for (route, kind), count in sorted(self.dropped.items()):
            out.append(f'dflash_dropped_content_blocks_total{{model="{model}",route="{route}",type="{_label(kind)}"}} {count}')
        return "\n".join(out) + "\n"


def _label(value: str) -> str:
    """A Prometheus label value: backslash, quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def ignored_tools_header(names: Iterable[str]) -> Optional[Dict[str, str]]:
    """The response header naming the hosted tools left out (None when there are none)."""
    names = list(dict.fromkeys(re.sub(r"[^\x21-\x7e]", "?", str(n)) for n in names))  # a header: printable ASCII
    return {IGNORED_TOOLS_HEADER: ", ".join(names)} if names else None
