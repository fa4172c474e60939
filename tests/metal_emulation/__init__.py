"""A stand-in for ``mx.fast.metal_kernel`` that runs Metal kernel bodies on the CPU.

``EmulatedMetal()`` is called like ``mx.fast.metal_kernel`` (name, input and output names, body
source) and returns a kernel called like MLX's (inputs, template, grid, threadgroup, output shapes
and dtypes). It generates the kernel source the way MLX does (``mlx/backend/common/
metal_kernel.cpp``, ``write_signature``, MLX 0.30-0.32): template parameters from ``template``;
each input declared with its array's own dtype, in the ``constant`` address space when it has
fewer than 8 elements and ``device`` otherwise, a 0-d input (a Python scalar) as a ``constant``
reference; ``NAME_shape`` / ``NAME_strides`` / ``NAME_ndim`` buffers for the inputs whose names
the body mentions; ``device`` output pointers of the given dtypes; one parameter per Metal thread
attribute the body mentions; and the explicit instantiation. So a renamed input, a missing
template argument, an undeclared name, a dtype that differs from the one the body assumes or an
address-space mismatch fails here as it would on a Mac.

That source is then compiled twice: parsed by Clang's front end (libclang) with the address
spaces as real Clang address spaces (``metal_shim.h`` with ``EMU_CHECK_ADDRESS_SPACES``), and
built by g++ against the runtime shim into a library whose entry point runs the whole grid, every
GPU thread a real thread (see ``metal_shim.h``). Outputs start as NaN, as uninitialised GPU
memory would hold garbage, unless ``init_value`` is given.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import mlx.core as mx
import numpy as np

HERE = Path(__file__).resolve().parent
PARALLEL, LOWEST_FIRST, HIGHEST_FIRST = 0, 1, 2
SCHEDULES = (PARALLEL, LOWEST_FIRST, HIGHEST_FIRST)
# No _FORTIFY_SOURCE: its longjmp check refuses the fibers' jumps between stacks. No GNU unique
# symbols: a kernel's `threadgroup` variables are statics of a template function named by the
# kernel and its template, which g++ would make one object per process across libraries, so that
# a mutant would share its threadgroup memory with the kernel it mutates (and read the table or
# tile the other left there).
_FLAGS = ["-std=c++20", "-O1", "-fPIC", "-pthread", "-ffp-contract=off", "-Wno-attributes", "-U_FORTIFY_SOURCE",
          "-fno-gnu-unique"]

# MLX: "Inputs with fewer elements are passed in the constant address space".
MAX_CONSTANT_ARRAY_SIZE = 8
# MLX's get_type_string, and the host-side numpy type of each (bfloat16 travels as its bits).
TYPE_STRINGS = {
    mx.float32: ("float", np.float32), mx.float16: ("float16_t", np.float16), mx.bfloat16: ("bfloat16_t", np.uint16),
    mx.bool_: ("bool", np.bool_), mx.int8: ("int8_t", np.int8), mx.int16: ("int16_t", np.int16),
    mx.int32: ("int32_t", np.int32), mx.int64: ("int64_t", np.int64), mx.uint8: ("uint8_t", np.uint8),
    mx.uint16: ("uint16_t", np.uint16), mx.uint32: ("uint32_t", np.uint32), mx.uint64: ("uint64_t", np.uint64),
}
# The thread attributes MLX declares when a body's source mentions them, in MLX's order.
METAL_ATTRIBUTES = [
    ("dispatch_quadgroups_per_threadgroup", "uint"), ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"), ("grid_origin", "uint3"), ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"), ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"), ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"), ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"), ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"), ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"), ("threadgroups_per_grid", "uint3"), ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"), ("threads_per_threadgroup", "uint3"),
]
_ATTRIBUTE_LIST = re.compile(r"\s*\[\[[^\[\]]*\]\]")


class MetalCompileError(RuntimeError):
    """The generated source does not compile (MLX raises a RuntimeError at evaluation)."""


def compiler() -> str:
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("the Metal emulation needs a C++20 compiler (g++)")
    return cxx


def to_array(value) -> mx.array:
    """MLX's conversion of a kernel input: Python bool, int and float become 0-d arrays."""
    if isinstance(value, mx.array):
        return value
    if isinstance(value, bool):
        return mx.array(value, dtype=mx.bool_)
    if isinstance(value, int):
        return mx.array(value, dtype=mx.int32)
    if isinstance(value, float):
        return mx.array(value, dtype=mx.float32)
    raise TypeError(f"metal_kernel input of type {type(value).__name__} is neither an array nor a scalar")


