"""Builds and runs the Metal kernels on the CPU (see metal_shim.h for how)."""

from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Dict, Optional

import mlx.core as mx
import numpy as np

from dflash_mlx import kernels

HERE = Path(__file__).resolve().parent
PARALLEL, LOWEST_FIRST, HIGHEST_FIRST = 0, 1, 2
SCHEDULES = (PARALLEL, LOWEST_FIRST, HIGHEST_FIRST)
_BUILD_DIR = Path(tempfile.mkdtemp(prefix="dflash-metal-emu-"))
_DTYPES = {mx.float32: ("float32", np.float32), mx.float16: ("float16", np.float16), mx.bfloat16: ("bfloat16", np.uint16)}


def compiler() -> str:
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("the Metal emulation needs a C++20 compiler (g++)")
    return cxx


class EmulatedKernels:
    """The two kernels compiled for one shape (Dk, Dv, Hk, Hv), optionally with edited sources."""

    def __init__(self, Dk: int, Dv: int, Hk: int, Hv: int, sources: Optional[Dict[str, str]] = None):
        sources = sources or {name: kernels.kernel_source(name) for name in kernels.KERNEL_NAMES}
        self.shape = (Dk, Dv, Hk, Hv)
        key = hashlib.sha256(repr((self.shape, sorted(sources.items()))).encode()).hexdigest()[:16]
        build = _BUILD_DIR / key
        library = build / "kernels.so"
        if not library.exists():
            build.mkdir(parents=True, exist_ok=True)
            for name, text in sources.items():
                (build / f"{name}.metal").write_text(text)
            command = [
                compiler(), "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-ffp-contract=off",
                f"-I{HERE}", f"-DDK={Dk}", f"-DDV={Dv}", f"-DHK={Hk}", f"-DHV={Hv}",
                f'-DGATED_DELTA_TAPE_SOURCE="{build / "gated_delta_tape.metal"}"',
                f'-DTAPE_REPLAY_SOURCE="{build / "tape_replay.metal"}"',
                str(HERE / "harness.cpp"), "-o", str(library),
            ]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"emulated kernel build failed:\n{done.stderr}")
        self.lib = ctypes.CDLL(str(library))

    @staticmethod
    def _host(x: mx.array):
        suffix, np_type = _DTYPES[x.dtype]
        data = np.array(x.view(mx.uint16)) if x.dtype == mx.bfloat16 else np.array(x)
        return np.ascontiguousarray(data.astype(np_type, copy=False)), suffix

    @staticmethod
    def _ptr(a: np.ndarray):
        return a.ctypes.data_as(ctypes.c_void_p)

    @staticmethod
    def _device(a: np.ndarray, dtype) -> mx.array:
        if dtype == mx.bfloat16:
            return mx.array(a).view(mx.bfloat16)
        return mx.array(a)

    def gated_delta(self, q, k, v, g, beta, state, rows_per_group=4, schedule=PARALLEL):
        B, T, _, _ = q.shape
        Dv, Hv = self.shape[1], self.shape[3]
        qh, suffix = self._host(q)
        kh, _ = self._host(k)
        vh, _ = self._host(v)
        bh, _ = self._host(beta.astype(q.dtype))
        gh = np.ascontiguousarray(np.array(g.astype(mx.float32)))
        sh = np.ascontiguousarray(np.array(state.astype(mx.float32)))
        y = np.zeros((B, T, Hv, Dv), qh.dtype)
        state_out = np.zeros_like(sh)
        delta = np.zeros((B, T, Hv, Dv), np.float32)
        getattr(self.lib, f"gated_delta_tape_{suffix}")(
            self._ptr(qh), self._ptr(kh), self._ptr(vh), self._ptr(gh), self._ptr(bh), self._ptr(sh),
            B, T, self._ptr(y), self._ptr(state_out), self._ptr(delta), rows_per_group, schedule,
        )
        return self._device(y, q.dtype), mx.array(state_out), mx.array(delta)

    def tape_replay(self, state, k, g, delta, steps, rows_per_group=4, schedule=PARALLEL):
        B, T = k.shape[:2]
        kh, suffix = self._host(k)
        gh = np.ascontiguousarray(np.array(g.astype(mx.float32)))
        dh = np.ascontiguousarray(np.array(delta.astype(mx.float32)))
        sh = np.ascontiguousarray(np.array(state.astype(mx.float32)))
        state_out = np.zeros_like(sh)
        getattr(self.lib, f"tape_replay_{suffix}")(
            self._ptr(sh), self._ptr(kh), self._ptr(gh), self._ptr(dh), B, T, steps, self._ptr(state_out),
            rows_per_group, schedule,
        )
        return mx.array(state_out)
