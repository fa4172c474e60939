"""What a verify pass costs on an Apple GPU: the bytes its kernels read AND the arithmetic they do,
from the shapes and MLX 0.32's Metal dispatch rules (``mlx/backend/metal/quantized.cpp``:
``get_qmv_batch_limit``, ``qmv_wide``), against each GPU family's memory bandwidth and ALU rate.

Computed, not measured: the weight bytes each kernel requests (the system-level cache can serve
part of a re-read; activations are small beside the weights and left out). Stock, for transposed
affine weights and M rows: M = 1 runs ``qmv``; M at or above the batch limit runs ``qmm`` (32-row
tiles: the weights once per 32 rows, but it computes the padding rows and public per-op timings put
M = 16 at 3.9-4.5x of M = 1, so bytes understate its cost); below the limit M3 and later run
``qmv_wide`` (at most 5 rows per tile, the weights once per tile) and M1/M2 one ``qmv`` per row.
Ours (``metal/quantized_verify.metal``) reads them once for M <= 16. Experts of a mixture of
experts go through ``gather_qmm`` either way (the kernel has no gather form).

The cost model (``pass_seconds``, ``cycle_steps``) adds the arithmetic: each kernel's operations
per weight per row, counted from its source (ours: ``metal/quantized_verify.metal``; stock: MLX
0.32's ``quantized.h``), against the GPU's lane-operations per second, and takes for each kernel
the longer of its bytes and its operations (a roofline per kernel; kernels run one after another).
It includes the attention kernels MLX picks by query count and the Gated DeltaNet recurrence and
rollback, and leaves out dispatch and host overhead, norms and the convolution.

``python -m dflash_mlx.traffic`` prints the tables of ``docs/kernels.md``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

GENERATIONS = {"M1/M2": 13, "M3/M4": 15, "M5": 17}  # Apple GPU generation (laptop and desktop, not Ultra)
GB = 1e9
# The MLX releases whose Metal dispatch the rules below encode (``mlx/backend/metal/quantized.cpp``
# read at v0.32.1 and on main at 0.32.2, a082cb91d: the same ``get_qmv_batch_limit``, ``dispatch_qmv``
# and ``use_qmv_wide``), from the first up to, not including, the second. 0.32.0 had other batch
# limits on generation 15 and later (two of the 19 cases in tests/test_quantized_tile.py differ) and
# 0.30/0.31 have no ``qmv_wide``: pyproject.toml's ``mlx`` range is this one (a test holds them
# together). Outside it ``dispatch_rules_hold`` is False and the tuner never takes stock for a
# row-independent kernel (``quantized.stock_rule``): exact, at worst slower.
MLX_DISPATCH_RANGE = ((0, 32, 1), (0, 33, 0))


def mlx_release(version: str) -> Tuple[int, int, int]:
    """``"0.32.2.dev20260818+abc"`` -> ``(0, 32, 2)``; ``"0.33.0rc1"`` -> ``(0, 33, 0)``."""
    found = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if found is None:
        return (0, 0, 0)
    major, minor, patch = found.groups()
    return int(major), int(minor), int(patch or 0)


def dispatch_rules_hold(version: str) -> bool:
    """Whether this MLX (its ``__version__``) dispatches quantized matmuls by the rules below."""
    low, high = MLX_DISPATCH_RANGE
    return low <= mlx_release(version) < high


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


# Stock kernels that give each row of x its own threadgroups (grid (M, ...)): a row's result does
# not depend on the rows beside it or on M.
ROW_INDEPENDENT_STOCK = ("qmv", "qmv_quad")


def stock_kernel(M: int, K: int, N: int, bits: int, mode: str, generation: int, ultra: bool = False) -> str:
    """The Metal kernel MLX 0.32's ``quantized_matmul`` runs for M rows against transposed 2-D
    weights [N, K] (``QuantizedMatmul::eval_gpu`` and ``dispatch_qmv`` in
    ``mlx/backend/metal/quantized.cpp``): ``qmm`` (split-K or NAX variants included) from the
    batch limit on; below it ``qmv_quad`` where K is 64 or 128 (power-of-two bits); else
    ``qmv_wide`` from 2 rows where it is used (affine on generation 15+, other modes everywhere);
    else ``qmv`` (``qmv_fast`` where the shape aligns: chosen by shape, not by M)."""
    if M >= qmv_batch_limit(K, N, generation, ultra):
        return "qmm"
    if K in (64, 128) and bits & (bits - 1) == 0:
        return "qmv_quad"
    if M >= 2 and (mode != "affine" or generation >= 15):
        return "qmv_wide"
    return "qmv"


def stock_one_kernel(K: int, N: int, bits: int, mode: str, generation: Optional[int], ultra: bool = False,
                     rows: int = 16) -> Optional[str]:
    """The stock kernel when one row-independent kernel runs a shape at every M = 1..``rows``
    (then a verify row is bit for bit its decode step through stock too), else None: where stock
    switches kernels across M (``qmv`` for a decode step, ``qmv_wide`` or ``qmm`` for a block) the
    two sum in different orders. None off Apple GPUs (no generation)."""
    if generation is None:
        return None
    kinds = {stock_kernel(M, K, N, bits, mode, generation, ultra) for M in range(1, rows + 1)}
    kind = kinds.pop() if len(kinds) == 1 else None
    return kind if kind in ROW_INDEPENDENT_STOCK else None


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
    return c.get("expert_layers", c["layers"]) * reads * per_expert


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
    return lines


def summary() -> List[str]:
    """One table for the README, from the cost model: a cycle in decode steps (stock / ours) by
    target, GPU and block, at the seed's settings (4-bit target, w4 draft)."""
    lines = ["| target, GPU | block 4 | block 8 | block 16 |", "|---|---|---|---|"]
    for name, c in (("9B", QWEN35_9B), ("35B-A3B", QWEN35_35B_A3B)):
        draft = draft_matmuls(*DRAFTS[name])
        for gpu_name in TABLE_GPUS:
            gpu = gpu_named(gpu_name)
            cells = [f"{cycle_steps(c, b, gpu, False, draft):.1f} / {cycle_steps(c, b, gpu, True, draft):.1f}" for b in (4, 8, 16)]
            lines.append(f"| {name}, {gpu_name} | " + " | ".join(cells) + " |")
    return lines


