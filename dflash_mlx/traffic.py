"""What a verify pass reads through its quantized matmuls, from the shapes and MLX 0.32's Metal
dispatch rules (``mlx/backend/metal/quantized.cpp``: ``get_qmv_batch_limit``, ``qmv_wide``).

Computed, not measured: the weight bytes each kernel requests (the system-level cache can serve
part of a re-read; activations are small beside the weights and left out). Stock, for transposed
affine weights and M rows: M = 1 runs ``qmv``; M at or above the batch limit runs ``qmm`` (32-row
tiles: the weights once per 32 rows, but it computes the padding rows and public per-op timings put
M = 16 at 3.9-4.5x of M = 1, so bytes understate its cost); below the limit M3 and later run
``qmv_wide`` (at most 5 rows per tile, the weights once per tile) and M1/M2 one ``qmv`` per row.
Ours (``metal/quantized_verify.metal``) reads them once for M <= 16. Experts of a mixture of
experts go through ``gather_qmm`` either way (the kernel has no gather form).

``python -m dflash_mlx.traffic`` prints the tables of ``docs/kernels.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Tuple

GENERATIONS = {"M1/M2": 13, "M3/M4": 15, "M5": 17}  # Apple GPU generation (laptop and desktop, not Ultra)
GB = 1e9


def qmv_batch_limit(K: int, N: int, generation: int, ultra: bool = False) -> int:
    """MLX 0.32.2's ``get_qmv_batch_limit(D=K, O=N)``: from this many rows on, ``qmm`` runs."""
    small, medium = K <= 2048 and N <= 2048, K <= 4096 and N <= 4096
    if generation >= 17 and not ultra:
        return 33 if small else 25 if medium else 13
    if generation >= 15 and not ultra:
        return 13 if small else 15 if medium else 13
    if generation >= 13:
        return (32 if small else 18 if medium else 12) if ultra else (14 if small else 10 if medium else 6)
    return (32 if small else 18 if medium else 12) if ultra else (18 if small else 12 if medium else 10)


def stock_reads(M: int, K: int, N: int, generation: int, ultra: bool = False) -> Tuple[str, int]:
    """The stock kernel for an M-row affine ``quantized_matmul`` and how often it reads the weights."""
    if M == 1:
        return "qmv", 1
    if M >= qmv_batch_limit(K, N, generation, ultra):
        return "qmm", math.ceil(M / 32)
    if generation >= 15:  # affine qmv_wide only on generation 15+
        return "qmv_wide", math.ceil(M / 5)
    return "qmv", M