def _template_value(value) -> str:
    if isinstance(value, mx.Dtype):
        return TYPE_STRINGS[value][0]
    if isinstance(value, bool):
        return str(int(value))  # MLX streams a bool as 1 / 0
    return str(value)


class GeneratedKernel:
    """MLX's generated source for one call, and the C++ launcher that runs it."""

    def __init__(self, name, input_names, output_names, source, header, inputs, output_dtypes, template,
                 typed_names: bool = True):
        self.parameters: List[tuple] = []  # (C++ type, how the launcher passes it, buffer kind)
        template = list(template or [])
        kernel_name = "custom_kernel_" + name
        template_def = ""
        if template:
            template_def = "<" + ", ".join(_template_value(v) for _, v in template) + ">"
            kernel_name += "_" + re.sub(r"[<>]|, ", "_", template_def)[:-1]  # MLX's make_template_hash: pop_back
        if typed_names:  # MLX 0.32 on; 0.30 and 0.31 name a source by its name and template only
            for arr in inputs:
                kernel_name += "_" + TYPE_STRINGS[arr.dtype][0] + ("s" if arr.ndim == 0 else "c" if arr.size < MAX_CONSTANT_ARRAY_SIZE else "")
            for dtype in output_dtypes:
                kernel_name += "_" + TYPE_STRINGS[dtype][0]
        self.kernel_name = kernel_name

        lines = []
        if template:
            kinds = ["typename" if isinstance(v, mx.Dtype) else "bool" if isinstance(v, bool) else "int" for _, v in template]
            lines.append("template <" + ", ".join(f"{k} {n}" for k, (n, _) in zip(kinds, template)) + ">")
        lines.append(f"[[kernel]] void {kernel_name}(")
        params = []
        index = 0
        for name_, arr in zip(input_names, inputs):
            location = "constant" if arr.size < MAX_CONSTANT_ARRAY_SIZE else "device"
            ref = "&" if arr.ndim == 0 else "*"
            params.append(f"  const {location} {TYPE_STRINGS[arr.dtype][0]}{ref} {name_} [[buffer({index})]]")
            self.parameters.append((f"const {location} {TYPE_STRINGS[arr.dtype][0]}", ref, ("input", name_)))
            index += 1
            if arr.ndim > 0:
                for suffix, ctype, ref_ in (("_shape", "int", "*"), ("_strides", "int64_t", "*"), ("_ndim", "int", "&")):
                    if name_ + suffix in source:
                        params.append(f"  const constant {ctype}{ref_} {name_}{suffix} [[buffer({index})]]")
                        self.parameters.append((f"const constant {ctype}", ref_, (suffix[1:], name_)))
                        index += 1
        for name_, dtype in zip(output_names, output_dtypes):
            params.append(f"  device {TYPE_STRINGS[dtype][0]}* {name_} [[buffer({index})]]")
            self.parameters.append((f"device {TYPE_STRINGS[dtype][0]}", "*", ("output", name_)))
            index += 1
        self.attributes = [(attr, ctype) for attr, ctype in METAL_ATTRIBUTES if attr in source]
        params += [f"  {ctype} {attr} [[{attr}]]" for attr, ctype in self.attributes]
        signature = "\n".join(lines) + "\n" + ",\n".join(params) + ") {\n"
        instantiation = ""
        if template:
            full = kernel_name + template_def
            instantiation = f'\ntemplate [[host_name("{kernel_name}")]] [[kernel]] decltype({full}) {full};\n'
        self.metal_source = header + signature + source + "\n}\n" + instantiation
        # C++ spells the same source without Metal's attribute lists (signature and instantiation only).
        self.cpp_kernel = header + _ATTRIBUTE_LIST.sub("", signature) + source + "\n}\n" + _ATTRIBUTE_LIST.sub("", instantiation)
        self.call = kernel_name + template_def

    def translation_unit(self) -> str:
        args = []
        for i, (ctype, ref, _) in enumerate(self.parameters):
            args.append(f"*({ctype}*)(buffers[{i}])" if ref == "&" else f"({ctype}*)(buffers[{i}])")
        args += [f"t.{attr}" for attr, _ in self.attributes]
        joined = ",\n        ".join(args)
        return (
            '#include "metal_shim.h"\n'
            + self.cpp_kernel
            + "\nextern \"C\" void emu_launch(void** buffers, const unsigned* dims, int schedule) {\n"
            + "  emu::dispatch({dims[0], dims[1], dims[2]}, {dims[3], dims[4], dims[5]}, schedule,\n"
            + "      [](const emu::Thread& t, void* context) {\n      void** buffers = static_cast<void**>(context);\n"
            + f"      {self.call}(\n        {joined});\n      }}, buffers);\n}}\n"
        )