# ---- The cost model: bytes and arithmetic ---------------------------------------------------------

@dataclass(frozen=True)
class GPU:
    """One Apple GPU: its generation (MLX's dispatch rules), GPU cores (128 ALU lanes each), clock
    and memory bandwidth, as published or commonly cited (FP32 TFLOPS = 2 x cores x 128 x clock)."""

    name: str
    generation: int
    cores: int
    clock_ghz: float
    bandwidth_gbs: float

    @property
    def ops_per_s(self) -> float:
        """Lane operations per second: one per ALU lane per cycle (an fma counts once). M3 and
        later can issue integer and float operations side by side; not counted."""
        return self.cores * 128 * self.clock_ghz * 1e9

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_gbs * 1e9

    @property
    def ops_per_byte(self) -> float:
        return self.ops_per_s / self.bytes_per_s


GPUS = (
    GPU("M1", 13, 8, 1.278, 68.25),
    GPU("M1 Max", 13, 32, 1.296, 400.0),
    GPU("M3 Pro", 15, 18, 1.398, 150.0),
    GPU("M3 Max", 15, 40, 1.398, 400.0),
    GPU("M4 Pro", 16, 20, 1.578, 273.0),
    GPU("M4 Max", 16, 40, 1.578, 546.0),
)
TABLE_GPUS = ("M1", "M3 Pro", "M4 Max")  # one of each family in the cycle tables

