"""The quantization spec the command line and the converters take: ``w4``, ``w8``, ``w4:gs32`` …
or ``none`` (a leaf: the converters, the draft, the loader and doctor read it alike)."""

from __future__ import annotations

from typing import Optional, Tuple


def parse_quant(spec: Optional[str]) -> Optional[Tuple[int, int]]:
    """``w4``, ``w8``, ``w4:gs32``, ``none`` -> (bits, group_size) or None."""
    if spec is None or spec.strip().lower() in ("", "none", "bf16", "fp16"):
        return None
    text = spec.strip().lower()
    bits_part, _, gs_part = text.partition(":")
    try:
        if not bits_part.startswith("w"):
            raise ValueError
        bits = int(bits_part[1:])
        group_size = int(gs_part[2:]) if gs_part else 64
        if gs_part and not gs_part.startswith("gs"):
            raise ValueError
    except ValueError:
        raise ValueError(f"bad quantization {spec!r}: use w4, w8, w4:gs32, w8:gs128 or none") from None
    if bits not in (2, 3, 4, 5, 6, 8):
        raise ValueError(f"bad quantization {spec!r}: bits must be one of 2, 3, 4, 5, 6, 8")
    if group_size not in (32, 64, 128):
        raise ValueError(f"bad quantization {spec!r}: group size must be 32, 64 or 128")
    return bits, group_size
