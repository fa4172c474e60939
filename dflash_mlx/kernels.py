"""Gated DeltaNet recurrence with a rollback tape, and tape replay.

Every use of the recurrence in dflash-mlx goes through the two functions here, so a
faster backend (the Metal kernels) only has to match these references.

Shapes (mlx-lm layout):
  q, k:   [B, T, Hk, Dk]   (already L2-normalised; q carries the Dk**-0.5 scale)
  v:      [B, T, Hv, Dv]
  g:      [B, T, Hv]       decay in (0, 1], float32
  beta:   [B, T, Hv]
  state:  [B, Hv, Dv, Dk]  float32
The tape of a step is its innovation ``delta`` [B, T, Hv, Dv] (float32); with ``k`` and
``g`` it is enough to rebuild the state after any prefix of the steps without a single
dot product: ``S = g*S + delta ⊗ k``.

Three implementations: the Metal kernels (Apple GPU), the step-by-step reference (the
specification, and the decode step everywhere), and a chunked form for multi-token calls
off Metal. The chunked form solves a block's deltas as one small triangular system
(the WY/UT form of the delta rule), so a verify pass or a prefill chunk costs a handful of
batched operations instead of a few per token: on MLX's CPU backend, where every operation
has a fixed dispatch cost, that is what makes verifying a block cheap.
"""

from __future__ import annotations

import functools
import os
import types
import warnings
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import mlx.core as mx

KERNEL_NAMES = ("gated_delta_tape", "tape_replay")  # the recurrence's; quantized.py runs quantized_verify(_tile, _splash)
# mlx-lm's own Gated DeltaNet kernel (its generic `gated_delta_step` body, taken from mlx-lm at run
# time): the fallback of gated_delta_tape, without a tape (a rollback recomputes the kept steps).
MLX_LM_KERNEL = "mlx_lm_gated_delta"
# Set to "reference" to run the pure-MLX functions even where Metal is available.
BACKEND_ENV = "DFLASH_MLX_KERNELS"
# Input and output names of each kernel, as its body uses them.
KERNEL_IO = {
    "gated_delta_tape": (("q", "k", "v", "g", "beta", "state_in", "T"), ("y", "state_out", "delta")),
    "tape_replay": (("state_in", "k", "g", "delta", "T", "steps"), ("state_out",)),
    "quantized_verify": (("x", "w", "scales", "biases", "M", "K", "N"), ("y",)),
    "quantized_verify_tile": (("x", "w", "scales", "biases", "M", "K", "N"), ("y",)),
    "quantized_verify_splash": (("x", "w", "scales", "biases", "M", "K", "N"), ("y",)),
    MLX_LM_KERNEL: (("q", "k", "v", "g", "beta", "state_in", "T"), ("y", "state_out")),
}
THREADGROUP = (32, 4, 1)  # one simdgroup per value row, four rows of one head per threadgroup


def metal_sources():
    """Where the kernels' ``.metal`` files are: ``metal/`` beside the package in a checkout (an
    editable install maps ``dflash_mlx.metal`` to the checkout it was installed from, which need
    not be the one imported: another worktree on ``PYTHONPATH``), else the installed
    ``dflash_mlx.metal``."""
    checkout = Path(__file__).resolve().parents[1]
    if (checkout / "metal" / "__init__.py").is_file() and (checkout / "pyproject.toml").is_file():
        return checkout / "metal"
    return resources.files("dflash_mlx.metal")


def kernel_source(name: str) -> str:
    """The body of a Metal kernel, as shipped in the package (``metal/`` in a checkout); mlx-lm's
    for ``MLX_LM_KERNEL``."""
    if name == MLX_LM_KERNEL:
        source = mlx_lm_gated_delta_source()
        if source is None:
            raise RuntimeError("mlx-lm's gated_delta kernel source is not available from this mlx-lm")
        return source
    return metal_sources().joinpath(f"{name}.metal").read_text()


@functools.lru_cache(maxsize=None)
def mlx_lm_gated_delta_source() -> Optional[str]:
    """The body of mlx-lm's generic Gated DeltaNet kernel (``models/gated_delta.py``,
    ``_make_gated_delta_kernel``: scalar gate, no mask), as mlx-lm hands it to ``metal_kernel``.
    mlx-lm builds it only where Metal is available; here its builder runs with a stand-in ``mx``
    that records the call, so the same body runs on a Mac and in the emulator. None if this mlx-lm
    has no such builder or builds it otherwise."""
    try:
        from mlx_lm.models import gated_delta
    except ImportError:
        return None
    captured: Dict[str, Any] = {}
    stand_in = types.SimpleNamespace(metal=types.SimpleNamespace(is_available=lambda: True),
                                     fast=types.SimpleNamespace(metal_kernel=lambda **kwargs: captured.update(kwargs)))
    saved = getattr(gated_delta, "mx", None)
    try:
        gated_delta.mx = stand_in
        gated_delta._make_gated_delta_kernel(has_mask=False, vectorized=False)
    except Exception:
        return None
    finally:
        gated_delta.mx = saved
    if tuple(captured.get("input_names", ())) != KERNEL_IO[MLX_LM_KERNEL][0] or \
            tuple(captured.get("output_names", ())) != KERNEL_IO[MLX_LM_KERNEL][1]:
        return None
    return captured.get("source")


