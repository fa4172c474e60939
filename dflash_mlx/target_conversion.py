"""Hugging Face target checkpoints (Qwen3.5 dense or mixture of experts, Qwen3, Qwen3-MoE, Llama)
-> text-only MLX checkpoints, streamed: tensor by tensor, shard by shard.

The default pair's first use converts Qwopus3.5-9B-Coder (about 18 GB in bf16) to 4-bit on Macs
with 18 GB of memory. MLX loads safetensors lazily and the module tree is built without
materializing a weight, so the whole conversion is one lazy graph per output tensor: each source
tensor is read when its output is evaluated, quantized, kept until its shard is full, written, and
freed; large tensors are read from the file a slice of rows at a time. The peak stays near one
shard plus one slice, whatever the model's size (measured: README, "Converting the Qwopus pair").
"""

from __future__ import annotations

import json
import resource
import shutil
import sys
from pathlib import Path
from typing import Callable, Dict, Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from . import loading
from .checkpoint_files import TARGET_FILES, TOKENIZER_FILES, refuse_existing, safetensors_header, staging, text_part
from .errors import ConversionError
from .quant import parse_quant

SHARD_BYTES = 512 * 1024**2


def peak_resident_bytes() -> int:
    """This process's peak resident memory so far (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


CHUNK_BYTES = 64 * 1024**2


def _quantize_slices(n_rows: int, K: int, itemsize: int, rows: Callable[[int, int], mx.array], group_size: int,
                     bits: int, chunk_bytes: int) -> list:
    """``mx.quantize`` of ``rows(start, stop)`` slices of about ``chunk_bytes``, concatenated: groups
    run along rows, so the result is the quantization of the whole, bit for bit, while the float
    temporaries (and, read from a file, the source) stay one slice big."""
    step = max(1, chunk_bytes // (K * itemsize))
    parts = []
    for start in range(0, n_rows, step):
        part = mx.quantize(rows(start, min(n_rows, start + step)), group_size, bits)
        mx.eval(part)
        mx.clear_cache()  # this slice's float temporaries
        parts.append(part)
    return [mx.concatenate([p[i] for p in parts]) if len(parts) > 1 else parts[0][i] for i in range(3)]


def quantize_rows(weight: mx.array, group_size: int, bits: int, chunk_bytes: int = CHUNK_BYTES):
    """``mx.quantize`` of an array a few rows at a time (a 248k-row embedding in 64 MB slices)."""
    shape, K = weight.shape, weight.shape[-1]
    flat = weight.reshape(-1, K)
    out = _quantize_slices(flat.shape[0], K, weight.dtype.size, lambda a, b: flat[a:b], group_size, bits, chunk_bytes)
    return [o.reshape(*shape[:-1], o.shape[-1]) for o in out]


DIRECT_READ_BYTES = 64 * 1024**2
_RAW = {"BF16": ("uint16", mx.bfloat16), "F16": ("uint16", mx.float16), "F32": ("float32", mx.float32)}


def row_readers(source: Path, module_path: Callable[[str], Optional[str]], min_bytes: int) -> Dict[str, Callable]:
    """For every 2-D float tensor of at least ``min_bytes`` that sanitizing only renames: a reader of
    its rows straight from the file (``rows(start, stop)``), so that quantizing it never holds the
    whole tensor (MLX's lazy load reads a tensor whole when any slice of it is evaluated)."""
    import numpy as np

    readers = {}
    for file in sorted(source.glob("*.safetensors")):
        header, data = safetensors_header(file)
        for name, entry in header.items():
            if name == "__metadata__" or entry["dtype"] not in _RAW or len(entry["shape"]) != 2:
                continue
            begin, end = entry["data_offsets"]
            key = module_path(name)
            if key is None or end - begin < min_bytes:
                continue
            raw, dtype = _RAW[entry["dtype"]]
            K = entry["shape"][1]

            def rows(start, stop, file=file, offset=data + begin, K=K, raw=raw, dtype=dtype):
                count = (stop - start) * K
                data = np.fromfile(file, dtype=raw, count=count, offset=offset + start * K * np.dtype(raw).itemsize)
                return mx.array(data.reshape(stop - start, K)).view(dtype)

            readers[key] = (tuple(entry["shape"]), dtype, rows)
    return readers


def quantize_from_file(reader, group_size: int, bits: int, chunk_bytes: int = CHUNK_BYTES):
    """``quantize_rows`` of a tensor read from disk a slice at a time (see ``row_readers``)."""
    (N, K), dtype, rows = reader
    return _quantize_slices(N, K, dtype.size, rows, group_size, bits, chunk_bytes)


Predicate = Callable[[str, nn.Module], Union[bool, dict]]


def quant_predicate(config: Dict) -> Optional[Predicate]:
    """mlx-lm's own recipe for this target, its model's ``quant_predicate`` (a mixture of experts
    keeps the router and the shared expert's gate at 8 bits, group 64: their rows decide which
    experts run; None for a dense target). Qwen3.5: mlx-lm's model itself, imported here only (it
    pulls in transformers); the other families: their model file's ``quant_predicate``, if any."""
    if loading.target_family(config) not in ("qwen3_5", "qwen3_5_moe"):
        return getattr(loading.target_module(config), "quant_predicate", None)
    from mlx_lm.models import qwen3_5 as mlx_lm_qwen3_5

    args = mlx_lm_qwen3_5.TextModelArgs.from_dict(dict(text_part(config)))
    return mlx_lm_qwen3_5.TextModel(args).quant_predicate  # the module tree is lazy: nothing is computed


def _quantized_form(path: str, module: nn.Module, weight: mx.array, bits: int, group_size: int,
                    predicate: Optional[Predicate]) -> Optional[dict]:
    """How a module's weight is quantized (None: kept as it is), as mlx-lm's converter decides
    (``mlx_lm.utils.quantize_model``: quantizable, rows a whole number of groups, then the model's
    ``predicate``)."""
    if not hasattr(module, "to_quantized") or weight.ndim < 2 or weight.shape[-1] % group_size:
        return None
    form = predicate(path, module) if predicate is not None else True
    if not form:
        return None
    form = form if isinstance(form, dict) else {"bits": bits, "group_size": group_size}
    return None if weight.shape[-1] % form["group_size"] else form


def _skeleton(config: Dict):
    """The target's module tree for ``config``, no weight materialized (MLX is lazy)."""
    module = loading.target_module(config)
    return module.Model(module.ModelArgs.from_dict(config))


def convert_tensors(source: Path, config: Dict, staging: Path, quant: Optional[tuple],
                    progress: Optional[Callable[[int, int, int], None]] = None,
                    shard_bytes: int = SHARD_BYTES, direct_read_bytes: int = DIRECT_READ_BYTES) -> Dict:
    """Write ``source``'s target weights to ``staging`` as MLX shards; returns the quantization
    block for the config (or {}). ``progress(done, total, peak_bytes)`` after each tensor; tensors
    of ``direct_read_bytes`` or more that are quantized are read from disk a slice at a time."""
    module_path = loading.target_module(config).module_path
    # the names mlx-lm's model of this family reads (gpt-oss: ``mlp.router``, ``mlp.experts``), so
    # that mlx-lm loads the folder too; our loader maps them back (``module_path``)
    written = getattr(loading.target_module(config), "checkpoint_path", lambda key: key)
    model = _skeleton(config)
    modules = dict(model.named_modules())
    expected = {k for k, _ in tree_flatten(model.parameters())}
    weights = model.sanitize(loading.read_weights(source))  # lazy: nothing read yet
    missing = sorted(expected - set(weights))
    unknown = sorted(set(weights) - expected)
    if missing or unknown:
        raise loading.CheckpointError(f"{source}: weights do not match its config (missing {missing[:3]}, "
                                      f"unexpected {unknown[:3]})")
    bits, group_size = quant or (None, None)
    direct = row_readers(source, module_path, direct_read_bytes) if quant else {}
    predicate = quant_predicate(config) if quant else None
    overrides: Dict[str, dict] = {}
    shard: Dict[str, mx.array] = {}
    shard_size, files, weight_map = 0, [], {}

    def flush():
        nonlocal shard, shard_size
        if not shard:
            return
        name = f"model-{len(files) + 1:05d}.safetensors"
        mx.save_safetensors(str(staging / name), shard, metadata={"format": "mlx"})
        files.append(name)
        weight_map.update({k: name for k in shard})
        shard, shard_size = {}, 0
        mx.clear_cache()

    names = sorted(weights)
    for i, key in enumerate(names):
        value = weights.pop(key)  # dropped from the graph's roots: freed once written
        path, _, leaf = key.rpartition(".")
        form = _quantized_form(path, modules.get(path), value, bits, group_size, predicate) if quant and leaf == "weight" else None
        if form is None:
            out = {key: value}
        else:
            if key in direct and direct[key][0] == tuple(value.shape):
                w, scales, biases = quantize_from_file(direct[key], form["group_size"], form["bits"])
            else:
                w, scales, biases = quantize_rows(value, form["group_size"], form["bits"])
            out = {key: w, f"{path}.scales": scales, f"{path}.biases": biases}
            if (form["bits"], form["group_size"]) != (bits, group_size):
                overrides[written(path)] = {"bits": form["bits"], "group_size": form["group_size"]}
        out = {written(k): v for k, v in out.items()}
        mx.eval(out)
        del value
        mx.clear_cache()  # the source tensor's buffer goes back to the system, not to MLX's cache
        shard.update(out)
        shard_size += sum(a.nbytes for a in out.values())
        if shard_size >= shard_bytes:
            flush()
        if progress is not None:
            progress(i + 1, len(names), peak_resident_bytes())
    flush()
    index = {"metadata": {"total_size": sum((staging / f).stat().st_size for f in files)}, "weight_map": weight_map}
    (staging / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    if not quant:
        return {}
    return {"group_size": group_size, "bits": bits, "mode": "affine", **overrides}


def text_config(config: Dict) -> Dict:
    """The text model's config, as a text-only checkpoint of its kind declares it (a Qwen3.5
    release's ``text_config``; Qwen3, Qwen3-MoE and Llama configs are text-only already)."""
    text = dict(text_part(config))
    if loading.target_family(config) in ("qwen3_5", "qwen3_5_moe"):
        moe = loading.target_kind(config) == "moe"
        text["model_type"] = "qwen3_5_moe_text" if moe else "qwen3_5_text"
        text["architectures"] = ["Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"]
    for key in ("tie_word_embeddings", "eos_token_id"):
        if key not in text and key in config:
            text[key] = config[key]
    for key in ("quantization", "quantization_config"):
        text.pop(key, None)
    return text


def convert_target(model: str, output: str | Path, quant: Optional[str] = None, revision: Optional[str] = None,
                   force: bool = False, progress: Optional[Callable[[int, int, int], None]] = None) -> Path:
    """A Hugging Face target checkpoint (Qwen3.5 dense or MoE, Qwen3, Qwen3-MoE, Llama; local folder
    or repo) -> a text-only MLX checkpoint, optionally 4/8-bit, written shard by shard (see the
    module's docstring)."""
    output = Path(output)
    refuse_existing(output, force)
    parsed = parse_quant(quant)  # a bad spec fails before any download
    source, _ = loading.fetch(model, TARGET_FILES, revision)
    config = loading.read_config(source)
    if loading.mlx_quantization(config):
        raise ConversionError(f"{source} is already an MLX quantized checkpoint: load it as it is")
    try:
        loading.target_kind(config)
    except loading.CheckpointError as e:
        raise ConversionError(str(e)) from e
    with staging(output, force) as folder:
        quantization = convert_tensors(source, config, folder, parsed, progress)
        text = text_config(config)
        if quantization:
            text["quantization"] = quantization
        (folder / "config.json").write_text(json.dumps(text, indent=2))
        for name in TOKENIZER_FILES:
            if name != "config.json" and (source / name).exists():
                shutil.copy(source / name, folder / name)
    return output

