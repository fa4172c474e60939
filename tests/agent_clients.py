"""How the real coding agents are run against `serve`, shared by the suite (tests/test_agents.py,
tests/agent_run.py) and CI's check of the installed wheel (.ci/check-wheel). The standard library
and dflash_mlx only: .ci/check-wheel runs this file with the wheel's own Python, which has no test
extras.

- ``RUNS``: each client's arguments for a plain prompt and for a tool round trip, non-interactive.
- ``namespace()``: the command prefix that makes a network namespace with only loopback (root:
  ``unshare -n``; otherwise a user namespace too, where the kernel allows one); ``in_namespace``
  runs a shell command there with loopback up.

    python tests/agent_clients.py BIN_DIR

(what .ci/check-wheel runs) runs ``dflash-mlx agent CLIENT --model scripted -- ARGS`` for each
client in BIN_DIR, the tool round trip, with the ``dflash-mlx`` found on PATH, in a fresh HOME and
``$DFLASH_MLX_HOME``, from a folder outside any Git repository, in the namespace; then the README's
own ``dflash-mlx agent`` line for Codex, as written. Each must exit 0 with the answer the scripted
pair gives once the tool's result came back. Exit 1 naming the first that does not.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

from dflash_mlx import agents, scripted

PLAIN = "Say hello."
ASK = f"Please {scripted.ASK}."
# Each client non-interactively; the tool run prints the tool's result (JSON events) so that the
# test sees it ran. Codex's sandbox is off: the namespace has no network, and its bundled bubblewrap
# is not what is under test. `codex exec` outside a Git repository needs --skip-git-repo-check,
# which `dflash-mlx agent` adds: the runs leave it out, so that they check that it does.
RUNS = {
    "claude": {"plain": ["-p", PLAIN],
               "tool": ["-p", ASK, "--allowedTools", "Bash", "--output-format", "stream-json", "--verbose"]},
    "codex": {"plain": ["exec", PLAIN],
              "tool": ["exec", "--dangerously-bypass-approvals-and-sandbox", "--json", ASK]},
    "opencode": {"plain": ["run", PLAIN], "tool": ["run", "--format", "json", ASK]},
}


def namespace() -> Optional[List[str]]:
    """The command prefix that runs a command with no network but loopback, or None where this
    machine cannot make one."""
    for prefix in (["unshare", "-n"], ["unshare", "-rn"]):
        if shutil.which("unshare") and subprocess.run([*prefix, "true"], capture_output=True).returncode == 0:
            return prefix
    return None


def in_namespace(prefix: List[str], command: str) -> List[str]:
    """``command`` (a shell line) run in the namespace ``prefix`` makes, with loopback up."""
    return [*prefix, "bash", "-c", f"ip link set lo up && {command}"]


def readme_agent_line(readme: Path, client: str) -> str:
    """The README's ``dflash-mlx agent CLIENT --model scripted`` line, as written."""
    lines = [line.strip() for line in readme.read_text().splitlines()
             if line.strip().startswith(f"dflash-mlx agent {client} --model scripted")]
    if not lines:
        raise SystemExit(f"the README has no `dflash-mlx agent {client} --model scripted` line")
    return lines[0]


def main(bin_dir: Path, readme: Path) -> None:
    prefix = namespace()
    if prefix is None:
        raise SystemExit("cannot make a network namespace (unshare -n, or unshare -rn without root): the clients "
                         "must not reach anything but loopback, so they are not run")
    runs = [(client, ["dflash-mlx", "agent", client, "--model", "scripted", "--", *RUNS[client]["tool"]])
            for client in agents.CLIENTS]
    runs.append(("codex", shlex.split(readme_agent_line(readme, "codex"))))
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        (root / "work").mkdir()
        env = {**os.environ, "HOME": str(root / "home"), "DFLASH_MLX_HOME": str(root / "dflash-mlx-home"),
               "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
        for client, argv in runs:
            started = time.time()
            done = subprocess.run(in_namespace(prefix, shlex.join(argv)), cwd=root / "work", env=env,
                                  capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
            seconds = time.time() - started
            answered = scripted.Script().after_tool in done.stdout
            if done.returncode != 0 or not answered:
                log = root / "dflash-mlx-home" / "agent-serve.log"
                raise SystemExit(f"`{shlex.join(argv)}` exited {done.returncode}"
                                 f"{'' if answered else ', without the answer that follows the tool'}:\n"
                                 f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}\n"
                                 f"server log:\n{log.read_text()[-2000:] if log.exists() else '(none)'}")
            print(f"wheel: `{shlex.join(argv)}`: a tool round trip in {seconds:.1f} s")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