# MLX's type strings, shortened, for kernel names.
_TYPE_CODES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "int32": "i32", "uint32": "u32", "uint8": "u8",
               "int8": "i8", "uint16": "u16", "int16": "i16", "int64": "i64", "uint64": "u64", "bool": "b"}
MAX_CONSTANT_ARRAY_SIZE = 8  # MLX: inputs with fewer elements are passed in the constant address space


def input_signature(inputs) -> Tuple[Tuple[str, str], ...]:
    """How MLX's ``metal_kernel`` declares each input of a call: its dtype, and ``s`` (a Python
    scalar, a ``constant`` reference), ``c`` (fewer than 8 elements: ``constant``) or ``d``
    (``device``). Two calls with the same signature and template compile the same source."""
    out = []
    for x in inputs:
        if isinstance(x, bool):
            out.append(("bool", "s"))
        elif isinstance(x, int):
            out.append(("int32", "s"))
        elif isinstance(x, float):
            out.append(("float32", "s"))
        else:
            space = "s" if x.ndim == 0 else "c" if x.size < MAX_CONSTANT_ARRAY_SIZE else "d"
            out.append((str(x.dtype).split(".")[-1], space))
    return tuple(out)


def kernel_name(name: str, signature) -> str:
    """The name a kernel is built under: ``name`` and its call signature. MLX 0.32 names each
    generated source by its input types and address spaces itself; MLX 0.30 and 0.31 name it by
    the name and template only, so one name would stand for two sources (a one-token call on few
    heads passes g and beta as ``constant``, a block as ``device``) and the library would be
    rebuilt at every switch between them."""
    return name + "__" + "_".join(_TYPE_CODES.get(dtype, dtype) + space for dtype, space in signature)


def metal_supports(k_head_dim: int, k_heads: int, v_head_dim: int, v_heads: int) -> bool:
    """Head shapes the kernels are written for (see the kernels' headers)."""
    return k_head_dim % 32 == 0 and v_head_dim % 4 == 0 and v_heads % k_heads == 0


@dataclass(frozen=True)
class Launch:
    """One kernel call, exactly as handed to ``mx.fast.metal_kernel``: built in one place so that
    the emulator's generated signature comes from the very arguments the engine passes."""

    name: str
    inputs: tuple
    template: tuple
    grid: tuple
    output_shapes: tuple
    output_dtypes: tuple
    threadgroup: tuple = THREADGROUP

    @functools.cached_property  # computed once per launch (a launch run again, as the tuner does, pays nothing)
    def signature(self) -> Tuple[Tuple[str, str], ...]:
        return input_signature(self.inputs)

    @functools.cached_property
    def kernel_id(self) -> str:
        """The name its kernel is built under (``kernel_name``: the name and the signature)."""
        return kernel_name(self.name, self.signature)

    def call(self, kernel: Callable) -> List[mx.array]:
        """``kernel`` (built by ``metal_kernel``) called with this launch's arguments."""
        return kernel(inputs=list(self.inputs), template=list(self.template), grid=self.grid,
                      threadgroup=self.threadgroup, output_shapes=list(self.output_shapes),
                      output_dtypes=list(self.output_dtypes))


class LaunchPlan:
    """What every call of one kernel specialization from one call site has in common, decided once
    from a first ``Launch`` of it: the name, template, grid, threadgroup, output shapes and dtypes,
    the signature and so the kernel it is built under. ``launch(inputs)`` is then a call with new
    inputs of the same dtypes, address spaces and scalar values where they matter (the caller keeps
    that promise: ``quantized`` keys its plans by activation dtype and shape), at the cost of one
    small object instead of a ``Launch`` and its signature per call."""

    __slots__ = ("name", "template", "grid", "threadgroup", "output_shapes", "output_dtypes", "signature", "kernel_id",
                 "_arguments")

    def __init__(self, launch: Launch, output_shapes: Optional[tuple] = None):
        """``output_shapes``: the calls' own where they differ from the first launch's (more
        leading axes over the same elements)."""
        self.name, self.template = launch.name, launch.template
        self.grid, self.threadgroup = launch.grid, launch.threadgroup
        self.output_shapes, self.output_dtypes = output_shapes or launch.output_shapes, launch.output_dtypes
        self.signature, self.kernel_id = launch.signature, launch.kernel_id
        self._arguments = dict(template=list(launch.template), grid=launch.grid, threadgroup=launch.threadgroup,
                               output_shapes=list(self.output_shapes), output_dtypes=list(launch.output_dtypes))

    def launch(self, inputs: tuple) -> "PlannedLaunch":
        return PlannedLaunch(self, inputs)


