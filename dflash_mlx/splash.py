"""The Splash-style verify kernel (``metal/quantized_verify_splash.metal``): weight codes decoded by
bit construction straight into the activations' 16-bit type, simdgroup matrices of that type
accumulating in float32, each group's scale and bias applied once per group from row sums.

Routed as ``quantized.SPLASH``: its launch and self-check live in ``quantized`` (which runs every
verify kernel: ``splash_launch`` and ``check_splash`` here are those), the tuner times it beside
the per-row kernel, the float tile and stock, and a layer runs it only where it measured fastest
and passed its self-check. Here: its cost in ``traffic``'s model (docs/kernels.md, "The
Splash-style kernel"), which says it is faster only if 16-bit simdgroup matrices run faster than
float ones, something only a Mac's timings can say.
"""

from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx

from . import kernels, quantized, traffic

SPLASH_KERNEL = quantized.SPLASH_KERNEL
SPLASH_ROWS = quantized.SPLASH_ROWS  # one or two 8-row simdgroup-matrix tiles, padded with zeros
SPLASH_COLUMNS = quantized.TILE_COLUMNS  # output columns per threadgroup (8 per simdgroup), as the float tile's
MATRIX_TYPE = quantized.MATRIX_TYPE  # the simdgroup matrices' element type code per activation dtype (`Mat`)
check_splash = quantized.check_splash  # its self-check, as form_usable runs it


def splash_launch(x: mx.array, w: mx.array, scales: mx.array, biases: Optional[mx.array], group_size: int, bits: int,
                  mode: str = "affine", rows: Optional[int] = None) -> kernels.Launch:
    """One call for ``x`` [M, K] (M <= 16) against packed ``w`` [N, K*bits/32]; the forms of
    ``quantized.kernel_supports``. ``rows`` forces the padded rows (8 or 16; tests: a row's result
    may not depend on it). ``quantized_verify_launch`` with ``impl=SPLASH``."""
    return quantized.quantized_verify_launch(x, w, scales, biases, group_size, bits, mode, rows, impl=quantized.SPLASH)


# ---- Its cost in traffic's model (a cost entry traffic.py does not have; traffic's own constants) ----
# Lane operations per weight in fma slots, counted from the source as traffic.py counts the others.
# Once per call: the word's load (1/8 per 4-bit weight, 2/8 at 8 bits), shift, mask and the OR that
# builds the code (INT_OP each; no conversion, no subtraction: the offset goes out with the bias),
# the store into the weight tile, B's load (64 per 64 weights); per group and column the scale's and
# bias's loads and the offset fma (3 per group). Per padded row (8 or 16): the multiply-accumulate
# (MATRIX_FMA), A's load (64 per 8 rows and 64 weights), the staging store of x (1/32), the row sum
# (a load and an add per element, 32 columns share it: 2/32), the group apply (G's store and load,
# the scale, bias and row sum loads, two fma: 7 per group). Per real row, x's load and convert (2/32).
# 16-bit activations; float32 activations and 8-bit codes into a bfloat tile add a subtraction and a
# conversion per weight (not in these figures).
SPLASH_ONCE = {4: 1 / 8 + 3 * traffic.INT_OP + 2.0, 8: 2 / 8 + 3 * traffic.INT_OP + 2.0}


def ops_per_weight(M: int, bits: int = 4, group_size: int = 64, matrix_fma: float = traffic.MATRIX_FMA) -> float:
    """Lane operations (fma slots) per weight of one ``M``-row call, all rows together."""
    padded = traffic.tile_rows(M)
    per_padded_row = matrix_fma + 0.125 + 1 / 32 + 2 / 32 + 7 / group_size
    return SPLASH_ONCE.get(bits, SPLASH_ONCE[8]) + 3 / group_size + per_padded_row * padded + 2 / 32 * M


def cycle_steps(block: int, gpu: "traffic.GPU", ops: Callable[[int, int], float] = ops_per_weight,
                model: Optional[dict] = None, draft: Optional[list] = None) -> float:
    """``traffic.cycle_steps`` of the 9B (by default) with ``ops(M, bits)`` operations per weight for
    every quantized matmul of at most 16 rows that the kernels have a form for (the verify pass, the
    draft's pass, the head over the proposals); the rest (stock above 16 rows, unquantized layers,
    attention, the recurrence, the rollback) from traffic's own functions."""
    c = model or traffic.QWEN35_9B
    draft = traffic.draft_matmuls(*traffic.DRAFTS["9B"]) if draft is None else draft

    def matmul(m, M):
        if m.bits >= 16 or m.bits not in traffic.OURS_ONCE or M > 16:
            return traffic.seconds(*traffic.matmul_cost(m, M, gpu, False)[1:], gpu)
        return traffic.seconds(float(m.bytes), m.K * m.N * m.count * ops(M, m.bits), gpu)

    def forward(M):
        return (sum(matmul(m, M) for m in traffic.dense_matmuls(c)) + traffic.attention_seconds(c, M, gpu)
                + traffic.recurrence_seconds(c, M, gpu) + traffic.expert_seconds(c, M, gpu))

    total = forward(block)
    if block > 1:
        head = traffic.Matmul("lm_head", c["hidden"], c["vocab"], 1)
        total += (sum(matmul(m, block) for m in draft) + matmul(head, block - 1)
                  + traffic.recurrence_seconds(c, block, gpu, rollback=True))
    return total / traffic.pass_seconds(c, 1, gpu, False)


def cycle_table() -> list:
    """The 9B's modelled cycle in decode steps of stock (``traffic.BLOCKS``) by GPU: the per-row
    kernel (traffic's own), the float tile and the Splash kernel, and the Splash kernel with its
    matrix multiply-accumulates at half the float rate (what a 2x half/bfloat16 matrix rate would
    give: not in the model, not measured)."""
    draft = traffic.draft_matmuls(*traffic.DRAFTS["9B"])
    rows = [("per-row (traffic)", None), ("float tile", lambda M, bits: traffic.ops_per_weight("tile", M, bits)),
            ("Splash", ops_per_weight),
            ("Splash, matrix at 2x", lambda M, bits: ops_per_weight(M, bits, matrix_fma=traffic.MATRIX_FMA / 2))]
    lines = ["| GPU | kernel | " + " | ".join(f"block {b}" for b in traffic.BLOCKS) + " |",
             "|---|---|" + "---:|" * len(traffic.BLOCKS)]
    for name in traffic.TABLE_GPUS:
        gpu = traffic.gpu_named(name)
        for label, ops in rows:
            cells = [traffic.cycle_steps(traffic.QWEN35_9B, b, gpu, True, draft) if ops is None else cycle_steps(b, gpu, ops)
                     for b in traffic.BLOCKS]
            lines.append(f"| {name} | {label} | " + " | ".join(f"{v:.2f}" for v in cells) + " |")
    return lines


if __name__ == "__main__":
    print("\n".join(cycle_table()))