def _front_end_errors(text: str) -> List[str]:
    """Clang's errors for the translation unit with Metal's address spaces as Clang's."""
    try:
        from clang import cindex
    except ImportError as e:  # pragma: no cover - a test dependency
        raise RuntimeError("the Metal emulation needs libclang (pip install libclang)") from e
    unit = cindex.Index.create().parse(
        "kernel.cpp", args=["-x", "c++", "-std=c++20", "-DEMU_CHECK_ADDRESS_SPACES", f"-I{HERE}",
                            "-Wno-unknown-attributes", "-nostdinc++"],
        unsaved_files=[("kernel.cpp", text)],
    )
    return [f"line {d.location.line}: {d.spelling}" for d in unit.diagnostics if d.severity >= cindex.Diagnostic.Error]


_LIBRARIES: Dict[str, ctypes.CDLL] = {}


def _build_dir() -> Path:
    """Where built kernels are kept, shared by processes (pytest's workers) and runs: named by the
    shim's and the flags' hash, each library by its translation unit's, so nothing stale is reused."""
    shim = (HERE / "metal_shim.h").read_bytes() + (HERE / "metal_runtime.cpp").read_bytes()
    version = hashlib.sha256(shim + " ".join(_FLAGS).encode()).hexdigest()[:16]
    folder = Path(tempfile.gettempdir()) / f"dflash-metal-emu-{os.getuid()}" / version
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _publish(build, target: Path) -> None:
    """Run ``build(partial_path)`` and move the result into place atomically (concurrent builders
    of the same file each produce a whole one)."""
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    build(partial)
    os.replace(partial, target)