# Lane operations per weight, counted from the sources (docs/kernels.md has the derivation), in
# fma issue slots: shifts, bit extracts (masks) and int->float conversions of the dequantization
# count INT_OP each, a multiply-accumulate through simdgroup matrices MATRIX_FMA, everything else
# (fma, float multiply and add, loads, stores, float conversions) one.
# - INT_OP: a quarter of an fma (the figure for M1/M2, issue 52); on M3 it is what makes the
#   model meet MLX's measured qmv_wide on an M3 Max (mlx#3863, 5120x17408 4-bit: M = 4, 6, 8 within
#   2-6%; counting them as one operation each over-charged qmv_wide by 21-23%).
# - MATRIX_FMA: fitted to qmm on the same M3 Max (0.508 ms at M = 10-16, one 32-row tile; 1.002 ms at
#   M = 33, two): 1.18 slots per multiply-accumulate; counting one under-charged qmm by 9-11%.
# Ours, per row and once per call (the decode); stock qmv per row (it runs whole per row);
# qmv_wide, a dequantization per tile of up to 5 rows and per row a load, convert and fma; qmm, a
# dequantization into threadgroup memory per 32-row tile and 32 matrix multiply-accumulates (the
# padding rows computed); unquantized: gemv per row, gemm per 32-row tile.
INT_OP = 0.25
MATRIX_FMA = 1.18
OURS_PER_ROW = 1.4375
# 4-bit: shift, mask, convert (INT_OP each), fma, and the word, scale and bias per 8 (0.625); 8-bit
# one word more per 8.
OURS_ONCE = {4: 1.625 + 3 * INT_OP, 8: 1.75 + 3 * INT_OP}
# The tile kernel (metal/quantized_verify_tile.metal), per weight of one call: once, the
# dequantization into threadgroup memory (shift, mask, convert at INT_OP; fma, store; word, scale and
# bias per run of 8; 8-bit and mxfp4 one more per 8) and the load of B (64 elements per 64 weights);
# per padded row (8 or 16), A's load (64 per 8 rows and 64 weights), the 8x8x8 multiply-accumulate
# (512 per 8 rows and 64 weights, at MATRIX_FMA), and the staging store of x (one per element, 32
# weights per element); per real row, x's load and convert.
TILE_ONCE = {4: 3.625 + 3 * INT_OP, 8: 3.75 + 3 * INT_OP}
TILE_PER_PADDED_ROW = MATRIX_FMA + 0.125 + 1 / 32
TILE_PER_ROW = 2 / 32
# qmv: per weight a mask and a convert (INT_OP each; MLX pre-scales x instead of shifting), an fma,
# and x's load, scale and sum with the word's load shared by the simdgroup's rows (2.6 in all).
QMV_PER_ROW = 2.6 + 2 * INT_OP
QMV_WIDE_PER_TILE, QMV_WIDE_PER_ROW = 1.0 + 3 * INT_OP, 3.0
QMM_PER_TILE = 2.0 + 3 * INT_OP + 32 * MATRIX_FMA
GEMV_PER_ROW, GEMM_PER_TILE = 1.25, 1.0 + 32 * MATRIX_FMA
# The published measurements the constants above were fitted to: mlx#3863 (katlun-lgtm, 2026-07-22),
# Apple M3 Max (applegpu_g15s), mx.quantized_matmul of 4-bit weights K = 5120, N = 17408, MLX main
# before 0.32.1 (batch limit 10 for this shape: qmv at M = 1, qmv_wide at 2-9, qmm from 10),
# milliseconds per call, min of 15 trials x 30 repeats.
M3_MAX_MEASURED = {"K": 5120, "N": 17408, "batch_limit": 10,
                   "ms": {1: 0.129, 2: 0.129, 4: 0.165, 6: 0.263, 8: 0.323, 9: 0.405, 10: 0.508, 12: 0.508,
                          14: 0.507, 16: 0.509, 32: 0.513, 33: 1.002}}
CONTEXT = 4096  # keys attended to in the tables


def tile_rows(M: int) -> int:
    """The rows the tile kernel computes for M: padded to one or two 8-row tiles."""
    return 8 if M <= 8 else 16


def ops_per_weight(kernel: str, M: int, bits: int = 4, tiles: int = 1) -> float:
    """Lane operations per weight of one ``M``-row call of ``kernel`` (all rows together)."""
    if kernel == "ours":
        return OURS_PER_ROW * M + OURS_ONCE.get(bits, 4.75)
    if kernel == "tile":
        return TILE_ONCE.get(bits, TILE_ONCE[8]) + TILE_PER_PADDED_ROW * tile_rows(M) + TILE_PER_ROW * M
    if kernel == "qmv":
        return QMV_PER_ROW * M
    if kernel == "qmv_wide":
        return QMV_WIDE_PER_TILE * tiles + QMV_WIDE_PER_ROW * M
    if kernel == "qmm":
        return QMM_PER_TILE * tiles
    if kernel == "gemv":
        return GEMV_PER_ROW * M
    if kernel == "gemm":
        return GEMM_PER_TILE * tiles
    raise ValueError(kernel)