@dataclass(frozen=True)
class Matmul:
    name: str
    K: int
    N: int
    count: int  # per forward pass
    bits: int = 4
    group_size: int = 64

    @property
    def bytes(self) -> int:
        """Packed weights plus 16-bit scales and biases."""
        return self.count * (self.N * self.K * self.bits // 8 + 2 * 2 * self.N * (self.K // self.group_size))


# Published configs (Qwen/Qwen3.5-9B, Qwen/Qwen3.5-35B-A3B text_config); 4-bit group 64 as mlx-lm
# writes them, the MoE router and shared-expert gate at 8 bits (mlx-community's recipe).
QWEN35_9B = dict(hidden=4096, layers=32, interval=4, heads=16, kv_heads=4, head_dim=256, k_heads=16, v_heads=32,
                 k_dim=128, v_dim=128, vocab=248320, intermediate=12288)
QWEN35_35B_A3B = dict(hidden=2048, layers=40, interval=4, heads=16, kv_heads=2, head_dim=256, k_heads=16, v_heads=32,
                      k_dim=128, v_dim=128, vocab=248320, experts=256, top_k=8, expert_width=512, shared_width=512)


def dense_matmuls(c: Dict) -> List[Matmul]:
    """Every quantized matmul a forward pass of the target runs through ``quantized_matmul``."""
    H, attn = c["hidden"], c["layers"] // c["interval"]
    linear = c["layers"] - attn
    value = c["v_heads"] * c["v_dim"]
    out = [
        Matmul("GDN in_proj_qkv", H, 2 * c["k_heads"] * c["k_dim"] + value, linear),
        Matmul("GDN in_proj_z", H, value, linear),
        Matmul("GDN in_proj_b, in_proj_a", H, c["v_heads"], 2 * linear),
        Matmul("GDN out_proj", value, H, linear),
        Matmul("attention q_proj (+gate)", H, 2 * c["heads"] * c["head_dim"], attn),
        Matmul("attention k_proj, v_proj", H, c["kv_heads"] * c["head_dim"], 2 * attn),
        Matmul("attention o_proj", c["heads"] * c["head_dim"], H, attn),
        Matmul("lm_head", H, c["vocab"], 1),
    ]
    if "experts" in c:
        out += [Matmul("router", H, c["experts"], c["layers"], bits=8),
                Matmul("shared expert gate_proj, up_proj", H, c["shared_width"], 2 * c["layers"]),
                Matmul("shared expert down_proj", c["shared_width"], H, c["layers"]),
                Matmul("shared_expert_gate", H, 1, c["layers"], bits=8)]
    else:
        out += [Matmul("MLP gate_proj, up_proj", H, c["intermediate"], 2 * c["layers"]),
                Matmul("MLP down_proj", c["intermediate"], H, c["layers"])]
    return out


def pass_bytes(matmuls: List[Matmul], M: int, generation: int, ours: bool) -> int:
    """Weight bytes one M-row pass requests through the dense quantized matmuls."""
    if ours and M <= 16:
        return sum(m.bytes for m in matmuls)
    return sum(m.bytes * stock_reads(M, m.K, m.N, generation)[1] for m in matmuls)


def expert_bytes(c: Dict, M: int) -> float:
    """Expert weights an M-token pass reads through ``gather_qmm`` (the same for stock and ours).
    mlx-lm's SwitchGLU sorts tokens by expert from 64 (token, expert) pairs on, so each distinct
    expert is read once: expected 256 (1 - (1 - 8/256)^M) per layer for independent uniform routing
    (neighbouring tokens share experts more often, so real counts are lower); below 64 pairs each
    pair reads its expert."""
    if "experts" not in c:
        return 0.0
    E, k = c["experts"], c["top_k"]
    per_expert = Matmul("expert", c["hidden"], c["expert_width"], 3).bytes
    pairs = M * k
    reads = E * (1 - (1 - k / E) ** M) if pairs >= 64 else pairs
    return c["layers"] * reads * per_expert


def decode_bytes(c: Dict) -> float:
    return pass_bytes(dense_matmuls(c), 1, 15, ours=False) + expert_bytes(c, 1)


# The seed's draft: z-lab/Qwen3.5-9B-DFlash, about 2.6 GB in bf16 (1.3B parameters), at w4 group 64;
# its matmuls are hidden-4096 layers, taken here to re-read like the target's MLP (K, N > 4096).
DRAFT_9B_PARAMS = 1.3e9


def cycle_cost(c: Dict, block: int, generation: int, ours: bool, draft_params: float = DRAFT_9B_PARAMS) -> float:
    """A cycle's weight traffic in decode steps, bandwidth bound: the draft's pass over the block,
    the target's head over its block - 1 proposals, and the target's verify pass of the block."""
    head = Matmul("lm_head", c["hidden"], c["vocab"], 1)
    draft_bytes = draft_params * (0.5 + 4 / 64)
    factor = 1 if ours else stock_reads(block, c["hidden"], c["intermediate"], generation)[1]
    head_reads = 1 if ours else stock_reads(block - 1, head.K, head.N, generation)[1]
    verify = pass_bytes(dense_matmuls(c), block, generation, ours) + expert_bytes(c, block)
    return (draft_bytes * factor + head.bytes * head_reads + verify) / decode_bytes(c)


def tables() -> List[str]:
    lines = []
    for name, c in (("Qwen3.5-9B 4-bit", QWEN35_9B), ("Qwen3.5-35B-A3B 4-bit", QWEN35_35B_A3B)):
        dense = dense_matmuls(c)
        lines += [f"**{name}**: a decode step reads {decode_bytes(c) / GB:.2f} GB"
                  + (f" ({expert_bytes(c, 1) / GB:.2f} GB of it experts)" if "experts" in c else "") + ".", "",
                  "| GPU | M | stock kernels (weight reads) | stock GB | ours GB | "
                  + ("experts GB (in both) | " if "experts" in c else "") + "stock / ours |",
                  "|---|---|---|---|---|" + ("---|" if "experts" in c else "") + "---|"]
        for gpu, gen in GENERATIONS.items():
            for M in (4, 8, 16):
                kinds = sorted({"{} x{}".format(*stock_reads(M, m.K, m.N, gen)) for m in dense})
                kinds = [k + " *" if k.startswith("qmm") else k for k in kinds]
                stock, ours, experts = pass_bytes(dense, M, gen, False), pass_bytes(dense, M, gen, True), expert_bytes(c, M)
                row = f"| {gpu} | {M} | {', '.join(kinds)} | {(stock + experts) / GB:.2f} | {(ours + experts) / GB:.2f} | "
                if "experts" in c:
                    row += f"{experts / GB:.2f} | "
                lines.append(row + f"{(stock + experts) / (ours + experts):.2f}x |")
        lines.append("")
    lines += ["\\* `qmm` reads the weights once per 32 rows but computes all 32: public per-op timings put M = 16 at "
              "3.9-4.5x of M = 1 on large 4-bit shapes (and M = 8 through `qmv_wide` at 2.5-2.8x), so for `qmm` rows "
              "bytes understate the stock cost.", ""]
    c = QWEN35_9B
    lines += ["**A cycle at the seed's settings** (Qwopus3.5-9B 4-bit, w4 draft, block 8), in decode steps of weight "
              "traffic: the draft's pass, the head over 7 proposals, the verify pass.", "",
              "| GPU | stock | ours |", "|---|---|---|"]
    for gpu, gen in GENERATIONS.items():
        lines.append(f"| {gpu} | {cycle_cost(c, 8, gen, False):.2f} | {cycle_cost(c, 8, gen, True):.2f} |")
    return lines


def summary() -> List[str]:
    """One table for the README: GB per verify pass, stock / ours, by model, GPU and M."""
    lines = ["| target, GPU | decode step | M = 4 | M = 8 | M = 16 |", "|---|---|---|---|---|"]
    for name, c in (("9B", QWEN35_9B), ("35B-A3B", QWEN35_35B_A3B)):
        dense = dense_matmuls(c)
        for gpu, gen in GENERATIONS.items():
            cells = []
            for M in (4, 8, 16):
                qmm = any(stock_reads(M, m.K, m.N, gen)[0] == "qmm" for m in dense)
                stock, ours = (pass_bytes(dense, M, gen, o) + expert_bytes(c, M) for o in (False, True))
                cells.append(f"{stock / GB:.1f}{' *' if qmm else ''} / {ours / GB:.1f}")
            lines.append(f"| {name}, {gpu} | {decode_bytes(c) / GB:.2f} | " + " | ".join(cells) + " |")
    return lines


if __name__ == "__main__":
    import sys

    print("\n".join(summary() if "--summary" in sys.argv else tables()))