class PlannedLaunch:
    """One call of a ``LaunchPlan``: reads like a ``Launch`` (``MetalKernels.run`` takes either)."""

    __slots__ = ("plan", "inputs")

    def __init__(self, plan: LaunchPlan, inputs: tuple):
        self.plan, self.inputs = plan, inputs

    name = property(lambda self: self.plan.name)
    template = property(lambda self: self.plan.template)
    grid = property(lambda self: self.plan.grid)
    threadgroup = property(lambda self: self.plan.threadgroup)
    output_shapes = property(lambda self: self.plan.output_shapes)
    output_dtypes = property(lambda self: self.plan.output_dtypes)
    signature = property(lambda self: self.plan.signature)
    kernel_id = property(lambda self: self.plan.kernel_id)

    def call(self, kernel: Callable) -> List[mx.array]:
        return kernel(inputs=list(self.inputs), **self.plan._arguments)


def _template(k: mx.array, v: mx.array) -> tuple:
    _, _, Hk, Dk = k.shape
    Hv, Dv = v.shape[-2:]
    return (("InT", k.dtype), ("StT", mx.float32), ("Dk", Dk), ("Dv", Dv), ("Hk", Hk), ("Hv", Hv))


def gated_delta_launch(q, k, v, g, beta, state) -> Launch:
    """Inputs cast to the dtypes the body computes in: the kernel's ``InT`` is ``k``'s dtype."""
    B, T, _, _ = k.shape
    Hv, Dv = v.shape[-2:]
    dtype = k.dtype
    return Launch(
        "gated_delta_tape",
        (q.astype(dtype), k, v.astype(dtype), g.astype(mx.float32), beta.astype(dtype), state.astype(mx.float32), T),
        _template(k, v),
        (32, Dv, B * Hv),
        ((B, T, Hv, Dv), tuple(state.shape), (B, T, Hv, Dv)),
        (dtype, mx.float32, mx.float32),
    )


def mlx_lm_launch(q, k, v, g, beta, state) -> Launch:
    """mlx-lm's kernel on the same inputs, cast as ours: ``(y, final_state)``, no tape."""
    ours = gated_delta_launch(q, k, v, g, beta, state)
    return Launch(MLX_LM_KERNEL, ours.inputs, ours.template, ours.grid, ours.output_shapes[:2], ours.output_dtypes[:2])


@dataclass(frozen=True)
class StepInputs:
    """The tape of a pass that mlx-lm's kernel ran (it keeps no delta): the inputs of its steps.
    A rollback runs the kernel again over the kept steps, from the state the pass started from."""

    q: mx.array
    v: mx.array
    beta: mx.array


def _check_steps(steps: int, T: int) -> None:
    if not 0 <= steps <= T:
        raise ValueError(f"steps={steps} outside 0..{T} (the tape's length)")


def tape_replay_launch(state, k, g, delta, steps: int) -> Launch:
    B, T, _, _ = k.shape
    Hv, Dv = delta.shape[-2:]
    _check_steps(steps, T)
    return Launch(
        "tape_replay",
        (state.astype(mx.float32), k, g.astype(mx.float32), delta.astype(mx.float32), T, steps),
        _template(k, delta),
        (32, Dv, B * Hv),
        (tuple(state.shape),),
        (mx.float32,),
    )


# Self-check: the tolerance of y against the reference by input dtype (one rounding step of it).
_Y_TOLERANCE = {mx.float32: 1e-5, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}


def _check_inputs(template: dict, T: int, dtype):
    """A small random call for one specialization (B = 1): T = 1 passes inputs of under 8
    elements the way MLX does (``constant`` address space), T = 8 the ``device`` way."""
    Dk, Dv, Hk, Hv = template["Dk"], template["Dv"], template["Hk"], template["Hv"]
    key = mx.random.key(T)
    kq, kk, kv, kg, kb, ks = mx.random.split(key, 6)
    q = (mx.random.normal((1, T, Hk, Dk), key=kq) * Dk**-0.5).astype(dtype)
    k = (mx.random.normal((1, T, Hk, Dk), key=kk) * Dk**-0.5).astype(dtype)
    v = mx.random.normal((1, T, Hv, Dv), key=kv).astype(dtype)
    g = mx.random.uniform(0.3, 1.0, (1, T, Hv), key=kg)
    beta = mx.random.uniform(0.0, 1.0, (1, T, Hv), key=kb).astype(dtype)
    state = mx.random.normal((1, Hv, Dv, Dk), key=ks)
    return q, k, v, g, beta, state


def _close(a: mx.array, b: mx.array, tolerance: float) -> bool:
    return bool(mx.allclose(a.astype(mx.float32), b.astype(mx.float32), atol=tolerance, rtol=tolerance).item())


