"""Quantized matmuls for verify blocks and draft passes: one read of the weights for all rows.

On an Apple GPU a decode step is bound by reading the weights; a verify pass of M <= 16 tokens
should cost about the same. MLX's stock ``quantized_matmul`` re-reads the weights per row or per
5 rows below its ``qmv`` batch limit and switches to 32-row tiles above it (``docs/kernels.md``
has the numbers). ``metal/quantized_verify.metal`` reads each weight once per call and keeps one
accumulator per row, in an order that does not depend on M: a row of a verify pass is bit for bit
that token's decode step when both go through the kernel.

Three pieces: the kernel's launch and its pure-MLX reference (``quantized_verify_reference``); the
choice per shape between the kernel and stock (``QuantizedMatmuls``, measured by ``tune``, cached
per device under ``$DFLASH_MLX_HOME``); and the layers that ask it (``QuantizedLinear``,
``QuantizedEmbedding``: MLX's own, routed). Off Metal nothing is routed and nothing changes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from . import kernels

MAX_ROWS = 16
ROW_BUCKETS = (1, 2, 4, 8, 16)  # the kernel's accumulator counts (template Rows); M rounds up
COLUMNS = 4  # output columns per simdgroup (the kernel's `columns`)
THREADGROUP = (32, 4, 1)  # four simdgroups (16 columns) share each staged slice of x
KERNEL = "quantized_verify"
MODES = {"affine": 0, "mxfp4": 1}
KERNEL_BITS = {"affine": (4, 8), "mxfp4": (4,)}
KERNEL_GROUPS = {"affine": (32, 64, 128), "mxfp4": (32,)}
STOCK, OURS = "stock", "kernel"


def rows_bucket(rows: int) -> int:
    """The smallest accumulator count that holds ``rows`` (1..16)."""
    for bucket in ROW_BUCKETS:
        if rows <= bucket:
            return bucket
    raise ValueError(f"the verify kernel takes at most {MAX_ROWS} rows (got {rows})")


def kernel_supports(bits: int, group_size: int, mode: str) -> bool:
    return bits in KERNEL_BITS.get(mode, ()) and group_size in KERNEL_GROUPS.get(mode, ())


def quantized_verify_launch(x: mx.array, w: mx.array, scales: mx.array, biases: Optional[mx.array],
                            group_size: int, bits: int, mode: str = "affine",
                            rows: Optional[int] = None) -> kernels.Launch:
    """One call for ``x`` [M, K] (M <= 16) against packed ``w`` [N, K*bits/32]. ``rows`` forces
    the accumulator count (tests: a row's result may not depend on it)."""
    M, K = x.shape
    N = w.shape[0]
    if not kernel_supports(bits, group_size, mode):
        raise ValueError(f"the verify kernel has no {mode} {bits}-bit group-{group_size} form")
    if K % group_size or w.shape[1] * 32 // bits != K:
        raise ValueError(f"weights [{N}, {w.shape[1]}] at {bits} bits do not hold K={K} in groups of {group_size}")
    if biases is None:  # mxfp4 has none; one placeholder element keeps a single signature
        biases = mx.zeros((1,), dtype=mx.float32)
    bucket = rows or rows_bucket(M)
    if not M <= bucket <= MAX_ROWS:
        raise ValueError(f"rows={bucket} cannot hold M={M} (at most {MAX_ROWS})")
    template = (("OutT", x.dtype), ("Rows", bucket), ("bits", bits), ("group_size", group_size), ("Mode", MODES[mode]))
    return kernels.Launch(
        KERNEL, (x, w, scales, biases, M, K, N), template,
        grid=(32, -(-N // COLUMNS), 1), output_shapes=((M, N),), output_dtypes=(x.dtype,), threadgroup=THREADGROUP,
    )


def quantized_verify_reference(x: mx.array, w: mx.array, scales: mx.array, biases: Optional[mx.array],
                               group_size: int, bits: int, mode: str = "affine") -> mx.array:
    """Dequantize, then one float32 matmul: what the kernel computes, up to summation order."""
    weight = mx.dequantize(w, scales, biases, group_size=group_size, bits=bits, mode=mode).astype(mx.float32)
    return (x.astype(mx.float32) @ weight.T).astype(x.dtype)


def cancelling_layer(rows: int, K: int, N: int, bits: int, group_size: int, mode: str, dtype: mx.Dtype, seed: int = 0):
    """A random quantized layer whose second half of K repeats its first, and ``rows`` rows of x
    whose second half negates the first: every exact result is 0, so each output is the rounding
    error of its own summation order (any change of that order shows, even in a 16-bit output),
    while the partial sums stay large. Returns ``(x_random, x_cancelling, w, scales, biases)``."""
    kx, kc, kw = mx.random.split(mx.random.key(seed), 3)
    half = K // 2
    w, scales, *biases = mx.quantize(mx.random.normal((N, half), key=kw).astype(dtype), group_size, bits, mode=mode)
    w, scales = mx.concatenate([w, w], axis=1), mx.concatenate([scales, scales], axis=1)
    bias = mx.concatenate([biases[0], biases[0]], axis=1) if biases else None
    x = mx.random.normal((rows, K), key=kx).astype(dtype)
    u = (mx.random.uniform(-1.0, 1.0, (rows, half), key=kc) * 2048).astype(dtype)
    return x, mx.concatenate([u, -u], axis=1), w, scales, bias


def _check_quantized(metal: kernels.MetalKernels, name: str, template: dict) -> Optional[str]:
    """On a small random layer (three steps of K): every row within float tolerance of the
    reference; and on cancelling rows (``cancelling_layer``), the last row bit for bit the same
    row computed alone (a one-row call), which is what keeps verify equal to decode."""
    dtype, rows, bits, group_size = template["OutT"], template["Rows"], template["bits"], template["group_size"]
    mode = next(m for m, code in MODES.items() if code == template["Mode"])
    K, N = 768, 2 * COLUMNS + 1
    x, cancelling, w, scales, bias = cancelling_layer(rows, K, N, bits, group_size, mode, dtype,
                                                      seed=rows * 1000 + bits * 10 + group_size)
    (y,) = metal.run(quantized_verify_launch(x, w, scales, bias, group_size, bits, mode, rows=rows))
    want = quantized_verify_reference(x, w, scales, bias, group_size, bits, mode)
    tolerance = {mx.float32: 1e-4, mx.float16: 4e-3, mx.bfloat16: 3e-2}[dtype]
    if not mx.allclose(y.astype(mx.float32), want.astype(mx.float32), atol=tolerance * math.sqrt(K), rtol=tolerance).item():
        return f"its output differs from the reference (M={rows}, K={K}, N={N})"
    if rows > 1:
        (y,) = metal.run(quantized_verify_launch(cancelling, w, scales, bias, group_size, bits, mode, rows=rows))
        (alone,) = metal.run(quantized_verify_launch(cancelling[-1:], w, scales, bias, group_size, bits, mode, rows=1))
        if not mx.array_equal(alone[0], y[-1]).item():
            return f"row {rows - 1} of a {rows}-row call differs from the same row computed alone"
    return None


@dataclass(frozen=True)
class MatmulShape:
    """One distinct matmul of a loaded pair, as the tuner times it."""

    K: int
    N: int
    bits: int
    group_size: int
    mode: str
    rows: int
    dtype: str  # the activations' ("bfloat16", "float16", "float32")

    def key(self) -> str:
        return f"{self.mode}{self.bits} gs{self.group_size} K{self.K} N{self.N} M{self.rows} {self.dtype}"


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).split(".")[-1]  # "bfloat16"


class QuantizedMatmuls:
    """Which implementation each quantized matmul shape uses in this process: ``kernel`` where the
    tuner measured ours faster than stock (or ``choices`` say so), stock everywhere else (any M
    above 16, shapes and modes the kernel has no form for, kernels that failed their self-check).
    """

    def __init__(self, metal: kernels.MetalKernels, choices: Optional[Dict[MatmulShape, str]] = None):
        self.metal = metal
        self.choices: Dict[MatmulShape, str] = dict(choices or {})

    @classmethod
    def for_this_process(cls) -> Optional["QuantizedMatmuls"]:
        """On an Apple GPU: the process's kernels and the choices cached for this device
        (``DFLASH_MLX_KERNELS=reference`` turns the kernel off); elsewhere None."""
        if os.environ.get(kernels.BACKEND_ENV, "auto") == "reference":
            return None
        if not (mx.default_device() == mx.gpu and mx.metal.is_available()):
            return None
        return cls(kernels.process_metal_kernels(), TuningCache.for_this_device().choices())

    def matmul(self, x: mx.array, w, scales, biases, group_size: int, bits: int, mode: str,
               always: bool = False) -> Optional[mx.array]:
        """``x @ dequant(w).T`` through the kernel, or None where stock should run (``always``:
        the kernel whatever the tuner measured, wherever it has a form and passed its self-check)."""
        K = x.shape[-1]
        rows = x.size // K if K else 0
        if not 1 <= rows <= MAX_ROWS or not kernel_supports(bits, group_size, mode):
            return None
        shape = MatmulShape(K, w.shape[0], bits, group_size, mode, rows, dtype_name(x.dtype))
        if not always and self.choices.get(shape) != OURS:
            return None
        launch = quantized_verify_launch(x.reshape(rows, K), w, scales, biases, group_size, bits, mode)
        if not self.metal.usable(KERNEL, launch.template, _check_quantized):
            return None
        return self.metal.run(launch)[0].reshape(*x.shape[:-1], w.shape[0])


class _Routed:
    """What the routed layers share: MLX's quantized arrays adopted as they are, and a matmul
    that asks ``matmuls`` before MLX's own."""

    def _adopt(self, layer: nn.Module, matmuls: Optional[QuantizedMatmuls]) -> None:
        nn.Module.__init__(self)  # MLX's __init__ would quantize random weights
        self.group_size, self.bits, self.mode = layer.group_size, layer.bits, layer.mode
        dict.update(self, layer.items())  # the same arrays: weight, scales, biases, bias
        self.freeze()
        object.__setattr__(self, "matmuls", matmuls)  # a plain attribute, not a parameter

    def _through_kernel(self, x: mx.array, always: bool = False) -> Optional[mx.array]:
        if self.matmuls is None:
            return None
        return self.matmuls.matmul(x, self["weight"], self["scales"], self.get("biases"), self.group_size, self.bits,
                                   self.mode, always=always)


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
            object.__setattr__(module, "matmuls", matmuls)
        elif isinstance(module, nn.QuantizedLinear):
            routed.append((path, QuantizedLinear(module, matmuls)))
        elif isinstance(module, nn.QuantizedEmbedding):
            routed.append((path, QuantizedEmbedding(module, matmuls)))
    if routed:
        model.update_modules(tree_unflatten(routed))
    return sum(isinstance(m, (QuantizedLinear, QuantizedEmbedding)) for _, m in model.named_modules())


def route_layers(model: nn.Module, layers, matmuls: Optional[QuantizedMatmuls]) -> None:
    """``route`` the model, and mark each of ``layers`` eager where it may now run the kernel
    (a layer's ``eager`` attribute: the layer then runs uncompiled)."""
    route(model, matmuls)
    for layer in layers:
        object.__setattr__(layer, "eager", routes_to_metal(layer))


def routes_to_metal(model: nn.Module) -> bool:
    """Whether some layer of ``model`` may run the Metal kernel (then it cannot be compiled:
    the kernel is dispatched from Python, as the emulator that tests it must be)."""
    return any(isinstance(m, (QuantizedLinear, QuantizedEmbedding)) and m.matmuls is not None
               for _, m in model.named_modules())


def shapes_of(models: Iterable[nn.Module], rows: Iterable[int] = range(1, MAX_ROWS + 1),
              dtype: Optional[mx.Dtype] = None) -> List[MatmulShape]:
    """Every distinct (K, N, bits, group size, mode, M) of the models' quantized layers that the
    kernel has a form for, at the activation dtype (their scales' unless given)."""
    seen = {}
    for model in models:
        for _, m in model.named_modules():
            if not isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
                continue
            if not kernel_supports(m.bits, m.group_size, m.mode):
                continue
            N, packed = m["weight"].shape
            act = dtype or (m["scales"].dtype if m.mode == "affine" else mx.bfloat16)
            for r in rows:
                shape = MatmulShape(packed * 32 // m.bits, N, m.bits, m.group_size, m.mode, r, dtype_name(act))
                seen[shape] = None
    return list(seen)


def _inputs(shape: MatmulShape, seed: int = 0):
    kx, kw = mx.random.split(mx.random.key(seed))
    dtype = getattr(mx, shape.dtype)
    x = mx.random.normal((shape.rows, shape.K), key=kx).astype(dtype)
    w, scales, *biases = mx.quantize(mx.random.normal((shape.N, shape.K), key=kw).astype(dtype) * 0.02,
                                     shape.group_size, shape.bits, mode=shape.mode)
    return x, w, scales, (biases[0] if biases else None)


def wall_time(which: str, fn: Callable[[], mx.array], repeats: int = 20, warmup: int = 3) -> float:
    """Median seconds of one evaluated call of ``fn`` (``which``: "stock" or "kernel"; each call
    synchronised, as a decode step is)."""
    for _ in range(warmup):
        mx.eval(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


@dataclass
class Timing:
    shape: MatmulShape
    stock_s: float
    kernel_s: Optional[float]  # None: the kernel failed its self-check here

    @property
    def choice(self) -> str:
        return OURS if self.kernel_s is not None and self.kernel_s <= self.stock_s else STOCK


def tune(metal: kernels.MetalKernels, shapes: Iterable[MatmulShape],
         measure: Callable[[str, Callable[[], mx.array]], float] = wall_time,
         progress: Optional[Callable[[int, int], None]] = None) -> List[Timing]:
    """Times stock ``mx.quantized_matmul`` against the kernel for each shape (same inputs)."""
    shapes = list(shapes)
    timings = []
    for i, shape in enumerate(shapes):
        x, w, scales, biases = _inputs(shape)
        stock = measure(STOCK, lambda: mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=shape.group_size,
                                                    bits=shape.bits, mode=shape.mode))
        launch = quantized_verify_launch(x, w, scales, biases, shape.group_size, shape.bits, shape.mode)
        ours = None
        if metal.usable(KERNEL, launch.template, _check_quantized):
            ours = measure(OURS, lambda: metal.run(launch)[0])
        timings.append(Timing(shape, stock, ours))
        if progress is not None:
            progress(i + 1, len(shapes))
    return timings


def device_id() -> str:
    """What a timing is valid for: the GPU, MLX's version and the kernel's source."""
    from . import device

    facts = device.facts()
    source = hashlib.sha256(kernels.kernel_source(KERNEL).encode()).hexdigest()[:12]
    return f"{facts.name} | {facts.architecture} | mlx {mx.__version__} | {KERNEL} {source}"


class TuningCache:
    """Measured choices per device, in ``$DFLASH_MLX_HOME/tuning.json`` (written whole, atomically)."""

    def __init__(self, path: Path, device: str):
        self.path, self.device = path, device
        self.entries: Dict[str, dict] = {}
        try:
            self.entries = json.loads(path.read_text()).get(device, {})
        except (OSError, ValueError, AttributeError):
            self.entries = {}

    @classmethod
    def for_this_device(cls) -> "TuningCache":
        from . import defaults

        return cls(defaults.home() / "tuning.json", device_id())

    def missing(self, shapes: Iterable[MatmulShape]) -> List[MatmulShape]:
        return [s for s in shapes if s.key() not in self.entries]

    def record(self, timings: Iterable[Timing]) -> None:
        for t in timings:
            self.entries[t.shape.key()] = {"shape": t.shape.__dict__, "stock_us": t.stock_s * 1e6,
                                           "kernel_us": None if t.kernel_s is None else t.kernel_s * 1e6, "choice": t.choice}
        try:
            everything = json.loads(self.path.read_text())
        except (OSError, ValueError):
            everything = {}
        everything[self.device] = self.entries
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_suffix(".json.partial")
        partial.write_text(json.dumps(everything, indent=1, sort_keys=True))
        partial.replace(self.path)

    def choices(self) -> Dict[MatmulShape, str]:
        out = {}
        for entry in self.entries.values():
            try:
                out[MatmulShape(**entry["shape"])] = entry["choice"]
            except (KeyError, TypeError):
                continue
        return out


def tune_pair(matmuls: QuantizedMatmuls, models: Iterable[nn.Module], cache: TuningCache, everything: bool = False,
              measure=wall_time, progress=None) -> List[Timing]:
    """Times the pair's shapes the cache lacks (all of them with ``everything``), records them,
    and makes ``matmuls`` use the results. Returns the new timings."""
    shapes = shapes_of(models)
    todo = shapes if everything else cache.missing(shapes)
    timings = tune(matmuls.metal, todo, measure, progress) if todo else []
    if timings:
        cache.record(timings)
    matmuls.choices.update(cache.choices())
    return timings


def render_timings(timings: Iterable[Timing]) -> List[str]:
    """The tuner's table: one line per shape, stock and kernel times, the choice."""
    lines = [f"{'shape':<44} {'stock us':>9} {'kernel us':>9}  choice"]
    for t in timings:
        kernel = "failed" if t.kernel_s is None else f"{t.kernel_s * 1e6:9.1f}"
        lines.append(f"{t.shape.key():<44} {t.stock_s * 1e6:9.1f} {kernel:>9}  {t.choice}")
    return lines
