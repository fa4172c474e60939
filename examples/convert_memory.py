"""Peak resident memory of `dflash-mlx convert-target` against `mlx_lm.convert` on the same files.

Writes a synthetic bf16 Qwen3.5 checkpoint in the released multimodal layout (the one mlx-lm's
converter reads): Qwen3.5-2B's field shapes, 8 layers, vocabulary 248320, untied head, about
1.6B parameters in 1 GB shards. Then runs both converters to 4-bit under `/usr/bin/time -v`
(Linux) and prints each one's peak resident set, the output's size and the largest bf16 tensor.

    python examples/convert_memory.py [--work /tmp/convert-memory] [--layers 8] [--keep]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx

GB = 1024**3
CONFIG = dict(  # Qwen3.5-2B's text fields, fewer layers
    hidden_size=2048, intermediate_size=8192, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, vocab_size=248320, rms_norm_eps=1e-6, tie_word_embeddings=False,
    full_attention_interval=4, max_position_embeddings=262144, hidden_act="silu", attn_output_gate=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
)


def tensors(config: dict):
    """(name, shape) of every tensor, in the multimodal release's names."""
    H, I, V = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kd = config["linear_num_key_heads"] * config["linear_key_head_dim"]
    vd = config["linear_num_value_heads"] * config["linear_value_head_dim"]
    hv, nh, nkv, hd = config["linear_num_value_heads"], config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    yield "model.language_model.embed_tokens.weight", (V, H)
    yield "lm_head.weight", (V, H)
    yield "model.language_model.norm.weight", (H,)
    for i, kind in enumerate(config["layer_types"]):
        p = f"model.language_model.layers.{i}."
        yield p + "input_layernorm.weight", (H,)
        yield p + "post_attention_layernorm.weight", (H,)
        yield p + "mlp.gate_proj.weight", (I, H)
        yield p + "mlp.up_proj.weight", (I, H)
        yield p + "mlp.down_proj.weight", (H, I)
        if kind == "linear_attention":
            a = p + "linear_attn."
            yield a + "in_proj_qkv.weight", (2 * kd + vd, H)
            yield a + "in_proj_z.weight", (vd, H)
            yield a + "in_proj_b.weight", (hv, H)
            yield a + "in_proj_a.weight", (hv, H)
            yield a + "conv1d.weight", (2 * kd + vd, 1, config["linear_conv_kernel_dim"])
            yield a + "dt_bias", (hv,)
            yield a + "A_log", (hv,)
            yield a + "norm.weight", (config["linear_value_head_dim"],)
            yield a + "out_proj.weight", (H, vd)
        else:
            s = p + "self_attn."
            yield s + "q_proj.weight", (2 * nh * hd, H)
            yield s + "k_proj.weight", (nkv * hd, H)
            yield s + "v_proj.weight", (nkv * hd, H)
            yield s + "o_proj.weight", (H, nh * hd)
            yield s + "q_norm.weight", (hd,)
            yield s + "k_norm.weight", (hd,)


def write_checkpoint(folder: Path, layers: int) -> dict:
    from dflash_mlx import tiny

    folder.mkdir(parents=True, exist_ok=True)
    config = dict(CONFIG, num_hidden_layers=layers,
                  layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)])
    shard, size, index, params, largest = {}, 0, {}, 0, 0
    key = mx.random.key(0)
    for name, shape in tensors(config):
        key, sub = mx.random.split(key)
        value = (mx.random.normal(shape, key=sub) * 0.02).astype(mx.bfloat16)
        mx.eval(value)
        shard[name] = value
        size += value.nbytes
        params += value.size
        largest = max(largest, value.nbytes)
        if size >= GB:
            file = f"model-{len(set(index.values())) + 1:05d}.safetensors"
            mx.save_safetensors(str(folder / file), shard, metadata={"format": "pt"})
            index.update({k: file for k in shard})
            shard, size = {}, 0
    if shard:
        file = f"model-{len(set(index.values())) + 1:05d}.safetensors"
        mx.save_safetensors(str(folder / file), shard, metadata={"format": "pt"})
        index.update({k: file for k in shard})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    text = dict(config, model_type="qwen3_5_text", dtype="bfloat16")
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text,
        "vision_config": {"depth": 1}, "tie_word_embeddings": False}))
    tiny.write_tokenizer(folder, 512)
    return {"parameters": params, "largest_tensor_bytes": largest}


def peak_of(command) -> int:
    done = subprocess.run(["/usr/bin/time", "-v", *command], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    return int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr).group(1)) * 1024


def size_of(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/convert-memory"))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints afterwards")
    args = parser.parse_args()
    source = args.work / "source"
    shutil.rmtree(args.work, ignore_errors=True)
    facts = write_checkpoint(source, args.layers)
    ours_out, mlx_out = args.work / "ours-w4", args.work / "mlx-lm-w4"
    ours = peak_of([sys.executable, "-m", "dflash_mlx.cli", "convert-target", "--model", str(source), "--out", str(ours_out),
                    "--quant", "w4"])
    mlx_lm = peak_of([sys.executable, "-m", "mlx_lm", "convert", "--hf-path", str(source), "--mlx-path", str(mlx_out), "-q"])
    output = size_of(ours_out)
    print(f"source: {facts['parameters'] / 1e9:.2f}B parameters, {size_of(source) / GB:.2f} GB bf16, "
          f"largest tensor {facts['largest_tensor_bytes'] / GB:.2f} GB")
    print(f"dflash-mlx convert-target --quant w4: peak {ours / GB:.2f} GB resident, wrote {output / GB:.2f} GB")
    print(f"mlx_lm.convert -q:                    peak {mlx_lm / GB:.2f} GB resident, wrote {size_of(mlx_out) / GB:.2f} GB")
    bound = output + facts["largest_tensor_bytes"] + 0.5 * GB
    print(f"bound (output + largest tensor + 0.5 GB): {bound / GB:.2f} GB -> "
          f"{'within' if ours <= bound else 'OVER'}; {'below' if ours < mlx_lm else 'NOT below'} mlx-lm's")
    if not args.keep:
        shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