def _compile(command: List[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise MetalCompileError(f"Unable to build metal library from source:\n{done.stderr}")


RUNTIME = "libmetal_runtime.so"


def _shim_and_runtime(folder: Path) -> Path:
    """The shim as a precompiled header (halves each kernel's compile time), and the scheduler's
    library every kernel links to (built once, not in every kernel)."""
    header = folder / "metal_shim.h"
    if not (folder / "metal_shim.h.gch").exists():
        _publish(lambda p: shutil.copyfile(HERE / "metal_shim.h", p), header)
        _publish(lambda p: _compile([compiler(), *_FLAGS, "-x", "c++-header",
                                     str(header), "-o", str(p)]), folder / "metal_shim.h.gch")
    if not (folder / RUNTIME).exists():
        _publish(lambda p: _compile([compiler(), *_FLAGS, "-shared", f"-I{folder}", str(HERE / "metal_runtime.cpp"),
                                     "-o", str(p)]), folder / RUNTIME)
    return folder


def build(text: str) -> ctypes.CDLL:
    """Check and compile one translation unit (cached in memory and on disk by its text)."""
    key = hashlib.sha256(text.encode()).hexdigest()[:20]
    if key in _LIBRARIES:
        return _LIBRARIES[key]
    errors = _front_end_errors(text)
    if errors:
        raise MetalCompileError("Unable to build metal library from source:\n" + "\n".join(errors))
    folder = _build_dir()
    library = folder / f"{key}.so"
    if not library.exists():
        source = folder / f"{key}.cpp"
        _publish(lambda p: p.write_text(text), source)
        include = _shim_and_runtime(folder)
        _publish(lambda p: _compile([compiler(), *_FLAGS, "-shared", "-Winvalid-pch", f"-I{include}", str(source),
                                     str(include / RUNTIME), f"-Wl,-rpath,{include}", "-o", str(p)]), library)
    _LIBRARIES[key] = ctypes.CDLL(str(library))
    return _LIBRARIES[key]


def _host(x: mx.array) -> np.ndarray:
    """Row-contiguous host copy (MLX's ensure_row_contiguous), bfloat16 as its bits."""
    data = np.array(x.view(mx.uint16)) if x.dtype == mx.bfloat16 else np.array(x)
    return np.ascontiguousarray(data)


class EmulatedKernel:
    """What ``EmulatedMetal(...)`` returns: called like the function MLX's ``metal_kernel`` returns."""

    def __init__(self, factory: "EmulatedMetal", name, input_names, output_names, source, header):
        if not output_names:
            raise ValueError("[metal_kernel] Must specify at least one output.")
        self.factory, self.name, self.header = factory, name, header
        self.input_names, self.output_names = list(input_names), list(output_names)
        # Mutants are keyed by the kernel's own name (kernels.kernel_name appends the call signature).
        self.source = factory.sources.get(name, factory.sources.get(name.split("__")[0], source))

    def __call__(self, *, inputs, output_shapes, output_dtypes, grid, threadgroup, template=None, init_value=None,
                 verbose=False, stream=None):
        for given, names, what in ((inputs, self.input_names, "inputs"), (output_shapes, self.output_names, "output_shapes"),
                                   (output_dtypes, self.output_names, "output_dtypes")):
            if len(given) != len(names):
                raise ValueError(f"[metal_kernel] Expected `{what}` to have size {len(names)} but got size {len(given)}.")
        arrays = [to_array(x) for x in inputs]
        generated = GeneratedKernel(self.name, self.input_names, self.output_names, self.source, self.header, arrays,
                                    output_dtypes, template, typed_names=self.factory.mlx_version >= (0, 32))
        # MLX's library cache (custom_kernel.cpp): one library per kernel name; a name whose source
        # changed is cleared and built again.
        cached = self.factory.libraries.get(generated.kernel_name)
        if cached is not None and cached != generated.metal_source:
            self.factory.rebuilds += 1
        self.factory.libraries[generated.kernel_name] = generated.metal_source
        if verbose:
            print(f"Generated source code for `{self.name}`:\n```\n{generated.metal_source}\n```")
        library = build(generated.translation_unit())
        hosts = {name: _host(a) for name, a in zip(self.input_names, arrays)}
        outputs = {}
        for name, shape, dtype in zip(self.output_names, output_shapes, output_dtypes):
            np_type = TYPE_STRINGS[dtype][1]
            if init_value is None:
                out = np.empty(tuple(shape), np_type)
                out.view(np.uint8)[...] = 0xFF  # NaN in every float format: unwritten outputs show
            else:
                filled = mx.full(tuple(shape), init_value, dtype=dtype)
                out = _host(filled).copy()
            outputs[name] = out
        keep: List[np.ndarray] = []
        pointers = []
        for _, _, (kind, name) in generated.parameters:
            if kind == "input":
                buffer = hosts[name]
            elif kind == "output":
                buffer = outputs[name]
            elif kind == "shape":
                buffer = np.array(hosts[name].shape, np.int32)
            elif kind == "strides":
                buffer = np.array([s // hosts[name].itemsize for s in hosts[name].strides], np.int64)
            else:  # ndim
                buffer = np.array(hosts[name].ndim, np.int32)
            keep.append(buffer)
            pointers.append(buffer.ctypes.data_as(ctypes.c_void_p))
        dims = (ctypes.c_uint * 6)(*grid, *threadgroup)
        library.emu_launch((ctypes.c_void_p * len(pointers))(*pointers), dims, self.factory.schedule)
        results = []
        for name, dtype in zip(self.output_names, output_dtypes):
            out = mx.array(outputs[name])
            results.append(out.view(mx.bfloat16) if dtype == mx.bfloat16 else out)
        return results


class EmulatedMetal:
    """Stand-in for ``mx.fast.metal_kernel``; ``sources`` replaces kernel bodies by name (mutants),
    ``schedule`` picks how a threadgroup's threads interleave (see ``metal_shim.h``),
    ``mlx_version`` how generated kernels are named (``rebuilds`` counts the libraries MLX's cache
    would clear and build again because one name stood for another source)."""

    def __init__(self, schedule: int = PARALLEL, sources: Optional[Dict[str, str]] = None, mlx_version=(0, 32)):
        self.schedule = schedule
        self.sources = dict(sources or {})
        self.mlx_version = tuple(mlx_version)
        self.libraries: Dict[str, str] = {}
        self.rebuilds = 0

    def __call__(self, name: str, input_names: Sequence[str], output_names: Sequence[str], source: str, header: str = "",
                 ensure_row_contiguous: bool = True, atomic_outputs: bool = False) -> EmulatedKernel:
        if atomic_outputs:
            raise NotImplementedError("the emulator has no atomic outputs (no kernel of ours uses them)")
        return EmulatedKernel(self, name, input_names, output_names, source, header)


def mutated_sources(kernel: str, original: str, broken: str) -> Dict[str, str]:
    """One kernel's shipped body with ``original`` replaced by ``broken`` (which must occur once)."""
    from dflash_mlx import kernels

    source = kernels.kernel_source(kernel)
    if source.count(original) != 1:
        raise AssertionError(f"mutation of {kernel} no longer applies: {original!r} occurs {source.count(original)} times")
    return {kernel: source.replace(original, broken)}