def matmul_cost(m: Matmul, M: int, gpu: GPU, ours) -> Tuple[str, float, float]:
    """``(kernel, bytes, operations)`` of ``m``'s calls at ``M`` rows; ``ours``: False (stock),
    True (the per-row kernel) or "tile" (the tile kernel)."""
    weights = m.K * m.N * m.count
    if m.bits >= 16:
        kind, tiles = ("gemv", 1) if M == 1 else ("gemm", math.ceil(M / 32))
        return kind, float(m.bytes * tiles), weights * ops_per_weight(kind, M, tiles=tiles)
    if ours and M <= 16 and m.bits in OURS_ONCE:
        kind = "tile" if ours == "tile" else "ours"
        return kind, float(m.bytes), weights * ops_per_weight(kind, M, m.bits)
    kind, reads = stock_reads(M, m.K, m.N, gpu.generation)
    return kind, float(m.bytes * reads), weights * ops_per_weight(kind, M, m.bits, reads)


def seconds(nbytes: float, ops: float, gpu: GPU) -> float:
    """A kernel's time on ``gpu``: the longer of its memory traffic and its arithmetic."""
    return max(nbytes / gpu.bytes_per_s, ops / gpu.ops_per_s)


def attention_seconds(c: Dict, M: int, gpu: GPU, context: int = CONTEXT) -> float:
    """The full-attention layers at ``M`` queries: MLX's ``sdpa_vector`` for up to 8 queries (and
    queries x GQA factor <= 32) reads the keys and values once per query; the tiled kernel reads
    them once per block of 32 queries and computes whole blocks. Per query, key and head: two
    head_dim-long fma chains and a few softmax operations. ``c["attention"]`` (a loaded target
    of another family: ``config_of``) lists each attention layer's (heads, key heads, head size,
    sliding window or None): a sliding layer reads its window's keys, not the context's."""
    if "attention" not in c:
        return c["layers"] // c["interval"] * _attention_layer_seconds(
            c["heads"], c["kv_heads"], c["head_dim"], M, gpu, context)
    return sum(_attention_layer_seconds(heads, kv_heads, head_dim, M, gpu,
                                        context if window is None else min(context, window + M - 1))
               for heads, kv_heads, head_dim, window in c["attention"])


