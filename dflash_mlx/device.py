"""What this machine's MLX device is, and the defaults that depend on it."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

# Apple GPU architecture generation (MLX reports e.g. "applegpu_g15s") -> the chip family.
APPLE_GPU_GENERATIONS = {13: "M1", 14: "M2", 15: "M3", 16: "M4", 17: "M5"}
# Generations whose GPUs users reported drafting badly in 16-bit: on M1/M2, a w4 draft whose
# activations ran in float16/bfloat16 accepted 6% of its tokens, the same draft with float32
# activations 75% (reports from M1/M2 users of MLX DFlash ports). Those GPUs lack native
# bfloat16 arithmetic, so its emulation and the narrower float16 range cost the draft its
# agreement with the target. There the draft computes in float32 by default.
WITHOUT_NATIVE_BFLOAT16 = (13, 14)


@dataclass(frozen=True)
class DeviceFacts:
    name: str
    architecture: str
    metal: bool
    generation: Optional[int]  # Apple GPU generation, None off Apple GPUs
    memory_bytes: Optional[int]
    recommended_working_set: Optional[int]

    @property
    def family(self) -> str:
        if self.generation is None:
            return "not an Apple GPU"
        chip = APPLE_GPU_GENERATIONS.get(self.generation, "newer than M5" if self.generation > 17 else "before M1")
        return f"{chip} (Apple GPU generation {self.generation})"

    @property
    def native_bfloat16(self) -> Optional[bool]:
        return None if self.generation is None else self.generation not in WITHOUT_NATIVE_BFLOAT16


def _total_ram() -> Optional[int]:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def facts() -> DeviceFacts:
    """The default device as MLX describes it (``mx.device_info``)."""
    metal = mx.metal.is_available()
    info = {}
    try:
        info = mx.device_info()
    except Exception:  # older MLX: only mx.metal.device_info, and only on a Mac
        if metal:
            info = mx.metal.device_info()
    architecture = str(info.get("architecture", ""))
    match = re.search(r"applegpu_g(\d+)", architecture)
    return DeviceFacts(
        name=str(info.get("device_name", "unknown")),
        architecture=architecture or "unknown",
        metal=metal,
        generation=int(match.group(1)) if match else None,
        memory_bytes=info.get("memory_size") or _total_ram(),
        recommended_working_set=info.get("max_recommended_working_set_size"),
    )


def draft_activation_dtype(device: Optional[DeviceFacts] = None) -> Optional[mx.Dtype]:
    """float32 on GPUs without native bfloat16 (see WITHOUT_NATIVE_BFLOAT16); else None
    (the draft computes in its checkpoint's dtype)."""
    device = device or facts()
    return mx.float32 if device.metal and device.native_bfloat16 is False else None