# What runs instead of a kernel that failed its self-check (the warning says it).
FALLBACKS = {
    "gated_delta_tape": "mlx-lm's gated_delta kernel (prefill, decode and verify; a rollback recomputes the kept "
                        "steps from the saved state)",
    "tape_replay": "the pure-MLX replay",
    # Where the tuner asks (a routed layer's plan names its own next best: ``usable``'s ``fallback``).
    **{name: "the tuner's next choice (another kernel of ours or stock) for every row count of the layers of this form"
       for name in ("quantized_verify", "quantized_verify_tile", "quantized_verify_splash")},
    MLX_LM_KERNEL: "the pure-MLX recurrence",
}


class MetalKernels:
    """The Metal kernels as one process uses them.

    Each kernel is built by ``metal_kernel`` (``mx.fast.metal_kernel`` on a Mac; the emulator's
    stand-in in the tests) once per call signature (``kernel_name``). The first time a
    specialization is used (template arguments, and the dtype and address space MLX gives each
    input: ``input_signature``), it runs once on small inputs of that same signature against the
    pure-MLX reference, so that no call compiles a source its self-check did not run; a compile
    error or a mismatch makes that specialization fall back (``FALLBACKS``) for the rest of the
    process, with one warning per kernel. A broken kernel costs speed, never a crash or a wrong
    token.
    """

    def __init__(self, metal_kernel: Optional[Callable] = None, self_check: bool = True):
        self._metal_kernel = metal_kernel or mx.fast.metal_kernel
        self._self_check = self_check
        self._built: Dict[str, Any] = {}
        self._warned: set = set()
        self.checks: Dict[tuple, Optional[str]] = {}  # (name, template, signature) -> None (passed) or the failure
        # How many checks have failed so far: a decision that rested on the checks (quantized's
        # per-layer plans) is taken again when this moves, and only then.
        self.failures = 0
        self.builds = 0  # kernel objects built (``metal_kernel`` calls)

    @property
    def traceable(self) -> bool:
        """Whether ``mx.compile`` can trace a call of these kernels: MLX's own ``metal_kernel``
        (a primitive like any other), or a stand-in that says so (``traceable = True``). The
        emulator runs a kernel on the host when it is called, which no trace can hold."""
        return bool(getattr(self._metal_kernel, "traceable", self._metal_kernel is mx.fast.metal_kernel))

    def stamp(self) -> int:
        """What the decisions resting on the self-checks depend on (``CompiledAfterChecks``)."""
        return self.failures

    def run(self, launch: Launch) -> List[mx.array]:
        """``launch`` (a ``Launch`` or a ``PlannedLaunch``) through its kernel, built on first use."""
        kernel = self._built.get(launch.kernel_id)
        if kernel is None:
            kernel = self._built[launch.kernel_id] = self.build(launch)
        return launch.call(kernel)

    def build(self, launch: Launch) -> Callable:
        """The ``metal_kernel`` object for ``launch``'s kernel and signature (``run`` keeps it)."""
        input_names, output_names = KERNEL_IO[launch.name]
        self.builds += 1
        return self._metal_kernel(name=launch.kernel_id, input_names=list(input_names),
                                  output_names=list(output_names), source=kernel_source(launch.name))

    def usable(self, launch: Launch, check: Optional[Callable[["MetalKernels", Launch], Optional[str]]] = None,
               fallback: Optional[str] = None) -> bool:
        """Whether ``launch``'s kernel may run for its specialization and signature, self-checked
        on first use by ``check`` (None if the kernel matched its reference on a call of the same
        signature, else what went wrong; the recurrence's check by default). A failure warns once
        per kernel saying what runs instead (``FALLBACKS``), or where the caller says it
        (``fallback``: a routed layer's own next best), once per kernel and specialization."""
        key = (launch.name, launch.template, launch.signature)
        if key not in self.checks:
            self.checks[key] = self._guarded(check or _check_recurrence, launch) if self._self_check else None
            if self.checks[key] is not None:
                self.failures += 1
            warned = launch.name if fallback is None else (launch.name, launch.template)
            if self.checks[key] is not None and warned not in self._warned:
                self._warned.add(warned)
                warnings.warn(
                    f"dflash-mlx: the Metal kernel {describe(launch.name, launch.template, launch.signature)} failed its self-check "
                    f"and is replaced by {fallback or FALLBACKS.get(launch.name, 'the pure-MLX reference')} for the rest of this "
                    f"process: {self.checks[key]}", RuntimeWarning, stacklevel=2,
                )
        # A kernel that failed for one signature is not trusted for any other of its specialization:
        # a bug can hide at some shapes (a wrong gate is right at one step), and decode and verify
        # must go through one implementation, not ours for one token and the fallback for blocks.
        return not any(failure is not None for (name, template, _), failure in self.checks.items()
                       if name == launch.name and template == launch.template)

    def _guarded(self, check, launch: Launch) -> Optional[str]:
        try:
            return check(self, launch)
        except Exception as e:  # a compile error surfaces here, at the first evaluation
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            return f"{type(e).__name__}: {' | '.join(lines[:3])}"  # the compiler's header and first errors

    def gated_delta(self, q, k, v, g, beta, state):
        """``(y, state, tape)`` from our kernel (the tape: each step's delta), else from mlx-lm's
        (the tape: the steps' inputs, ``StepInputs``), or None where neither is usable."""
        launch = gated_delta_launch(q, k, v, g, beta, state)
        if self.usable(launch):
            y, state, delta = self.run(launch)
            return y.astype(q.dtype), state, delta
        fallback = mlx_lm_launch(q, k, v, g, beta, state)
        if not self.usable(fallback, _check_mlx_lm):
            return None
        y, final = self.run(fallback)
        q_, _, v_, _, beta_ = fallback.inputs[:5]  # as the kernel took them (cast to k's dtype)
        return y.astype(q.dtype), final, StepInputs(q_, v_, beta_)

    def recompute(self, state, k, g, steps: StepInputs, keep: int):
        """The state after the first ``keep`` steps of a pass mlx-lm's kernel ran, from the state
        the pass started from: one dispatch over the kept steps, the same per-step arithmetic as a
        decode step, so the state is bit for bit that of decode steps."""
        launch = mlx_lm_launch(steps.q[:, :keep], k[:, :keep], steps.v[:, :keep], g[:, :keep], steps.beta[:, :keep], state)
        if not self.usable(launch, _check_mlx_lm):
            return None
        return self.run(launch)[1]

    def tape_replay(self, state, k, g, delta, steps: int):
        launch = tape_replay_launch(state, k, g, delta, steps)
        if not self.usable(launch):
            return None
        return self.run(launch)[0]

    def report(self) -> Dict[str, str]:
        """Each checked specialization and signature: ``"ok"`` or its failure (``dflash-mlx doctor``)."""
        return {describe(name, template, signature): "ok" if failure is None else failure
                for (name, template, signature), failure in self.checks.items()}


