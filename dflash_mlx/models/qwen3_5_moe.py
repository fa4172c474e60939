"""Qwen3.5/3.6 mixture-of-experts targets (``qwen3_5_moe``: 35B-A3B, 122B-A10B).

The dense target (``qwen3_5``: Gated DeltaNet, gated attention, taps, rollback tape) with a sparse
block as every layer's MLP: a router ``Linear(H, E)`` with a float32 softmax, the top k of it
renormalized, SwiGLU experts (mlx-lm's ``SwitchGLU``: the T tokens of a verify pass go through
the experts in one batched gather), and a shared expert scaled by ``sigmoid(shared_expert_gate)``.

Exactness under verification: a token's experts must not depend on how many tokens are verified
with it. The router is the one place where a near-tie between two experts turns rounding into a
different computation, so up to ``ROW_INDEPENDENT_ROWS`` tokens are routed one token at a time
(each exactly as a decode step computes it) or, for a quantized router on Metal, through the
verify-matmul kernel, whose rows do not depend on each other.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchGLU

from .. import quantized
from . import qwen3_5
from .layers import MLP

ROW_INDEPENDENT_ROWS = quantized.MAX_ROWS  # verify blocks; prefill chunks route in one call
_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp)\.experts\.(gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_STACKED = re.compile(r"^(model\.layers\.\d+\.mlp)\.switch_mlp\.")


@dataclass
class ModelArgs(qwen3_5.ModelArgs):
    model_type: str = "qwen3_5_moe_text"
    num_experts: int = 256
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    norm_topk_prob: bool = True

    def __post_init__(self):
        super().__post_init__()
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} must be in 1..num_experts ({self.num_experts})")


class SparseMoeBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        H = args.hidden_size
        self.top_k = args.num_experts_per_tok
        self.norm_topk_prob = args.norm_topk_prob
        self.gate = nn.Linear(H, args.num_experts, bias=False)
        self.switch_mlp = SwitchGLU(H, args.moe_intermediate_size, args.num_experts)
        self.shared_expert = MLP(H, args.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(H, 1, bias=False)
        # MLX's CPU gather_mm computes only in float32: unquantized experts are cast once at load
        # there (Model.experts_in_float32), and their inputs with each call. A plain attribute.
        self.float32_experts = False

    def router_logits(self, x: mx.array) -> mx.array:
        """[..., E] logits, each token's computed exactly as a one-token call computes it."""
        rows = x.size // x.shape[-1]
        if rows > ROW_INDEPENDENT_ROWS:
            return self.gate(x)
        logits = quantized.kernel_rows(self.gate, x)  # a quantized router on Metal: one call, rows independent
        if logits is not None:
            return logits
        if rows == 1:
            return self.gate(x)
        flat = x.reshape(rows, 1, x.shape[-1])
        return mx.concatenate([self.gate(flat[i]) for i in range(rows)], axis=0).reshape(*x.shape[:-1], -1)

    def route(self, x: mx.array):
        """(expert indices [..., k], their renormalized weights in float32)."""
        probs = mx.softmax(self.router_logits(x).astype(mx.float32), axis=-1)
        indices = mx.argpartition(probs, kth=-self.top_k, axis=-1)[..., -self.top_k:]
        weights = mx.take_along_axis(probs, indices, axis=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        return indices, weights

    def __call__(self, x: mx.array) -> mx.array:
        indices, weights = self.route(x)
        experts_in = x.astype(mx.float32) if self.float32_experts else x
        y = self.switch_mlp(experts_in, indices)
        y = (y * weights[..., None].astype(y.dtype)).sum(axis=-2).astype(x.dtype)
        return y + mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class Model(qwen3_5.Model):
    def __init__(self, args: ModelArgs):
        super().__init__(args, feed_forward=SparseMoeBlock)

    def experts_in_float32(self) -> "Model":
        """Unquantized experts in float32 (MLX's CPU gather_mm has no other dtype)."""
        for layer in self.layers:
            moe = layer.mlp
            if "scales" in moe.switch_mlp.gate_proj:  # quantized: gather_qmm runs in any dtype
                continue
            moe.switch_mlp.set_dtype(mx.float32)
            moe.float32_experts = True
        return self

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """Every published expert layout -> stacked ``switch_mlp`` experts, then the dense mapping:
        HF's fused ``experts.gate_up_proj`` [E, 2I, H] (gate half first) and ``experts.down_proj``
        [E, H, I]; one tensor per expert (``experts.{e}.{gate,up,down}_proj.weight``: FP8/NVFP4
        releases, fine-tunes, transformers 5's own save); MLX's stacked ``switch_mlp``."""
        mapped = {}
        for key, value in weights.items():
            path = qwen3_5.module_path(key)
            if path is not None:
                mapped[path] = value
        layouts: Dict[str, List[str]] = {}
        per_expert: Dict[str, Dict[str, Dict[int, mx.array]]] = {}
        out = {}
        for key, value in mapped.items():
            if m := _FUSED.match(key):
                layouts.setdefault("fused (experts.gate_up_proj)", []).append(m.group(1))
                if m.group(2) == "gate_up_proj":
                    half = value.shape[-2] // 2
                    out[f"{m.group(1)}.switch_mlp.gate_proj.weight"] = value[..., :half, :]
                    out[f"{m.group(1)}.switch_mlp.up_proj.weight"] = value[..., half:, :]
                else:
                    out[f"{m.group(1)}.switch_mlp.down_proj.weight"] = value
            elif m := _PER_EXPERT.match(key):
                layouts.setdefault("one tensor per expert (experts.N.*_proj)", []).append(m.group(1))
                per_expert.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = value
            else:
                if m := _STACKED.match(key):
                    layouts.setdefault("stacked (switch_mlp)", []).append(m.group(1))
                out[key] = value
        if len(layouts) > 1:
            found = "; ".join(f"{name} in {sorted(set(where))[0]}..." for name, where in layouts.items())
            raise ValueError(f"the checkpoint mixes expert layouts ({found}): convert it with one layout")
        E = self.args.num_experts
        for prefix, projections in per_expert.items():
            for name, experts in projections.items():
                if sorted(experts) != list(range(E)):
                    missing = sorted(set(range(E)) - set(experts))[:5]
                    raise ValueError(f"{prefix}.experts: {name} missing for experts {missing} (of {E})")
                out[f"{prefix}.switch_mlp.{name}.weight"] = mx.stack([experts[e] for e in range(E)])
        return super().sanitize(out)
