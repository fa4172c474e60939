"""Quick start without downloads: write a tiny random Qwen3.5 pair and decode with DFlash.

    python examples/quickstart.py /tmp/dflash-tiny

Random weights produce gibberish, and a random draft is rarely accepted; the point is that
the speculative output is exactly the target's own. For real models see the README.
"""

import sys
from pathlib import Path

import dflash_mlx
from dflash_mlx import tiny

root = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/dflash-tiny")
target_dir, draft_dir = tiny.write_pair(root)
print(f"tiny target: {target_dir}\ntiny draft:  {draft_dir}")

model, tokenizer = dflash_mlx.load(str(target_dir), draft=str(draft_dir))
prompt = "def fibonacci(n):"
speculative = dflash_mlx.generate(model, tokenizer, prompt, max_tokens=64, block_tokens=8, verbose=True)
alone = dflash_mlx.generate(model, tokenizer, prompt, max_tokens=64, use_draft=False)
assert speculative == alone, "speculative output must equal the target's own"
print("speculative output == target-only output")