class CompiledAfterChecks:
    """``mx.compile(function)`` for a function that may run our kernels, once what it runs is decided.

    Which kernel a call runs is decided in Python on its first call at a shape: a self-check
    evaluates (``MetalKernels.usable``), a layer makes its plan (``quantized.MatmulPlan``). A
    compile trace can do neither. So the first call at each input shape under a ``stamp()`` builds
    the plain graph and drops it unevaluated, which takes every decision; that call and every later
    one then run the compiled function, which traces the kernels (MLX primitives on a Mac) with
    those decisions and fuses the norms, RoPE and activations around them. Every result comes from
    the compiled function, so a shape's first call and its later ones round alike. A new stamp (a
    check failed, the tuner's choices changed) starts a new compiled function: the old one embeds
    the old decisions."""

    def __init__(self, function: Callable, inputs, stamp: Callable[[], Any]):
        self.function, self.inputs, self.stamp = function, inputs, stamp
        self._stamp: Any = None
        self._compiled: Optional[Callable] = None
        self._decided: set = set()  # the input shapes and dtypes decided under ``_stamp``
        self.compilations = 0  # compiled functions started (a test counts them)

    def __call__(self, *args):
        key = tuple((a.shape, a.dtype) if isinstance(a, mx.array) else a for a in args)
        stamp = self.stamp()
        while stamp != self._stamp or key not in self._decided:
            if stamp != self._stamp:
                self._stamp, self._decided = stamp, set()
                self._compiled = mx.compile(self.function, inputs=self.inputs)
                self.compilations += 1
            self.function(*args)  # decides; the graph is never evaluated
            decided, stamp = stamp, self.stamp()
            if stamp == decided:  # no check failed while deciding: these decisions hold
                self._decided.add(key)
        return self._compiled(*args)


def describe(name: str, template: tuple, signature: Optional[tuple] = None) -> str:
    """``gated_delta_tape float32 Dk=128 ...``: a kernel specialization as people read it (with its
    inputs' address spaces when some are not ``device``)."""
    parts = [str(v).split(".")[-1] if isinstance(v, mx.Dtype) else f"{k}={v}" for k, v in template if k != "StT"]
    if signature and any(space == "c" for _, space in signature):
        names = KERNEL_IO.get(name, ((),))[0]
        parts.append("constant " + ",".join(n for n, (_, space) in zip(names, signature) if space == "c"))
    return " ".join([name, *parts])


def _check_calls(launch: Launch, calls: Callable[[int], Launch], steps: int):
    """Check calls of ``launch``'s signature: T = 1 and T = 8 (B = 1) where they have it, else the
    real call's B * T steps at B = 1 (an input under 8 elements: the call is small)."""
    found = [c for c in (calls(1), calls(8)) if c.signature == launch.signature]
    if not found:
        found = [calls(steps)]
    return found


