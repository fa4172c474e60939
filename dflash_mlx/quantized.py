"""Quantized matmuls for verify blocks and draft passes: one read of the weights for all rows.

On an Apple GPU a decode step is bound by reading the weights; a verify pass of M <= 16 tokens
should cost about the same. MLX's stock ``quantized_matmul`` re-reads the weights per row or per
5 rows below its ``qmv`` batch limit and switches to 32-row tiles above it (``docs/kernels.md``
has the numbers), and it switches kernels with M, so a decode step and a verify row sum in
different orders. Three kernels of ours read each weight once per call in an order that does not
depend on M: ``metal/quantized_verify.metal`` keeps one accumulator per row,
``metal/quantized_verify_tile.metal`` dequantizes a tile once and multiplies every row (padded to
8 or 16) through float simdgroup matrices, ``metal/quantized_verify_splash.metal`` does the same in
16-bit simdgroup matrices with the scales applied per group (``splash.py``: its cost model). A row
of a verify pass is bit for bit that token's decode step when both go through the same kernel (the
tiles' under assumption H, ``docs/kernels.md``).

Three pieces: the kernels' launch and their pure-MLX reference (``quantized_verify_reference``);
the choice per shape of one implementation for every row count where that costs at most
``EXACT_BUDGET`` (or ``exact``), else the fastest at each row count (``QuantizedMatmuls``, measured
by ``tune``, cached per device under ``$DFLASH_MLX_HOME``); and the layers that ask it
(``QuantizedLinear``, ``QuantizedEmbedding``: MLX's own, routed). Off Metal nothing is routed and
nothing changes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from . import kernels, traffic
from .paths import home

MAX_ROWS = 16
ROW_BUCKETS = (1, 2, 4, 8, 16)  # the per-row kernel's accumulator counts (template Rows); M rounds up
TILE_ROWS = (8, 16)  # the tile kernel's rows: one or two 8-row simdgroup-matrix tiles, padded with zeros
COLUMNS = 4  # output columns per simdgroup (the per-row kernel's `columns`)
TILE_COLUMNS = 32  # output columns per threadgroup of the tile kernel (8 per simdgroup)
THREADGROUP = (32, 4, 1)  # four simdgroups share each staged slice of x (both kernels)
KERNEL = "quantized_verify"
TILE_KERNEL = "quantized_verify_tile"
SPLASH_KERNEL = "quantized_verify_splash"
SPLASH_ROWS = (8, 16)  # the Splash kernel's rows: one or two 8-row tiles, padded with zeros
# The Splash kernel's simdgroup-matrix element type code per activation dtype (its template `Mat`).
MATRIX_TYPE = {mx.float32: 0, mx.float16: 1, mx.bfloat16: 2}
MODES = {"affine": 0, "mxfp4": 1}
KERNEL_BITS = {"affine": (4, 8), "mxfp4": (4,)}
KERNEL_GROUPS = {"affine": (32, 64, 128), "mxfp4": (32,)}
# The implementations a layer can run (one for every row count 1..16): MLX's stock
# quantized_matmul, the per-row kernel, the simdgroup-matrix tile kernel, the Splash-style kernel.
STOCK, OURS, TILE, SPLASH = "stock", "kernel", "tile", "splash"
KERNEL_OF = {OURS: KERNEL, TILE: TILE_KERNEL, SPLASH: SPLASH_KERNEL}  # in this order on a tie of timings
IMPLEMENTATION_OF = {name: impl for impl, name in KERNEL_OF.items()}
BUCKETS = {OURS: ROW_BUCKETS, TILE: TILE_ROWS, SPLASH: SPLASH_ROWS}


def rows_bucket(rows: int, impl: str = OURS) -> int:
    """The smallest row count of ``impl``'s specializations that holds ``rows`` (1..16)."""
    for bucket in BUCKETS[impl]:
        if rows <= bucket:
            return bucket
    raise ValueError(f"the verify kernel takes at most {MAX_ROWS} rows (got {rows})")


def kernel_supports(bits: int, group_size: int, mode: str) -> bool:
    return bits in KERNEL_BITS.get(mode, ()) and group_size in KERNEL_GROUPS.get(mode, ())


