"""Request fields the server does not use, and hosted tools it cannot run: the policy.

- Fields the API documents are accepted. Where one does not apply to a local server (billing and
  caching hints, metadata, service tiers, ``prompt_cache_key``...), it is ignored with a log line;
  where ignoring it would change what the answer means (``previous_response_id``, ``n`` > 1,
  JSON output formats, penalties...), the request is refused with a 400 that names it.
- Fields the API does not document are ignored with a log line, as llama.cpp's server and
  ``mlx_lm.server`` ignore what they do not read: clients add their own (Codex's
  ``client_metadata``), and a refusal would stop the client at its first request.
- Hosted tools (``web_search``, ``file_search``, ``code_interpreter``, MCP servers...) run on the
  provider's side, which a local server has not: they are left out of the prompt, logged, and named
  in the ``x-dflash-ignored-tools`` response header.

The log line is INFO on every request and WARNING the first time a route sees a field (or a tool
type), so that the default output says it once.
"""

from __future__ import annotations

import logging
import re
from typing import Dict, Iterable, Optional

LOG = logging.getLogger("dflash_mlx.server")
IGNORED_TOOLS_HEADER = "x-dflash-ignored-tools"


class IgnoredFields:
    """The server's log of what requests sent that it ignores (one per engine): INFO each time,
    WARNING the first time a route sees a field, so that the default output says it once."""

    def __init__(self):
        self.seen: set = set()

    def note(self, route: str, fields: Iterable[str], what: str = "fields") -> None:
        """Log the ``fields`` of a request to ``route`` that the server ignores."""
        fields = sorted({str(f) for f in fields})
        if not fields:
            return
        new = [f for f in fields if (route, what, f) not in self.seen]
        self.seen.update((route, what, f) for f in new)
        level = logging.WARNING if new else logging.INFO
        LOG.log(level, "%s: ignored %s: %s (see docs/server.md, unknown fields)", route, what, ", ".join(fields))


def ignored_tools_header(names: Iterable[str]) -> Optional[Dict[str, str]]:
    """The response header naming the hosted tools left out (None when there are none)."""
    names = list(dict.fromkeys(re.sub(r"[^\x21-\x7e]", "?", str(n)) for n in names))  # a header: printable ASCII
    return {IGNORED_TOOLS_HEADER: ", ".join(names)} if names else None