def _attention_layer_seconds(heads: int, kv_heads: int, head_dim: int, M: int, gpu: GPU, keys: int) -> float:
    kv = keys * kv_heads * head_dim * 2 * 2  # K and V, 16-bit
    vector = M <= 8 and M * (heads // kv_heads) <= 32
    reads, queries = (M, M) if vector else (math.ceil(M / 32), 32 * math.ceil(M / 32))
    ops = queries * keys * heads * (2 * head_dim + 4)
    return seconds(kv * reads, ops, gpu)


def recurrence_seconds(c: Dict, M: int, gpu: GPU, rollback: bool = False) -> float:
    """The Gated DeltaNet layers' recurrence over ``M`` steps (our kernel: the float32 state read
    and written once, the tape written; about 5 operations per state element per step), or a
    rollback's replay (the saved state read, the new one written, 2 operations per element and
    kept step, taken at its worst: every step kept but the last)."""
    layers = c["layers"] - c["layers"] // c["interval"]
    elements = c["v_heads"] * c["v_dim"] * c["k_dim"]
    if rollback:
        return layers * seconds(2 * 4 * elements, 2 * elements * max(M - 1, 0), gpu)
    return layers * seconds(2 * 4 * elements + M * c["v_heads"] * c["v_dim"] * 4, 5 * elements * M, gpu)


def expert_seconds(c: Dict, M: int, gpu: GPU) -> float:
    """Mixture-of-experts experts through ``gather_qmm`` (the same in both columns): the bytes of
    ``expert_bytes`` and ``QMV_PER_ROW`` operations per weight per (token, expert) pair."""
    if "experts" not in c:
        return 0.0
    per_expert = Matmul("expert", c["hidden"], c["expert_width"], 3)
    ops = c.get("expert_layers", c["layers"]) * M * c["top_k"] * per_expert.K * per_expert.N * per_expert.count * QMV_PER_ROW
    return seconds(expert_bytes(c, M), ops, gpu)


def pass_seconds(c: Dict, M: int, gpu: GPU, ours: bool, context: int = CONTEXT,
                 matmuls: Optional[List[Matmul]] = None) -> float:
    """One forward pass of the target over ``M`` tokens (a decode step at M = 1)."""
    matmuls = dense_matmuls(c) if matmuls is None else matmuls
    total = sum(seconds(*matmul_cost(m, M, gpu, ours)[1:], gpu) for m in matmuls)
    return total + attention_seconds(c, M, gpu, context) + recurrence_seconds(c, M, gpu) + expert_seconds(c, M, gpu)


# The drafts, as matmuls of their parameters at w4 (the seed's --draft-quant): z-lab's
# Qwen3.5-9B-DFlash is about 1.3B parameters (2.6 GB in bf16) of hidden-4096 layers; the
# 35B-A3B's draft is taken to be the same kind of stack at hidden 2048, about 0.5B (an assumption).
DRAFTS = {"9B": (DRAFT_9B_PARAMS, 4096, 12288), "35B-A3B": (0.5e9, 2048, 6144)}


def draft_matmuls(params: float, hidden: int, width: int, bits: int = 4) -> List[Matmul]:
    return [Matmul("draft", hidden, width, max(1, round(params / (hidden * width))), bits=bits)]


def cycle_seconds(c: Dict, block: int, gpu: GPU, ours: bool, draft: List[Matmul], context: int = CONTEXT,
                  matmuls: Optional[List[Matmul]] = None) -> float:
    """A cycle of ``block`` tokens: the draft's pass over the block, the target's head over its
    block - 1 proposals, the target's verify pass, a rollback. ``block`` = 1: a decode step."""
    verify = pass_seconds(c, block, gpu, ours, context, matmuls)
    if block == 1:
        return verify
    head = Matmul("lm_head", c["hidden"], c["vocab"], 1)
    drafting = sum(seconds(*matmul_cost(m, block, gpu, ours)[1:], gpu) for m in draft)
    heading = seconds(*matmul_cost(head, block - 1, gpu, ours)[1:], gpu)
    return drafting + heading + verify + recurrence_seconds(c, block, gpu, rollback=True)


def cycle_steps(c: Dict, block: int, gpu: GPU, ours: bool, draft: List[Matmul], context: int = CONTEXT,
                matmuls: Optional[List[Matmul]] = None) -> float:
    """``cycle_seconds`` in decode steps of the target alone with MLX's stock kernels."""
    return cycle_seconds(c, block, gpu, ours, draft, context, matmuls) / pass_seconds(c, 1, gpu, False, context, matmuls)


def gpu_named(name: str) -> GPU:
    return next(g for g in GPUS if g.name == name)


BLOCKS = (2, 3, 4, 6, 8, 12, 16)


def cost_tables() -> List[str]:
    """The cost model's tables for ``docs/kernels.md``: the GPUs, the kernels' operations per
    weight, and the modelled cycle cost in decode steps for both targets, blocks 2-16."""
    lines = ["| GPU | cores | GB/s | lane Gops/s | ops per byte | ops per 4-bit weight (0.5625 B) |",
             "|---|---:|---:|---:|---:|---:|"]
    for g in GPUS:
        lines.append(f"| {g.name} | {g.cores} | {g.bandwidth_gbs:g} | {g.ops_per_s / 1e9:.0f} | {g.ops_per_byte:.1f} | "
                     f"{g.ops_per_byte * 0.5625:.1f} |")
    lines += ["", "Operations per weight of one call, all rows (4-bit; M3/M4 dispatch rules for a large shape):", "",
              "| kernel | M = 1 | 2 | 4 | 8 | 16 |", "|---|---:|---:|---:|---:|---:|"]
    big = Matmul("x", 4096, 12288, 1)
    for label, ours in (("ours (per-row)", True), ("ours (tile)", "tile"), ("stock (qmv / qmv_wide / qmm)", False)):
        cells = []
        for M in (1, 2, 4, 8, 16):
            kind, _, ops = matmul_cost(big, M, gpu_named("M3 Pro"), ours)
            cells.append(f"{ops / (big.K * big.N):.1f}" + ("" if ours else f" {kind}"))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += [""] + tile_table()
    for name, c in (("9B", QWEN35_9B), ("35B-A3B", QWEN35_35B_A3B)):
        draft = draft_matmuls(*DRAFTS[name])
        lines += ["", f"**Qwen3.5-{name} 4-bit, w4 draft, {CONTEXT} tokens of context**: a cycle in decode steps of the "
                  "target alone with stock kernels (draft pass, head over the proposals, verify pass, rollback); "
                  "`decode` is a decode step through our kernel.", "",
                  "| GPU | kernels | decode | " + " | ".join(f"block {b}" for b in BLOCKS) + " |",
                  "|---|---|---:|" + "---:|" * len(BLOCKS)]
        for gpu_name in TABLE_GPUS:
            gpu = gpu_named(gpu_name)
            for ours in (False, True):
                decode = pass_seconds(c, 1, gpu, ours) / pass_seconds(c, 1, gpu, False)
                cells = [f"{cycle_steps(c, b, gpu, ours, draft):.2f}" for b in BLOCKS]
                lines.append(f"| {gpu_name} | {'ours' if ours else 'stock'} | {decode:.2f} | " + " | ".join(cells) + " |")
    return lines


TILE_TABLE_ROWS = (1, 2, 4, 8, 12, 14, 15, 16)


def tile_over_per_row(gpu: GPU, M: int, bits: int = 4) -> float:
    """Modelled time of the tile kernel over the per-row kernel for one M-row call of a large
    matmul (K 4096, N 12288) on ``gpu``: each the longer of its bytes and its operations."""
    big = Matmul("x", 4096, 12288, 1, bits=bits)
    tile, per_row = (seconds(*matmul_cost(big, M, gpu, ours)[1:], gpu) for ours in ("tile", True))
    return tile / per_row


def tile_faster_rows(gpu: GPU, bits: int = 4) -> List[int]:
    """The row counts 1..16 at which the model has the tile kernel faster than the per-row one."""
    return [M for M in range(1, 17) if tile_over_per_row(gpu, M, bits) < 1 - 1e-9]


def tile_table() -> List[str]:
    """Where the tile kernel beats the per-row one: its modelled time over the per-row kernel's
    per call (below 1: the tile is faster), and over a layer's timed row counts (1, 2, 4, 8, 16)
    as the tuner sums them for one choice per layer."""
    lines = ["Tile over per-row kernel, modelled time per call of a large matmul (below 1.00 the tile is faster):", "",
             "| GPU | weights | " + " | ".join(f"M = {m}" if i == 0 else str(m) for i, m in enumerate(TILE_TABLE_ROWS))
             + " | tile faster at | sum over M = 1, 2, 4, 8, 16 |",
             "|---|---|" + "---:|" * len(TILE_TABLE_ROWS) + "---|---:|"]
    for gpu_name in TABLE_GPUS:
        gpu = gpu_named(gpu_name)
        for bits in (4, 8):
            big = Matmul("x", 4096, 12288, 1, bits=bits)
            total = {ours: sum(seconds(*matmul_cost(big, M, gpu, ours)[1:], gpu) for M in (1, 2, 4, 8, 16))
                     for ours in ("tile", True)}
            faster = tile_faster_rows(gpu, bits)
            where = f"M = {faster[0]}-{faster[-1]}" if faster else "never"
            lines.append(f"| {gpu_name} | {bits}-bit | " + " | ".join(f"{tile_over_per_row(gpu, M, bits):.2f}" for M in TILE_TABLE_ROWS)
                         + f" | {where} | {total['tile'] / total[True]:.2f} |")
    return lines


def bound_by(c: Dict, M: int, gpu: GPU, ours: bool) -> float:
    """The share of a pass's modelled time that its arithmetic, not its bytes, decides."""
    total = arithmetic = 0.0
    for m in dense_matmuls(c):
        _, nbytes, ops = matmul_cost(m, M, gpu, ours)
        t = seconds(nbytes, ops, gpu)
        total += t
        arithmetic += t if ops / gpu.ops_per_s > nbytes / gpu.bytes_per_s else 0.0
    return arithmetic / total


# ---- auto's prior on a Mac ----------------------------------------------------------------------

def gpu_of(facts) -> Optional[GPU]:
    """The table's GPU for ``device.facts()`` (by name, else the generation's first), None off
    Apple GPUs."""
    if facts.generation is None:
        return None
    for g in sorted(GPUS, key=lambda g: -len(g.name)):
        if g.name in facts.name:
            return g
    same = [g for g in GPUS if g.generation == facts.generation]
    return same[0] if same else min(GPUS, key=lambda g: abs(g.generation - facts.generation))


def _linear_matmuls(model, tied: bool = False, skip=("switch_mlp",)) -> List[Matmul]:
    """Every (quantized) linear layer of ``model`` as a Matmul, experts left out; ``tied``: its
    embedding too (a tied output head)."""
    import mlx.nn as nn

    out = []
    for path, m in model.named_modules():
        if any(part in path for part in skip):
            continue
        if isinstance(m, nn.QuantizedLinear) or (tied and isinstance(m, nn.QuantizedEmbedding)):
            N, packed = m["weight"].shape
            out.append(Matmul(path, packed * 32 // m.bits, N, 1, bits=m.bits, group_size=m.group_size))
        elif isinstance(m, nn.Linear) or (tied and isinstance(m, nn.Embedding)):
            N, K = m["weight"].shape
            out.append(Matmul(path, K, N, 1, bits=16))
    return out


def config_of(target) -> Dict:
    """The cost model's description of a loaded target: Qwen3.5's from its config; any other
    family's from its own layers (``_layers_config``)."""
    a = target.args
    if not hasattr(a, "full_attention_interval"):
        return _layers_config(target)
    c = dict(hidden=a.hidden_size, layers=a.num_hidden_layers, interval=a.full_attention_interval, heads=a.num_attention_heads,
             kv_heads=a.num_key_value_heads, head_dim=a.head_dim, k_heads=a.linear_num_key_heads,
             v_heads=a.linear_num_value_heads, k_dim=a.linear_key_head_dim, v_dim=a.linear_value_head_dim,
             vocab=a.vocab_size, intermediate=a.intermediate_size)
    if hasattr(a, "num_experts"):
        c.update(experts=a.num_experts, top_k=a.num_experts_per_tok, expert_width=a.moe_intermediate_size,
                 shared_width=a.shared_expert_intermediate_size)
    return c


def _layers_config(target) -> Dict:
    """An attention-only target (Qwen3, Llama, gpt-oss, Gemma 4...) as the cost model reads it,
    from its layers rather than Qwen3.5's shapes: every layer's attention (heads, key heads, head
    size, sliding window: gpt-oss's and Gemma 4's windows read their window, Gemma 4's full layers
    their own head size), no Gated DeltaNet layer, and the routed experts where a layer has a
    mixture of experts (``switch_mlp`` beside its ``top_k``)."""
    a = target.args
    attention, moes = [], []
    for layer in target.layers:
        attn = layer.self_attn
        attention.append((attn.n_heads, attn.n_kv_heads, attn.head_dim, attn.window))
        moes += [m for _, m in layer.named_modules() if hasattr(m, "switch_mlp") and hasattr(m, "top_k")]
    first = attention[0]
    c = dict(hidden=a.hidden_size, layers=len(attention), interval=1, heads=first[0], kv_heads=first[1],
             head_dim=first[2], k_heads=0, v_heads=0, k_dim=0, v_dim=0, vocab=a.vocab_size,
             intermediate=a.intermediate_size, attention=attention)
    if moes:
        gate = moes[0].switch_mlp.gate_proj
        c.update(experts=gate.num_experts, top_k=moes[0].top_k, expert_width=gate.output_dims,
                 expert_layers=len(moes))
    return c


def auto_prior(model, facts=None, cap: int = 16) -> Optional[List[float]]:
    """What ``auto`` assumes cycles of 1..``cap`` tokens cost, in decode steps, before it has
    measured any (on an Apple GPU; None elsewhere): this cost model on the loaded pair (its own
    layers, our kernel where the tuner chose it) and this GPU."""
    from . import device

    facts = facts or device.facts()
    gpu = gpu_of(facts) if facts.metal else None
    if gpu is None or model.target is None or model.draft is None:
        return None
    try:
        c = config_of(model.target)
        matmuls = _linear_matmuls(model.target, tied=model.target.args.tie_word_embeddings)
        draft = _linear_matmuls(model.draft)
    except (AttributeError, KeyError, TypeError, ValueError):
        return None
    # A choice is an implementation's name, or a per-row-count routing (``quantized.Fastest``: ``impls()``).
    kernels = {impl for choice in (model.matmuls.choices.values() if model.matmuls is not None else ())
               for impl in (choice.impls() if hasattr(choice, "impls") else (choice,))} & {"kernel", "tile"}
    ours = "tile" if kernels == {"tile"} else bool(kernels)
    decode = pass_seconds(c, 1, gpu, False, matmuls=matmuls)
    return [cycle_seconds(c, b, gpu, ours, draft, matmuls=matmuls) / decode for b in range(1, cap + 1)]


if __name__ == "__main__":
    import sys

    if "--summary" in sys.argv:
        print("\n".join(summary()))
    elif "--cost" in sys.argv:
        print("\n".join(cost_tables()))
    else:
        print("\n".join(tables() + cost_tables()))