def quantized_verify_launch(x: mx.array, w: mx.array, scales: mx.array, biases: Optional[mx.array],
                            group_size: int, bits: int, mode: str = "affine",
                            rows: Optional[int] = None, impl: str = OURS) -> kernels.Launch:
    """One call for ``x`` [M, K] (M <= 16) against packed ``w`` [N, K*bits/32], through the
    per-row kernel (``impl`` OURS), the tile kernel (TILE) or the Splash kernel (SPLASH). ``rows``
    forces the accumulator count, or the padded rows of a tile (tests: a row's result may not
    depend on it)."""
    M, K = x.shape
    N = w.shape[0]
    if not kernel_supports(bits, group_size, mode):
        raise ValueError(f"the verify kernel has no {mode} {bits}-bit group-{group_size} form")
    if K % group_size or w.shape[1] * 32 // bits != K:
        raise ValueError(f"weights [{N}, {w.shape[1]}] at {bits} bits do not hold K={K} in groups of {group_size}")
    if impl == SPLASH and x.dtype not in MATRIX_TYPE:
        raise ValueError(f"the Splash kernel takes float16, bfloat16 or float32 activations (got {x.dtype})")
    if biases is None:  # mxfp4 has none; one placeholder element keeps a single signature
        biases = mx.zeros((1,), dtype=mx.float32)
    bucket = rows or rows_bucket(M, impl)
    if not M <= bucket <= MAX_ROWS or bucket not in BUCKETS[impl]:
        raise ValueError(f"rows={bucket} cannot hold M={M} in the {impl} (rows {BUCKETS[impl]}, at most {MAX_ROWS})")
    template = (("OutT", x.dtype), ("Rows", bucket), ("bits", bits), ("group_size", group_size), ("Mode", MODES[mode]))
    if impl == SPLASH:  # the simdgroup matrices in the activations' type
        template = template[:1] + (("MatT", x.dtype), ("Mat", MATRIX_TYPE[x.dtype])) + template[1:]
    # per-row: one simdgroup per 4 columns; the tiles: four simdgroups per 32 columns, whole threadgroups
    grid = (32, -(-N // COLUMNS), 1) if impl == OURS else (32, 4 * -(-N // TILE_COLUMNS), 1)
    return kernels.Launch(
        KERNEL_OF[impl], (x, w, scales, biases, M, K, N), template,
        grid=grid, output_shapes=((M, N),), output_dtypes=(x.dtype,), threadgroup=THREADGROUP,
    )


def quantized_verify_reference(x: mx.array, w: mx.array, scales: mx.array, biases: Optional[mx.array],
                               group_size: int, bits: int, mode: str = "affine") -> mx.array:
    """Dequantize in float32 (the kernel's `scale * q + bias` does not round to the scales'
    dtype), then one float32 matmul: what the kernel computes, up to summation order."""
    if mode == "affine":
        scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
    weight = mx.dequantize(w, scales, biases, group_size=group_size, bits=bits, mode=mode).astype(mx.float32)
    return (x.astype(mx.float32) @ weight.T).astype(x.dtype)


def cancelling_layer(rows: int, K: int, N: int, bits: int, group_size: int, mode: str, dtype: mx.Dtype, seed: int = 0,
                     scale_dtype: Optional[mx.Dtype] = None):
    """A random quantized layer (scales in ``scale_dtype``, x's dtype by default) whose second half
    of K repeats its first, and ``rows`` rows of x whose second half negates the first: every exact
    result is 0, so each output is the rounding error of its own summation order (any change of
    that order shows, even in a 16-bit output), while the partial sums stay large. Returns
    ``(x_random, x_cancelling, w, scales, biases)``; where K is not two whole halves of groups the
    second x is random too."""
    kx, kc, kw = mx.random.split(mx.random.key(seed), 3)
    split = K % (2 * group_size) == 0
    half = K // 2 if split else K
    w, scales, *biases = mx.quantize(mx.random.normal((N, half), key=kw).astype(scale_dtype or dtype), group_size, bits,
                                     mode=mode)
    bias = biases[0] if biases else None
    x = mx.random.normal((rows, K), key=kx).astype(dtype)
    if not split:
        return x, mx.random.normal((rows, K), key=kc).astype(dtype), w, scales, bias
    w, scales = mx.concatenate([w, w], axis=1), mx.concatenate([scales, scales], axis=1)
    bias = None if bias is None else mx.concatenate([bias, bias], axis=1)
    u = (mx.random.uniform(-1.0, 1.0, (rows, half), key=kc) * 2048).astype(dtype)
    return x, mx.concatenate([u, -u], axis=1), w, scales, bias


# The small random layer each kernel's self-check starts from (K, N): three steps of K for the
# per-row kernel and the tile; for Splash a full threadgroup of 32 columns and a partial one.
CHECK_LAYER = {OURS: (768, 2 * COLUMNS + 1), TILE: (768, 2 * COLUMNS + 1), SPLASH: (256, 41)}


def _check_quantized(metal: kernels.MetalKernels, launch: kernels.Launch) -> Optional[str]:
    """Every verify kernel's self-check (``form_usable`` runs it through ``MetalKernels.usable`` on
    first use; the launch's name says which kernel). On a small random layer (``CHECK_LAYER``), in
    the call's signature (dtypes and address spaces: the call's own K and N where a small layer puts
    some input in the ``constant`` space): every row within float tolerance of the reference; and
    on cancelling rows (``cancelling_layer``), the last row bit for bit the same row computed alone
    (a one-row call: one accumulator, or the tile padded from one row), which is what keeps verify
    equal to decode. None if it passes, else what differs."""
    impl = IMPLEMENTATION_OF[launch.name]
    template = dict(launch.template)
    dtype, rows, bits, group_size = template["OutT"], template["Rows"], template["bits"], template["group_size"]
    mode = next(m for m, code in MODES.items() if code == template["Mode"])
    scale_dtype = getattr(mx, launch.signature[2][0]) if mode == "affine" else dtype
    seed = rows * 1000 + bits * 10 + group_size
    for K, N in (CHECK_LAYER[impl], (launch.inputs[5], launch.inputs[6])):
        x, cancelling, w, scales, bias = cancelling_layer(rows, K, N, bits, group_size, mode, dtype, seed, scale_dtype)
        call = quantized_verify_launch(x, w, scales, bias, group_size, bits, mode, rows=rows, impl=impl)
        if call.signature == launch.signature:
            break
    else:
        return "its self-check cannot make a call of this signature"
    (y,) = metal.run(call)
    want = quantized_verify_reference(x, w, scales, bias, group_size, bits, mode)
    tolerance = {mx.float32: 1e-4, mx.float16: 4e-3, mx.bfloat16: 3e-2}[dtype]
    if not mx.allclose(y.astype(mx.float32), want.astype(mx.float32), atol=tolerance * math.sqrt(K), rtol=tolerance).item():
        return f"its output differs from the reference (M={rows}, K={K}, N={N})"
    if rows > 1:
        (y,) = metal.run(quantized_verify_launch(cancelling, w, scales, bias, group_size, bits, mode, rows=rows, impl=impl))
        (alone,) = metal.run(quantized_verify_launch(cancelling[-1:], w, scales, bias, group_size, bits, mode, impl=impl))
        if not mx.array_equal(alone[0], y[-1]).item():
            return f"row {rows - 1} of a {rows}-row call differs from the same row computed alone"
    return None


check_splash = _check_quantized  # the Splash kernel's, by the name its tests and docs use


@dataclass(frozen=True)
class MatmulShape:
    """One distinct quantized matmul of a loaded pair (a layer's weights and its activations'
    dtype). An exact choice between the kernels and stock holds for every row count, 1..16: a decode
    step and a verify pass of a layer go through the same implementation (``Timing.choice``)."""

    K: int
    N: int
    bits: int
    group_size: int
    mode: str
    dtype: str  # the activations' ("bfloat16", "float16", "float32")

    def key(self) -> str:
        return f"{self.mode}{self.bits} gs{self.group_size} K{self.K} N{self.N} {self.dtype}"


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).split(".")[-1]  # "bfloat16"


def form_usable(metal: kernels.MetalKernels, dtype: mx.Dtype, w: mx.array, scales: mx.array, biases: Optional[mx.array],
                group_size: int, bits: int, mode: str, impl: str = OURS, fallback: Optional[str] = None) -> bool:
    """Whether ``impl``'s kernel may run this layer (its arrays, activations of ``dtype``) at
    every row count: each of its specializations (the per-row kernel's accumulator counts 1, 2, 4,
    8, 16; the tiles' 8 and 16 rows) passed its self-check (``_check_quantized``) in the signature the
    layer's calls have. One failing takes the kernel from the layer at every row count, so that no
    layer runs a kernel at some row counts and something else at others: the tuner, which asks this
    first, times and offers only the kernels that pass; a routed layer takes its next best
    (``QuantizedMatmuls.plan``; ``fallback``: what the warning says runs instead)."""
    K = w.shape[1] * 32 // bits
    return all(metal.usable(quantized_verify_launch(mx.zeros((rows, K), dtype=dtype), w, scales, biases, group_size, bits,
                                                    mode, impl=impl), _check_quantized, fallback) for rows in BUCKETS[impl])


class _Choices(dict):
    """``QuantizedMatmuls.choices`` (and ``timings``): a dict that tells its owner when it changes, so that the
    decisions made from it (``QuantizedMatmuls.plan``) are made again."""

    def __init__(self, entries, changed: Callable[[], None]):
        super().__init__(entries)
        self._changed = changed

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self._changed()

    def __delitem__(self, key):
        super().__delitem__(key)
        self._changed()

    def __ior__(self, other):
        super().__ior__(other)
        self._changed()
        return self

    def update(self, *args, **kwargs):
        super().update(*args, **kwargs)
        self._changed()

    def setdefault(self, key, default=None):
        value = super().setdefault(key, default)
        self._changed()
        return value

    def pop(self, *args):
        value = super().pop(*args)
        self._changed()
        return value

    def popitem(self):
        item = super().popitem()
        self._changed()
        return item

    def clear(self):
        super().clear()
        self._changed()


class MatmulPlan:
    """What every call of one routed layer with activations of one dtype and shape needs, decided
    once (``QuantizedMatmuls.plan``): the implementation (``impl``: the per-row kernel, the tile, the
    Splash kernel, or None for stock), the kernel's launch less x (``launch``: template, grid, output shape,
    signature and so the kernel object, ``kernels.LaunchPlan``), the biases input where the layer
    has none. It stays valid while its ``QuantizedMatmuls`` keeps the same choices and no
    self-check has failed since: a failure anywhere can make the specialization
    untrusted (``MetalKernels.usable``), so every plan is then decided again on its next call
    (``_Routed._through_kernel`` compares ``owner``, ``version`` and ``failures``).

    The kernels index x and y as ``rows`` rows of K and N elements, so x keeps its leading axes
    ([B, T, K] as the models pass it, row-contiguous as ``metal_kernel`` makes its inputs) and y
    is declared [B, T, N]: no reshape on either side."""

    __slots__ = ("impl", "launch", "K", "N", "rows", "placeholder", "owner", "version", "failures")

    def __init__(self, impl, launch, K, N, rows, placeholder, owner, version, failures):
        self.impl, self.launch, self.K, self.N, self.rows, self.placeholder = impl, launch, K, N, rows, placeholder
        self.owner, self.version, self.failures = owner, version, failures

    def run(self, metal: kernels.MetalKernels, x: mx.array, w, scales, biases) -> mx.array:
        """``x @ dequant(w).T`` through the planned kernel (``impl`` not None): x of the plan's
        dtype and shape, w, scales and biases the arrays the plan was made for or arrays of the same
        shapes and dtypes."""
        inputs = (x, w, scales, self.placeholder if biases is None else biases, self.rows, self.K, self.N)
        return metal.run(self.launch.launch(inputs))[0]


def _instead(choice, shape: MatmulShape, timed: bool) -> str:
    """What a warning says runs instead of a failing kernel on the layers of ``shape``."""
    names = {**KERNEL_OF, STOCK: "MLX's stock quantized_matmul"}
    what = str(choice) if isinstance(choice, Fastest) else f"{names[choice]} at every row count"
    why = "the next best of their timings" if timed else "their choice was set without timings"
    return f"{what} on the layers {shape.key()} ({why})"


class QuantizedMatmuls:
    """Which implementation each quantized layer shape uses in this process: one for every row
    count 1..16 (``kernel``, per-row, or ``tile`` or ``splash`` where the tuner chose it, ``Timing.choice``, or
    ``choices`` say so), or where exactness cost more than ``EXACT_BUDGET`` and not ``exact``, the
    fastest at each row count (``Fastest``); stock everywhere else (shapes and modes the kernels
    have no form for). Where a kernel of a shape's choice fails its self-check in this process
    (a driver or MLX changed since the timings were saved), the layer takes the next best its
    ``timings`` give by the tuner's rule (``Timing.choice_without``), stock last; a choice set
    without timings then runs stock. Calls of more than 16 rows (prefill chunks) run stock
    whatever the choice.

    What a call needs is decided once per layer, activation dtype and input shape (``plan``, kept by
    the routed layer) and decided again only when ``choices`` change or a self-check fails: a routed
    call then costs a dictionary look-up and one kernel call of Python (``examples/
    routed_matmul_cost.py``), not the checks, the launches and the signatures every time.
    """

    def __init__(self, metal: kernels.MetalKernels, choices: Optional[Dict[MatmulShape, str]] = None,
                 exact: bool = False, timings: Optional[Dict[MatmulShape, "Timing"]] = None):
        self.metal = metal
        self.exact = exact  # --exact: the tuner's results decide one implementation per layer for every M
        self.version = 0  # moves with every change of ``choices`` or ``timings``
        self.plans = 0  # how many plans were made (decisions taken): the tests count them
        self.timings = dict(timings or {})  # what the choices were decided from: the next best where one fails
        self.choices = dict(choices or {})

    @property
    def choices(self) -> Dict[MatmulShape, str]:
        return self._choices

    @choices.setter
    def choices(self, choices: Dict[MatmulShape, str]) -> None:
        self._choices = _Choices(choices, self._changed)
        self._changed()

    @property
    def timings(self) -> Dict[MatmulShape, "Timing"]:
        return self._timings

    @timings.setter
    def timings(self, timings: Dict[MatmulShape, "Timing"]) -> None:
        self._timings = _Choices(timings, self._changed)
        self._changed()

    def _changed(self) -> None:
        self.version += 1

    @property
    def traceable(self) -> bool:
        """Whether a layer running these kernels may be compiled (``kernels.CompiledAfterChecks``)."""
        return self.metal.traceable

    def stamp(self) -> tuple:
        """What every plan rests on: the choices and the self-checks' failures."""
        return self.version, self.metal.failures

    @classmethod
    def for_this_process(cls, exact: bool = False) -> Optional["QuantizedMatmuls"]:
        """On an Apple GPU: the process's kernels and the choices cached for this device, decided
        under ``exact``, with their timings (``from_cache``; ``DFLASH_MLX_KERNELS=reference`` turns
        the kernel off); elsewhere None."""
        if os.environ.get(kernels.BACKEND_ENV, "auto") == "reference":
            return None
        if not (mx.default_device() == mx.gpu and mx.metal.is_available()):
            return None
        return cls.from_cache(kernels.process_metal_kernels(), TuningCache.for_this_device(), exact)

    @classmethod
    def from_cache(cls, metal: kernels.MetalKernels, cache: "TuningCache", exact: bool = False) -> "QuantizedMatmuls":
        """``metal`` with the cache's choices decided under ``exact`` and the timings they were
        decided from (so that a choice failing its self-check gives way to the next best)."""
        timings = {t.shape: t for t in cache.timings(exact)}
        return cls(metal, {shape: t.choice for shape, t in timings.items()}, exact, timings)

    def chosen(self, shape: MatmulShape) -> bool:
        """Whether ``shape`` runs a kernel of ours at some row count."""
        choice = self.choices.get(shape)
        return bool(choice.impls() & set(KERNEL_OF)) if isinstance(choice, Fastest) else choice in KERNEL_OF

    def plan(self, dtype: mx.Dtype, shape: tuple, w, scales, biases, group_size: int, bits: int, mode: str,
             always: bool = False) -> MatmulPlan:
        """The decision for calls with ``dtype`` activations of ``shape`` [.., K] against these
        arrays: the implementation the choices give the layer's shape at this row count
        (``always``: a kernel whatever the tuner measured, the per-row one unless another was
        chosen), stock where it has no form; where a kernel that choice runs at some row count has
        not passed its self-checks at every row count (``form_usable``, which runs them on first
        use), the next best (``_usable_choice``); and the kernel's launch."""
        self.plans += 1
        K, N = shape[-1], w.shape[0]
        rows = math.prod(shape[:-1])
        impl = None
        if 1 <= rows <= MAX_ROWS and kernel_supports(bits, group_size, mode):
            def usable(kernel: str, instead: str) -> bool:
                return form_usable(self.metal, dtype, w, scales, biases, group_size, bits, mode, kernel, instead)

            choice = self._usable_choice(MatmulShape(K, N, bits, group_size, mode, dtype_name(dtype)), usable)
            impl = choice.at(rows) if isinstance(choice, Fastest) else choice
            if impl not in KERNEL_OF:
                impl = OURS if always and usable(OURS, "MLX's stock quantized_matmul") else None
        launch, placeholder = None, None
        if impl is not None:
            first = quantized_verify_launch(mx.zeros((rows, K), dtype=dtype), w, scales, biases, group_size, bits, mode,
                                            impl=impl)
            launch = kernels.LaunchPlan(first, output_shapes=((*shape[:-1], N),))
            placeholder = first.inputs[3] if biases is None else None
        # The stamp is read last: a check that failed while deciding is already in it.
        return MatmulPlan(impl, launch, K, N, rows, placeholder, self, self.version, self.metal.failures)

    def _usable_choice(self, shape: MatmulShape, usable: Callable[[str, str], bool]):
        """What layers of ``shape`` run (a name, ``Fastest`` or None): their choice where every
        kernel it runs at some row count passes ``usable(kernel, what runs instead)``; else, where
        the shape has timings, their next best without the failing kernels by the tuner's rule
        under ``exact`` (``Timing.choice_without``: one implementation within the budget or under
        ``exact``, else the fastest per row count; stock last), itself checked in turn. Every row
        count asks about the same kernels, so a decode step and a verify block agree on which
        failed. A choice set without timings runs stock where its kernel fails: nothing measured
        ranks another kernel against stock there."""
        choice = self.choices.get(shape)
        timing = self.timings.get(shape)
        failed: set = set()
        for _ in KERNEL_OF:  # each round takes a failing kernel away: stock after the last
            runs = choice.impls() if isinstance(choice, Fastest) else {choice}
            for kernel in (impl for impl in KERNEL_OF if impl in runs):
                instead = STOCK if timing is None else timing.choice_without(failed | {kernel}, self.exact)
                if not usable(kernel, _instead(instead, shape, timing is not None)):
                    failed.add(kernel)
                    choice = instead
                    break
            else:
                return choice
        return STOCK

    def matmul(self, x: mx.array, w, scales, biases, group_size: int, bits: int, mode: str,
               always: bool = False) -> Optional[mx.array]:
        """``x @ dequant(w).T`` through the layer's kernel, or None where stock should run
        (``always``: a kernel whatever the tuner measured, the per-row one unless another was
        chosen, wherever it has a form and passed its self-checks). Decides afresh at every call:
        the routed layers keep their decisions (``_Routed``)."""
        K = x.shape[-1]
        rows = x.size // K if K else 0
        if not 1 <= rows <= MAX_ROWS:
            return None
        plan = self.plan(x.dtype, x.shape, w, scales, biases, group_size, bits, mode, always)
        return None if plan.launch is None else plan.run(self.metal, x, w, scales, biases)


class _Routed:
    """What the routed layers share: MLX's quantized arrays adopted as they are, and a matmul
    that asks ``matmuls`` before MLX's own, deciding once per activation dtype and input shape
    (``QuantizedMatmuls.plan``; kept in ``_plans``, forgotten when an array of the layer is
    replaced)."""

    def _adopt(self, layer: nn.Module, matmuls: Optional[QuantizedMatmuls]) -> None:
        nn.Module.__init__(self)  # MLX's __init__ would quantize random weights
        self.group_size, self.bits, self.mode = layer.group_size, layer.bits, layer.mode
        object.__setattr__(self, "_plans", {})  # a plain attribute: nn.Module would take a dict for parameters
        dict.update(self, layer.items())  # the same arrays: weight, scales, biases, bias
        self.freeze()
        self.matmuls = matmuls  # not an array, list or dict: a plain attribute, not a parameter

    def __setitem__(self, key, value):  # nn.Module.update, load_weights, set_dtype and setattr come here
        dict.__setitem__(self, key, value)
        self.__dict__.get("_plans", {}).clear()

    def __delitem__(self, key):
        dict.__delitem__(self, key)
        self.__dict__.get("_plans", {}).clear()

    def _through_kernel(self, x: mx.array, always: bool = False) -> Optional[mx.array]:
        # Every routed matmul of a pass comes here: the plan's check and MatmulPlan.run written out
        # inline (a Python call each is a fifth of what is left; examples/routed_matmul_cost.py).
        matmuls = self.matmuls
        if matmuls is None:
            return None
        key = (x.dtype, x.shape, always)
        plan = self._plans.get(key)
        if (plan is None or plan.owner is not matmuls or plan.version != matmuls.version
                or plan.failures != matmuls.metal.failures):
            shape = x.shape
            if not 1 <= math.prod(shape[:-1]) <= MAX_ROWS:  # prefill chunks: stock, nothing to remember
                return None
            plan = self._plans[key] = matmuls.plan(x.dtype, shape, self["weight"], self["scales"], self.get("biases"),
                                                   self.group_size, self.bits, self.mode, always)
        if plan.launch is None:
            return None
        biases = self["biases"] if plan.placeholder is None else plan.placeholder
        inputs = (x, self["weight"], self["scales"], biases, plan.rows, plan.K, plan.N)
        return matmuls.metal.run(kernels.PlannedLaunch(plan.launch, inputs))[0]


def kernel_rows(layer: nn.Module, x: mx.array) -> Optional[mx.array]:
    """``layer(x)`` through the verify kernel whatever the tuner chose, so that each row is computed
    exactly as it would be alone (a router's choice may not depend on the rows beside it); None
    where the layer is not routed to Metal or the kernel cannot take it."""
    if not isinstance(layer, QuantizedLinear):
        return None
    y = layer._through_kernel(x, always=True)
    return y if y is None or "bias" not in layer else y + layer["bias"]


class QuantizedLinear(_Routed, nn.QuantizedLinear):
    """MLX's quantized linear layer (same parameters, same checkpoints) whose matmul asks
    ``matmuls`` first; built from a loaded layer without re-quantizing anything."""

    def __init__(self, layer: nn.QuantizedLinear, matmuls: Optional[QuantizedMatmuls]):
        self._adopt(layer, matmuls)

    def __call__(self, x):
        y = self._through_kernel(x)
        if y is None:
            return super().__call__(x)
        return y + self["bias"] if "bias" in self else y


class QuantizedEmbedding(_Routed, nn.QuantizedEmbedding):
    """MLX's quantized embedding whose ``as_linear`` (a tied output head) asks ``matmuls`` first."""

    def __init__(self, layer: nn.QuantizedEmbedding, matmuls: Optional[QuantizedMatmuls]):
        self._adopt(layer, matmuls)
        self.num_embeddings, self.dims = layer.num_embeddings, layer.dims

    def as_linear(self, x):
        y = self._through_kernel(x)
        return super().as_linear(x) if y is None else y


def route(model: nn.Module, matmuls: Optional[QuantizedMatmuls]) -> int:
    """Make every quantized linear layer (and quantized embedding) of ``model`` ask ``matmuls``;
    returns how many were routed. Already routed layers are re-pointed."""
    routed = []
    for path, module in model.named_modules():
        if isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
            module.matmuls = matmuls
        elif isinstance(module, nn.QuantizedLinear):
            routed.append((path, QuantizedLinear(module, matmuls)))
        elif isinstance(module, nn.QuantizedEmbedding):
            routed.append((path, QuantizedEmbedding(module, matmuls)))
    if routed:
        model.update_modules(tree_unflatten(routed))
    return sum(isinstance(m, (QuantizedLinear, QuantizedEmbedding)) for _, m in model.named_modules())


def route_layers(model: nn.Module, layers, matmuls: Optional[QuantizedMatmuls]) -> None:
    """``route`` the model, and give each of ``layers`` the matmuls whose kernels may now run inside
    it (its ``kernel_matmuls``, else None): such a layer compiles only once its calls' kernels are
    decided (``kernels.CompiledAfterChecks``), and not at all where they cannot be traced."""
    route(model, matmuls)
    for layer in layers:
        layer.kernel_matmuls = matmuls if routes_to_metal(layer) else None


def _shape(layer: nn.Module, dtype: Optional[mx.Dtype] = None) -> MatmulShape:
    N, packed = layer["weight"].shape
    act = dtype or (layer["scales"].dtype if layer.mode == "affine" else mx.bfloat16)
    return MatmulShape(packed * 32 // layer.bits, N, layer.bits, layer.group_size, layer.mode, dtype_name(act))


def routes_to_metal(model: nn.Module) -> bool:
    """Whether some layer of ``model`` may run the Metal kernel: a routed layer whose shape chose it
    (at its scales' dtype or float32, the draft's activations on M1/M2), or a mixture-of-experts
    router, which takes it whatever the tuner chose (``kernel_rows``). Such a layer is compiled
    only after its first call at each shape has decided its kernels (``kernels.CompiledAfterChecks``),
    and not at all where the kernels cannot be traced (the emulator runs them on the host)."""
    for _, m in model.named_modules():
        if isinstance(m, (QuantizedLinear, QuantizedEmbedding)) and m.matmuls is not None:
            if kernel_supports(m.bits, m.group_size, m.mode) and any(
                    m.matmuls.chosen(_shape(m, dtype)) for dtype in (None, mx.float32, mx.float16, mx.bfloat16)):
                return True
        gate = getattr(m, "gate", None)
        if hasattr(m, "router_logits") and isinstance(gate, QuantizedLinear) and gate.matmuls is not None:
            return True
    return False


def layers_of(models: Iterable[nn.Module], dtype: Optional[mx.Dtype] = None) -> Dict[MatmulShape, nn.Module]:
    """Every distinct (K, N, bits, group size, mode) of the models' quantized layers that the kernel
    has a form for, at the activation dtype (their scales' unless given), with the first layer of
    that shape: the tuner times the layer's own weights."""
    seen: Dict[MatmulShape, nn.Module] = {}
    for model in models:
        for _, m in model.named_modules():
            if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) and kernel_supports(m.bits, m.group_size, m.mode):
                seen.setdefault(_shape(m, dtype), m)
    return seen


def shapes_of(models: Iterable[nn.Module], dtype: Optional[mx.Dtype] = None) -> List[MatmulShape]:
    return list(layers_of(models, dtype))


# The row counts the tuner times (the largest of each accumulator count): one decision for 1..16.
TUNED_ROWS = (1, 2, 4, 8, 16)
# Where stock is one row-independent kernel for every row count, a kernel of ours runs a shape only
# if it is this much faster than stock over the timed row counts (timings carry noise).
MARGIN = 0.05


def batch_time(which: str, fn: Callable[[], mx.array], calls: int = 16, repeats: int = 5, warmup: int = 2) -> float:
    """Seconds per call of ``fn`` (``which``: "stock", "kernel", "tile" or "splash"), from batches of ``calls`` calls
    evaluated together: each call's CPU cost (a kernel dispatched from Python) counts, one
    synchronisation's round trip is shared by the batch. The median batch of ``repeats``."""
    for _ in range(warmup):
        mx.eval(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval([fn() for _ in range(calls)])
        times.append((time.perf_counter() - start) / calls)
    return sorted(times)[len(times) // 2]


wall_time = batch_time  # the name callers used


# What exactness may cost a layer: its one implementation for every row count (``Timing.exact_choice``)
# is kept where that lengthens the layer's share of a cycle (its time summed over the timed row
# counts) by at most this much against the fastest implementation at each row count; elsewhere the
# layer takes the fastest at each row count (``Fastest``). Every layer held to the same share, a
# whole cycle costs at most this much more for being exact. ``--exact`` keeps every layer exact.
EXACT_BUDGET = 0.03


@dataclass(frozen=True)
class Fastest:
    """A layer's routing where exactness costs more than ``EXACT_BUDGET``: at each timed row count
    the implementation that measured fastest (``by_rows``: (rows, implementation), ascending; a
    row count between two timed ones takes the next one's). A verify row and its decode step may
    then go through different kernels that sum in different orders: greedy output can differ from
    the target alone where the target's top two logits nearly tie (``bench`` reports those), and a
    batched request (more rows per call) from itself alone. ``--exact`` rules it out."""

    by_rows: tuple

    def at(self, rows: int) -> str:
        for bucket, impl in self.by_rows:
            if rows <= bucket:
                return impl
        return self.by_rows[-1][1]

    def impls(self) -> set:
        return {impl for _, impl in self.by_rows}

    def __str__(self) -> str:
        parts, low = [], 1
        for i, (bucket, impl) in enumerate(self.by_rows):
            if i + 1 < len(self.by_rows) and self.by_rows[i + 1][1] == impl:
                continue
            parts.append(f"{impl} M={low}" + (f"-{bucket}" if bucket > low else ""))
            low = bucket + 1
        return "fastest: " + ", ".join(parts)


@dataclass
class Timing:
    """A shape's measured seconds per call by rows, and what it runs (``choice``): one
    implementation for every row count where exactness costs at most ``EXACT_BUDGET`` of its
    share of a cycle or ``exact`` asks for it, else the fastest at each row count."""

    shape: MatmulShape
    stock_s: Dict[int, float]  # seconds per call, by rows
    kernel_s: Optional[Dict[int, float]]  # the per-row kernel; None: it failed a self-check for this form
    tile_s: Optional[Dict[int, float]] = None  # the tile kernel; None: failed, or not timed
    # The stock kernel where one row-independent stock kernel runs this shape at every M = 1..16 on
    # this GPU (traffic.stock_one_kernel), else None: stock would round a decode step and a verify
    # block differently.
    stock_one: Optional[str] = None
    exact: bool = False  # --exact: one implementation for every row count, whatever it costs
    # The Splash kernel; None: it failed a self-check; empty: not timed (an entry cached before it had
    # a column, or timed on another Splash source), so not offered. Last: positional callers unchanged.
    splash_s: Optional[Dict[int, float]] = field(default_factory=dict)

    def _times(self) -> Dict[str, Dict[int, float]]:
        return {impl: times for impl, times in ((STOCK, self.stock_s), *self._ours()) if times}

    def _ours(self):
        """(implementation, times) of our kernels, in ``KERNEL_OF``'s order (the first wins a tie)."""
        return (OURS, self.kernel_s), (TILE, self.tile_s), (SPLASH, self.splash_s)

    @property
    def exact_choice(self) -> str:
        """The one implementation for every row count: the fastest of our kernels over the timed
        row counts (the per-row one, then the tile, on a tie); stock where no kernel of ours passed
        its self-checks, or where stock is one row-independent kernel at every row count and ours is
        not ``MARGIN`` faster."""
        ours = {impl: sum(times.values()) for impl, times in self._ours() if times}
        if not ours:
            return STOCK
        best = min(ours, key=ours.get)
        if self.stock_one is not None and ours[best] > (1 - MARGIN) * sum(self.stock_s.values()):
            return STOCK
        return best

    @property
    def fastest(self) -> Dict[int, str]:
        """The fastest implementation at each timed row count (the exact choice where it ties)."""
        times, exact = self._times(), self.exact_choice
        out = {}
        for M in sorted(self.stock_s):
            best = min(times, key=lambda impl: times[impl][M])
            out[M] = exact if exact in times and times[exact][M] <= times[best][M] else best
        return out

    @property
    def exactness_cost(self) -> float:
        """How much longer the exact choice takes than the fastest at each row count, over the
        timed row counts, as a share of the latter (0: exactness is free, and where the fastest is
        one exact implementation at every row count: the exact choice then differs from it only
        by ``MARGIN``)."""
        times, fastest = self._times(), self.fastest
        one = set(fastest.values())
        if len(one) == 1 and (one <= set(KERNEL_OF) or (one == {STOCK} and self.stock_one is not None)):
            return 0.0
        exact = sum(times[self.exact_choice][M] for M in fastest) if self.exact_choice in times else math.inf
        best = sum(times[impl][M] for M, impl in fastest.items())
        return exact / best - 1 if best > 0 else 0.0

    @property
    def choice(self):
        """What the layer runs: the exact choice (a name) where ``exact`` asks for it, exactness
        costs at most ``EXACT_BUDGET`` or the fastest is one implementation anyway; else
        ``Fastest``."""
        if self.exact or self.exactness_cost <= EXACT_BUDGET:
            return self.exact_choice
        fastest = self.fastest
        if len(set(fastest.values())) == 1:
            return next(iter(fastest.values()))
        return Fastest(tuple(sorted(fastest.items())))

    def choice_without(self, failed: Iterable[str], exact: Optional[bool] = None):
        """``choice`` as the tuner would have decided it had the ``failed`` kernels failed their
        self-checks while it timed (not offered), under ``exact`` (this timing's own by default):
        the next best, by the same rule, for a layer whose saved choice fails its self-check at
        run time (``QuantizedMatmuls.plan``); stock where every kernel of ours failed."""
        failed = set(failed)
        if not failed <= set(KERNEL_OF):
            raise ValueError(f"failed kernels must be among {sorted(KERNEL_OF)} (got {sorted(failed)})")
        columns = {OURS: "kernel_s", TILE: "tile_s", SPLASH: "splash_s"}
        return replace(self, exact=self.exact if exact is None else exact,
                       **{columns[impl]: None for impl in failed}).choice

    @property
    def is_exact(self) -> bool:
        """Whether ``choice`` gives a verify row its decode step's bits: one kernel of ours, or
        stock where it is one row-independent kernel at every row count."""
        choice = self.choice
        return choice in KERNEL_OF or (choice == STOCK and self.stock_one is not None)

    @classmethod
    def from_entry(cls, entry: dict, exact: bool = False, splash_source: Optional[str] = None) -> "Timing":
        """A cached entry (``TuningCache.record``) back as a Timing. Its Splash column counts only
        where it was timed on ``splash_source`` (the shipped source's hash, ``source_hash``): an
        entry from before the column, or from another Splash source, has none (not offered)."""
        def seconds(times):
            return None if times is None else {int(m): us / 1e6 for m, us in times.items()}

        timed = "splash_us" in entry and entry.get("splash_source") == splash_source
        return cls(MatmulShape(**entry["shape"]), seconds(entry["stock_us"]), seconds(entry["kernel_us"]),
                   seconds(entry.get("tile_us")), entry.get("stock_one_kernel"), exact,
                   seconds(entry["splash_us"]) if timed else {})


def _arrays(layer: nn.Module):
    return layer["weight"], layer["scales"], layer.get("biases")


def stock_rule(facts=None, mlx_version: Optional[str] = None) -> Callable[[MatmulShape], Optional[str]]:
    """``traffic.stock_one_kernel`` for a GPU (``device.facts()``, this one by default: its
    generation; an Ultra's architecture ends in ``d``), shape by shape; off Apple GPUs every shape
    gets None, and so under an MLX (``mlx_version``, this one's by default) whose dispatch the
    rules were not read from (``traffic.dispatch_rules_hold``): stock is then never taken for one
    row-independent kernel."""
    from . import device

    if not traffic.dispatch_rules_hold(mlx_version or mx.__version__):
        return lambda s: None
    facts = facts or device.facts()
    ultra = facts.architecture.endswith("d")
    return lambda s: traffic.stock_one_kernel(s.K, s.N, s.bits, s.mode, facts.generation, ultra)


def tune(metal: kernels.MetalKernels, layers, measure: Callable[[str, Callable[[], mx.array]], float] = batch_time,
         progress: Optional[Callable[[int, int], None]] = None, rows: Iterable[int] = TUNED_ROWS,
         stock_one: Optional[Callable[[MatmulShape], Optional[str]]] = None, exact: bool = False) -> List[Timing]:
    """Times stock ``mx.quantized_matmul``, the per-row kernel, the tile kernel and the Splash
    kernel (each only where its self-checks pass, ``form_usable``: a kernel that fails one is not
    timed, so the layer takes the next) for each shape at each of ``rows``, on the layer's own
    weights (``layers``: shape -> layer, as ``layers_of`` gives; x is random), and decides per shape
    (``Timing.choice``: one implementation for every row count where exactness costs at most
    ``EXACT_BUDGET`` or ``exact``, else the fastest at each; ``stock_one`` says where stock is one
    row-independent kernel, this GPU's rule by default)."""
    layers = dict(layers)
    rows = list(rows)
    stock_one = stock_one or stock_rule()
    timings = []
    for i, (shape, layer) in enumerate(layers.items()):
        w, scales, biases = _arrays(layer)
        dtype = getattr(mx, shape.dtype)
        times: Dict[str, Optional[Dict[int, float]]] = {STOCK: {}}
        for impl in KERNEL_OF:
            usable = form_usable(metal, dtype, w, scales, biases, shape.group_size, shape.bits, shape.mode, impl)
            times[impl] = {} if usable else None
        for M in rows:
            x = mx.random.normal((M, shape.K), key=mx.random.key(M)).astype(dtype)
            times[STOCK][M] = measure(STOCK, lambda: mx.quantized_matmul(
                x, w, scales, biases, transpose=True, group_size=shape.group_size, bits=shape.bits, mode=shape.mode))
            for impl in KERNEL_OF:
                if times[impl] is not None:
                    launch = quantized_verify_launch(x, w, scales, biases, shape.group_size, shape.bits, shape.mode, impl=impl)
                    times[impl][M] = measure(impl, lambda: metal.run(launch)[0])
        timings.append(Timing(shape, times[STOCK], times[OURS], times[TILE], stock_one(shape), exact, times[SPLASH]))
        if progress is not None:
            progress(i + 1, len(layers))
    return timings


def source_hash(name: str) -> str:
    """A kernel's shipped source, as the tuning cache keys timings by it."""
    return hashlib.sha256(kernels.kernel_source(name).encode()).hexdigest()[:12]


def device_id() -> str:
    """What a timing is valid for: the GPU, MLX's version and the per-row and tile kernels' sources.
    The Splash kernel's source is keyed per entry instead (``TuningCache``), so that timings saved
    before it was timed still load."""
    from . import device

    facts = device.facts()
    sources = " | ".join(f"{name} {source_hash(name)}" for name in (KERNEL, TILE_KERNEL))
    return f"{facts.name} | {facts.architecture} | mlx {mx.__version__} | {sources}"


def per_rows_us(times: Optional[Dict[int, float]]) -> Optional[Dict[str, float]]:
    return None if times is None else {str(m): t * 1e6 for m, t in times.items()}


class TuningCache:
    """Measured choices per device, in ``$DFLASH_MLX_HOME/tuning.json`` (written whole, atomically).
    An entry's Splash column carries the hash of the Splash source it was timed on
    (``splash_source``): entries saved before the column load as they were, deciding among stock,
    the per-row kernel and the tile (``doctor --tune`` times them again with it); an entry timed on
    another Splash source is timed again (``missing``)."""

    def __init__(self, path: Path, device: str):
        self.path, self.device = path, device
        self.splash_source = source_hash(SPLASH_KERNEL)
        self.entries: Dict[str, dict] = {}
        try:
            self.entries = json.loads(path.read_text()).get(device, {})
        except (OSError, ValueError, AttributeError):
            self.entries = {}

    @classmethod
    def for_this_device(cls) -> "TuningCache":
        return cls(home() / "tuning.json", device_id())

    def missing(self, shapes: Iterable[MatmulShape]) -> List[MatmulShape]:
        choices = self.choices()
        stale = {key for key, e in self.entries.items()
                 if isinstance(e, dict) and "splash_source" in e and e["splash_source"] != self.splash_source}
        return [s for s in shapes if s not in choices or s.key() in stale]

    def record(self, timings: Iterable[Timing]) -> None:
        for t in timings:
            self.entries[t.shape.key()] = {"shape": t.shape.__dict__, "stock_us": per_rows_us(t.stock_s),
                                           "kernel_us": per_rows_us(t.kernel_s), "tile_us": per_rows_us(t.tile_s),
                                           "stock_one_kernel": t.stock_one, "exact_choice": t.exact_choice,
                                           "exactness_cost": t.exactness_cost, "choice": str(t.choice)}
            if t.splash_s != {}:  # timed (or failed its self-check) here, on the shipped Splash source
                self.entries[t.shape.key()].update(splash_us=per_rows_us(t.splash_s), splash_source=self.splash_source)
        try:
            everything = json.loads(self.path.read_text())
        except (OSError, ValueError):
            everything = {}
        everything[self.device] = self.entries
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_suffix(".json.partial")
        partial.write_text(json.dumps(everything, indent=1, sort_keys=True))
        partial.replace(self.path)

    def timings(self, exact: bool = False) -> List[Timing]:
        """The cached measurements (entries in this format only: an older file's per-row entries
        are timed again), each deciding under ``exact``."""
        out = []
        for entry in self.entries.values():
            try:
                out.append(Timing.from_entry(entry, exact, self.splash_source))
            except (KeyError, TypeError, AttributeError, ValueError):
                continue
        return out

    def choices(self, exact: bool = False) -> Dict[MatmulShape, object]:
        """What each cached shape runs (``Timing.choice``), decided again from its timings: under
        ``exact``, or with exactness as a budget."""
        return {t.shape: t.choice for t in self.timings(exact)}


def tune_pair(matmuls: QuantizedMatmuls, models: Iterable[nn.Module], cache: TuningCache, everything: bool = False,
              measure=batch_time, progress=None, stock_one=None) -> List[Timing]:
    """Times the pair's shapes the cache lacks (all of them with ``everything``), records them,
    makes ``matmuls`` use the results (the choices under its ``exact``, and the timings beside them
    for a choice that fails its self-check later), and routes the models again so that
    only the layers whose kernel won run it. Returns the new timings."""
    models = list(models)
    layers = layers_of(models)
    todo = layers if everything else {s: layers[s] for s in cache.missing(layers)}
    timings = tune(matmuls.metal, todo, measure, progress, stock_one=stock_one, exact=matmuls.exact) if todo else []
    if timings:
        cache.record(timings)
    saved = {t.shape: t for t in cache.timings(matmuls.exact)}
    matmuls.timings.update(saved)  # beside the choices: a choice failing its self-check gives way to the next best
    matmuls.choices.update({shape: t.choice for shape, t in saved.items()})
    for model in models:
        if hasattr(model, "use_quantized_matmuls"):
            model.use_quantized_matmuls(matmuls)
        else:
            route(model, matmuls)
    return timings


def shape_counts(models: Iterable[nn.Module], dtype: Optional[mx.Dtype] = None) -> Dict[MatmulShape, int]:
    """How many quantized layers of the models have each shape of ``layers_of``."""
    counts: Dict[MatmulShape, int] = {}
    for model in models:
        for _, m in model.named_modules():
            if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) and kernel_supports(m.bits, m.group_size, m.mode):
                shape = _shape(m, dtype)
                counts[shape] = counts.get(shape, 0) + 1
    return counts


def exactness_cost(timings: Iterable[Timing], counts: Optional[Dict[MatmulShape, int]] = None) -> float:
    """What one implementation per layer for every row count costs the pair's quantized matmuls
    against the fastest at each row count, as a share of the latter: every timed row count
    summed, each shape weighted by its layer count (``counts``; one each by default)."""
    exact = fastest = 0.0
    for t in timings:
        n = (counts or {}).get(t.shape, 1)
        base = sum(t._times()[impl][M] for M, impl in t.fastest.items())
        fastest += n * base
        exact += n * base * (1 + t.exactness_cost)
    return exact / fastest - 1 if fastest > 0 else 0.0


def render_timings(timings: Iterable[Timing], counts: Optional[Dict[MatmulShape, int]] = None) -> List[str]:
    """The tuner's table: one line per shape (with its layer count where ``counts`` gives it),
    stock / per-row kernel / tile / Splash microseconds per call at each timed row count ("failed":
    its self-check failed; "-": not timed), whether stock is one row-independent kernel here, what
    exactness costs (``Timing.exactness_cost``) and what the layers run (``Timing.choice``; "exact":
    the same bits at every row count)."""
    timings = list(timings)
    rows = sorted({m for t in timings for m in t.stock_s})
    lines = [f"{'shape':<36} {'layers':>6} " + " ".join(f"{f'M={m} stock/kernel/tile/splash':>34}" for m in rows)
             + "  stock one kernel  exact costs  runs"]
    for t in timings:
        cells = []
        for m in rows:
            ours = ("failed" if times is None else f"{times[m] * 1e6:.1f}" if times else "-" for _, times in t._ours())
            cells.append("/".join((f"{t.stock_s[m] * 1e6:.1f}", *ours)).rjust(34))
        layers = str((counts or {}).get(t.shape, "")) if counts else "-"
        runs = f"{t.choice} ({'exact' if t.is_exact else 'not exact'})"
        lines.append(f"{t.shape.key():<36} {layers:>6} " + " ".join(cells)
                     + f"  {str(t.stock_one or 'no'):>16}  {t.exactness_cost:>10.1%}  {runs}")
    return lines
