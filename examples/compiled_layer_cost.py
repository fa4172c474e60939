"""What compiling the layers that run our kernels saves the host: the decoder layers of a decode
step (and of a verify block) of the demo target, w4, every quantized matmul routed to a kernel,
run plain (as the emulator must run them) against compiled once their kernels are decided
(``kernels.CompiledAfterChecks``, as a Mac runs them).

    python examples/compiled_layer_cost.py [--tokens 1,8] [--calls 300] [--repeats 7]
    python examples/compiled_layer_cost.py --kernels metal --evaluate   # on a Mac

Off Metal the kernel launch is a stand-in (``--kernels stand-in``): each kernel call is one MLX
operation on its input (traceable, as ``mx.fast.metal_kernel`` is on a Mac), the same in both
columns. On a Mac ``--kernels metal`` runs the real kernels (self-checked; the recurrence's too), the
plain column through MLX's own ``metal_kernel`` marked untraceable; with ``--evaluate`` each timed
pass is also evaluated, so the GPU's time counts (``tools/mac-report.sh`` runs it so).

Two figures per row: the microseconds to build (and with ``--evaluate``, to evaluate) the graphs of
the six layers for one pass (each layer on the same input, no cache; the minimum over ``--repeats``
rounds of ``--calls`` passes), and the operations MLX dispatches for them (nodes of those graphs,
from ``mx.export_to_dot``): on a Mac each is a command encoded, and each elementwise
one a pass over its tensor through memory.
"""

from __future__ import annotations

import argparse
import math
import re
import tempfile
import timeit
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from dflash_mlx import kernels, quantized
from dflash_mlx.defaults import demo
from dflash_mlx.loading import load_target


class OneOpKernels:
    """Called like ``mx.fast.metal_kernel``; each kernel is one multiply of its input's first column
    by a zero row of the output's width: a single operation that depends on x, which ``mx.compile``
    traces (``traceable``) or not, as asked."""

    def __init__(self, traceable: bool):
        self.traceable = traceable
        self.zeros = {}

    def __call__(self, name, input_names, output_names, source, **_):
        def kernel(inputs, template, grid, threadgroup, output_shapes, output_dtypes, **__):
            x, shape, dtype = inputs[0], tuple(output_shapes[0]), output_dtypes[0]
            row = self.zeros.get((shape[-1], dtype))
            if row is None:
                row = self.zeros[(shape[-1], dtype)] = mx.zeros((shape[-1],), dtype=dtype)
            return [x[..., :1] * row]

        return kernel


class PlainMetal:
    """MLX's own ``metal_kernel``, marked untraceable: the layers then run plain (the other column)."""

    traceable = False

    def __call__(self, *args, **kwargs):
        return mx.fast.metal_kernel(*args, **kwargs)


def routed_target(traceable: bool, real: bool = False):
    """The demo target, w4, every quantized matmul routed to a kernel (``real``: MLX's Metal kernels,
    the recurrence's included, self-checked; else the stand-in)."""
    if real:
        metal = kernels.MetalKernels(None if traceable else PlainMetal())
        target, _ = load_target(Path(demo()[0]), recurrence=kernels.Recurrence(metal=metal))
    else:
        metal = kernels.MetalKernels(OneOpKernels(traceable), self_check=False)
        target, _ = load_target(Path(demo()[0]))
    nn.quantize(target, group_size=32, bits=4)
    shapes = quantized.shapes_of([target], dtype=mx.float32) + quantized.shapes_of([target])
    target.use_quantized_matmuls(quantized.QuantizedMatmuls(metal, {s: quantized.OURS for s in shapes}))
    return target


def dispatched(out: mx.array) -> int:
    """Operations in the graph that evaluates ``out`` (its DOT's nodes that are not arrays)."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "graph.dot"
        mx.export_to_dot(str(path), out)
        text = path.read_text()
    return len(re.findall(r"shape=rectangle", text))


def measure(tokens, calls: int, repeats: int, real: bool = False, evaluate: bool = False):
    """Per token count: {"plain": (µs, operations), "compiled": (µs, operations)}."""
    out = {}
    for T in tokens:
        ids = mx.array([[7] * T], dtype=mx.int32)
        row = {}
        for name, traceable in (("plain", False), ("compiled", True)):
            target = routed_target(traceable, real)
            x = target.model.embed_tokens(ids)
            mx.eval(x)

            def layers():  # each layer on the same input, no cache; evaluated only with ``evaluate``
                ys = [layer(x) for layer in target.model.layers]
                if evaluate:
                    mx.eval(ys)
                return ys

            mx.eval(layers())  # decides (plans), compiles; constants made once are evaluated, not counted
            best = math.inf
            for _ in range(repeats):
                best = min(best, timeit.timeit(layers, number=calls) / calls * 1e6)
            unevaluated = [layer(x) for layer in target.model.layers]
            row[name] = (best, sum(dispatched(y) for y in unevaluated))
        out[T] = row
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1,8", help="tokens per pass: 1 is a decode step, 8 a verify block")
    parser.add_argument("--calls", type=int, default=300, help="passes per timed round")
    parser.add_argument("--repeats", type=int, default=7, help="rounds; the minimum is reported")
    parser.add_argument("--kernels", choices=["stand-in", "metal"], default="stand-in",
                        help="the kernel launch: a one-operation stand-in (anywhere), or MLX's Metal kernels (a Mac)")
    parser.add_argument("--evaluate", action="store_true", help="evaluate each timed pass (the GPU's time counts)")
    args = parser.parse_args(argv)
    if args.kernels == "metal" and not mx.metal.is_available():
        parser.error("--kernels metal needs an Apple GPU (Metal)")
    results = measure([int(t) for t in args.tokens.split(",")], args.calls, args.repeats, args.kernels == "metal",
                      args.evaluate)
    what = "build and evaluate" if args.evaluate else "build"
    print(f"demo target (6 layers) w4, every quantized matmul routed, kernels: {args.kernels}; mlx {mx.__version__}")
    print(f"| tokens | plain: µs to {what} | plain: operations | compiled: µs to {what} | compiled: operations |")
    print("|---:|---:|---:|---:|---:|")
    for T, row in results.items():
        (p_us, p_ops), (c_us, c_ops) = row["plain"], row["compiled"]
        print(f"| {T} | {p_us:.0f} | {p_ops} | {c_us:.0f} | {c_ops} |")
    return results


if __name__ == "__main__":
    main()