def _against_reference(launch: Launch, calls: Callable[[int], Launch],
                       compare: Callable[[Launch, int, tuple, tuple, float], Optional[str]]) -> Optional[str]:
    """The loop every self-check runs: each call ``calls`` makes of the launch's signature, with its
    inputs and the reference's (y, state, delta) on them, goes to ``compare`` (None: it matches;
    else what differs)."""
    template = dict(launch.template)
    dtype = template["InT"]
    k = launch.inputs[1]
    for call in _check_calls(launch, calls, k.shape[0] * k.shape[1]):
        if call.signature != launch.signature:
            return "its self-check cannot make a call of this signature"
        T = call.inputs[1].shape[1]
        inputs = _check_inputs(template, T, dtype)
        problem = compare(call, T, inputs, gated_delta_reference(*inputs), _Y_TOLERANCE[dtype])
        if problem:
            return problem
    return None


def _check_recurrence(metal: MetalKernels, launch: Launch) -> Optional[str]:
    """None if a recurrence kernel matches the reference on small inputs of the call's signature,
    else what went wrong."""
    template = dict(launch.template)
    dtype = template["InT"]
    if launch.name == "gated_delta_tape":
        calls = lambda T: gated_delta_launch(*_check_inputs(template, T, dtype))  # noqa: E731

        def compare(call, T, inputs, want, y_tolerance):
            y, final, delta = metal.run(call)
            mx.eval(y, final, delta)
            if not (_close(y, want[0], y_tolerance) and _close(final, want[1], 1e-4) and _close(delta, want[2], 1e-4)):
                return f"its output differs from the reference (T={T})"
            return None
    else:
        def calls(T):
            q, k_, v, g, beta, state = _check_inputs(template, T, dtype)
            return tape_replay_launch(state, k_, g, gated_delta_reference(q, k_, v, g, beta, state)[2], T)

        def compare(call, T, inputs, want, y_tolerance):
            _, k_, _, g, _, state = inputs
            for steps in sorted({0, T // 2, T}):
                (got,) = metal.run(tape_replay_launch(state, k_, g, want[2], steps))
                if not _close(got, tape_replay_reference(state, k_, g, want[2], steps), 1e-4):
                    return f"its output differs from the reference (T={T}, steps={steps})"
            return None
    return _against_reference(launch, calls, compare)


def _check_mlx_lm(metal: MetalKernels, launch: Launch) -> Optional[str]:
    """mlx-lm's kernel against the reference on small inputs of the call's signature; and a pass
    of T steps ending in the state of T one-step calls bit for bit (what a rollback by recomputing
    relies on)."""
    if mlx_lm_gated_delta_source() is None:
        return "this mlx-lm has no gated_delta kernel to take (models/gated_delta.py)"
    template = dict(launch.template)
    dtype = template["InT"]

    def compare(call, T, inputs, want, y_tolerance):
        y, final = metal.run(call)
        if not (_close(y, want[0], y_tolerance) and _close(final, want[1], 1e-4)):
            return f"its output differs from the reference (T={T})"
        return None

    return _against_reference(launch, lambda T: mlx_lm_launch(*_check_inputs(template, T, dtype)), compare)


@functools.lru_cache(maxsize=None)
def process_metal_kernels() -> MetalKernels:
    """This process's Metal kernels: built and self-checked once, whoever loads a model."""
    return MetalKernels()


class Recurrence:
    """How one model runs the Gated DeltaNet recurrence and its replay, decided at load.

    ``metal``: the kernels (``MetalKernels``) for the shapes they support, the pure-MLX forms
    otherwise and wherever a kernel failed its self-check; ``chunked``: multi-token calls take
    the chunked form (off Metal, on the CPU); with neither, the step-by-step reference.
    """

    def __init__(self, metal: Optional[MetalKernels] = None, chunked: bool = False):
        self.metal = metal
        self.chunked = chunked

    @classmethod
    def for_this_process(cls) -> "Recurrence":
        """The kernels on an Apple GPU, chunked on the CPU; ``DFLASH_MLX_KERNELS=reference``
        forces the step-by-step reference everywhere."""
        if os.environ.get(BACKEND_ENV, "auto") == "reference":
            return cls()
        on_gpu = mx.default_device() == mx.gpu
        if on_gpu and mx.metal.is_available():
            return cls(metal=process_metal_kernels())
        return cls(chunked=not on_gpu)

    def mode(self, k_head_dim: int, k_heads: int, v_head_dim: int, v_heads: int) -> str:
        """``"metal"``, ``"chunked"`` or ``"reference"`` for these head shapes. Callers that
        compile around the recurrence key their compiled graph on it (on Metal, once its
        kernels are decided: ``CompiledAfterChecks``)."""
        if self.metal is not None and metal_supports(k_head_dim, k_heads, v_head_dim, v_heads):
            return "metal"
        return "chunked" if self.chunked else "reference"

    def gated_delta(self, q, k, v, g, beta, state=None):
        """The recurrence over T steps; returns ``(y, final_state, delta_tape)``."""
        if state is None:
            B, _, _, Dk = k.shape
            Hv, Dv = v.shape[-2:]
            state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
        mode = self.mode(k.shape[-1], k.shape[-2], v.shape[-1], v.shape[-2])
        if mode == "metal":
            out = self.metal.gated_delta(q, k, v, g, beta, state)
            if out is not None:
                return out
        if self.chunked or (mode == "metal" and k.shape[1] > 1):  # never a per-token loop on a GPU
            return gated_delta_chunked(q, k, v, g, beta, state)
        return gated_delta_reference(q, k, v, g, beta, state)

    def tape_replay(self, state, k, g, delta, steps: int):
        """State after the first ``steps`` taped steps, starting from ``state``."""
        _check_steps(steps, k.shape[1])
        if steps == 0:
            return state
        if isinstance(delta, StepInputs):  # a pass mlx-lm's kernel ran: recompute the kept steps
            out = self.metal.recompute(state, k, g, delta, steps) if self.metal is not None else None
            if out is not None:
                return out
            return gated_delta_reference(delta.q[:, :steps], k[:, :steps], delta.v[:, :steps], g[:, :steps],
                                         delta.beta[:, :steps], state)[1]
        chunked = self.chunked  # the algebra the forward pass used, one step too
        if self.mode(k.shape[-1], k.shape[-2], delta.shape[-1], delta.shape[-2]) == "metal":
            out = self.metal.tape_replay(state, k, g, delta, steps)
            if out is not None:
                return out
        if steps <= CHUNK:  # a rollback after a verify block
            return _replay_prefix(state, k, g, delta, steps, chunked)
        return (tape_replay_chunked if chunked else tape_replay_reference)(state, k, g, delta, steps)

    def tape_replay_rows(self, state, k, g, delta, steps: mx.array):
        """``tape_replay`` for every batch row at once, row ``b`` to its own ``steps[b]``: one
        replay of the whole tape whose steps past a row's count have ``g = 1`` and ``delta = 0``.
        Each form then gives the bits of the row's own replay: the step forms multiply by 1 and
        add 0; the chunked form's decay sums add 0 and its weighted sum over steps (MLX's CPU
        matmul, accumulated in step order) adds exact zero terms after the kept ones."""
        return self.tape_replay(state, k, *_mask_steps(g, delta, steps), k.shape[1])


def _expand_heads(x: mx.array, hv: int) -> mx.array:
    """Repeat key heads so that each value head sees its GQA key head."""
    repeat = hv // x.shape[-2]
    return mx.repeat(x, repeat, axis=-2) if repeat > 1 else x


@mx.compile
def _step(q, k, v, g, beta, state):
    # Same operation order as the replay below, so a replayed state is bit-identical.
    state = state * g[..., None, None]
    kv = (state * k[..., None, :]).sum(axis=-1)
    delta = (v.astype(mx.float32) - kv) * beta.astype(mx.float32)[..., None]
    state = state + k[..., None, :] * delta[..., None]
    y = (state * q[..., None, :]).sum(axis=-1)
    return y, state, delta


@mx.compile
def _replay_step(k, g, delta, state):
    state = state * g[..., None, None]
    return state + k[..., None, :] * delta[..., None]


def gated_delta_reference(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
) -> Tuple[mx.array, mx.array, mx.array]:
    """Pure-MLX recurrence: returns ``(y, final_state, delta_tape)``."""
    hv = v.shape[-2]
    q, k = _expand_heads(q, hv), _expand_heads(k, hv)
    ys, deltas = [], []
    for t in range(q.shape[1]):
        y, state, delta = _step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        ys.append(y)
        deltas.append(delta)
    return mx.stack(ys, axis=1).astype(q.dtype), state, mx.stack(deltas, axis=1)


def tape_replay_reference(
    state: mx.array, k: mx.array, g: mx.array, delta: mx.array, steps: int
) -> mx.array:
    """Pure-MLX replay of the first ``steps`` steps of a tape onto ``state``."""
    k = _expand_heads(k, delta.shape[-2])
    for t in range(steps):
        state = _replay_step(k[:, t], g[:, t], delta[:, t], state)
    return state


# Tokens per chunk of the chunked form: one triangular solve per chunk.
CHUNK = 64


def _log_decay(g):
    # A decay that underflowed to 0 clears the state; a floor keeps the cumulative sums finite.
    return mx.cumsum(mx.log(mx.maximum(g.astype(mx.float32), 1e-30)).swapaxes(1, 2), axis=-1)


def _head_major(x):
    return x.swapaxes(1, 2).astype(mx.float32)


def _state_after(state, K, lg, delta):
    """S_n = G_n S_0 + sum_s (G_n/G_s) delta_s k_s^T over the chunk (head-major operands)."""
    weights = mx.exp(lg[..., -1:] - lg)[..., None]
    return mx.exp(lg[..., -1])[..., None, None] * state + (delta * weights).swapaxes(-1, -2) @ K


@mx.compile
def _chunk_step(q, k, v, g, beta, state):
    """One chunk, token-major in and out like the reference: ``(y, state, delta)``.

    delta_t = beta_t (v_t - G_t S_0 k_t - sum_{s<t} (G_t/G_s) (k_s.k_t) delta_s) is a unit
    lower-triangular system in the chunk's deltas, solved with one triangular inverse.
    """
    q, k = _expand_heads(q, v.shape[-2]), _expand_heads(k, v.shape[-2])
    Q, K, V = _head_major(q), _head_major(k), _head_major(v)
    lg, b = _log_decay(g), _head_major(beta[..., None])[..., 0]
    T = Q.shape[2]
    causal = mx.tril(mx.ones((T, T), dtype=mx.bool_))
    decay = mx.exp(mx.where(causal, lg[..., :, None] - lg[..., None, :], -mx.inf))  # G_t/G_s, s <= t
    strictly_lower = b[..., None] * decay * (K @ K.swapaxes(-1, -2)) * (1 - mx.eye(T))
    start = mx.exp(lg)[..., None]
    state_t = state.swapaxes(-1, -2)  # [B, H, Dk, Dv]
    rhs = b[..., None] * (V - start * (K @ state_t))
    delta = mx.linalg.tri_inv(mx.eye(T) + strictly_lower, upper=False, stream=mx.cpu) @ rhs
    y = start * (Q @ state_t) + ((Q @ K.swapaxes(-1, -2)) * decay) @ delta
    return y.swapaxes(1, 2), _state_after(state, K, lg, delta), delta.swapaxes(1, 2)


@mx.compile
def _chunk_one(q, k, v, g, beta, state):
    """``_chunk_step`` for one token, without what is exact at T = 1 (a 1x1 triangular solve, the
    causal decay, which is exp(0) = 1): the same bits, at about the cost of ``_step``. A decode step
    and row 0 of a verify block then run one algorithm, so a token's numbers do not depend on how
    many rows its pass carried (``_step`` takes the decay as ``g``, this as ``exp(log g)``)."""
    q, k = _expand_heads(q, v.shape[-2]), _expand_heads(k, v.shape[-2])
    Q, K, V = _head_major(q), _head_major(k), _head_major(v)
    lg, b = _log_decay(g), _head_major(beta[..., None])[..., 0]
    start = mx.exp(lg)[..., None]
    state_t = state.swapaxes(-1, -2)
    delta = b[..., None] * (V - start * (K @ state_t))
    y = start * (Q @ state_t) + (Q @ K.swapaxes(-1, -2)) @ delta
    return y.swapaxes(1, 2), _state_after(state, K, lg, delta), delta.swapaxes(1, 2)


@mx.compile
def _replay_chunk(k, g, delta, state):
    k = _expand_heads(k, delta.shape[-2])
    return _state_after(state, _head_major(k), _log_decay(g), _head_major(delta))


@mx.compile
def _mask_steps(g, delta, steps):
    """The tape's ``g`` and ``delta`` [B, T, ...] with the steps from row b's ``steps[b]`` on made
    neutral (``g = 1``, ``delta = 0``)."""
    kept = mx.arange(g.shape[1])[None] < steps[:, None]
    return mx.where(kept[..., None], g, 1.0), mx.where(kept[..., None, None], delta, 0.0)


def gated_delta_chunked(q, k, v, g, beta, state, chunk: int = CHUNK):
    """Chunked recurrence: returns ``(y, final_state, delta_tape)`` like the reference."""
    if q.shape[1] <= chunk:  # a decode step or a verify block: no slicing (each slice is one more op)
        y, state, delta = (_chunk_one if q.shape[1] == 1 else _chunk_step)(q, k, v, g, beta, state)
        return y.astype(q.dtype), state, delta
    ys, deltas = [], []
    for s in range(0, q.shape[1], chunk):
        e = s + chunk
        y, state, delta = _chunk_step(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], state)
        ys.append(y)
        deltas.append(delta)
    y = ys[0] if len(ys) == 1 else mx.concatenate(ys, axis=1)
    return y.astype(q.dtype), state, deltas[0] if len(deltas) == 1 else mx.concatenate(deltas, axis=1)


def tape_replay_chunked(state, k, g, delta, steps: int):
    """Replay as one weighted sum per chunk (the algebra of ``_state_after``)."""
    for s in range(0, steps, CHUNK):
        e = min(s + CHUNK, steps)
        state = _replay_chunk(k[:, s:e], g[:, s:e], delta[:, s:e], state)
    return state


@mx.compile
def _replay_prefix(state, k, g, delta, steps: int, chunked: bool):
    """A rollback's replay, slicing included, as one compiled graph per (steps, form): a
    handful of tiny operations per layer otherwise, each paying a dispatch on CPU."""
    return (tape_replay_chunked if chunked else tape_replay_reference)(state, k, g, delta, steps)

