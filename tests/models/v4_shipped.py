"""A DeepSeek-V4 checkpoint rewritten in the format DeepSeek-V4-Flash ships
(rayinfer/models/checkpoint_format.py), and its dequantized twin.

    write_shipped_v4(source, shipped, twin)

`source` is a transformers save_pretrained folder. `shipped` gets the shipped names (no `model.`
prefix, `embed.weight`, `hc_head_fn`), the dense linears in FP8 e4m3 with UE8M0 128x128 block
scales, the routed experts in MXFP4 (int8, UE8M0 per 32), everything else as saved, a
multi-token-prediction layer (`mtp.0.*`: the last layer's tensors again, which loaders skip), and
config.json with V4-Flash's `quantization_config` and top-level `expert_dtype`. `twin` gets the
source's names and config.json with every quantized tensor replaced by its dequantized value.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from safetensors.torch import load_file, save_file

from rayinfer.models.fp8 import dequantize_block_fp8, quantize_block_fp8
from rayinfer.models.mxfp4 import dequantize_mxfp4, quantize_mxfp4

FP8_WEIGHT = re.compile(
    r"\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)\.weight$"
    r"|\.ffn\.shared_experts\.w[123]\.weight$"
)
FP4_WEIGHT = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
V4_FLASH_QUANTIZATION = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128],
}
_TOP_LEVEL = {
    "embed_tokens.weight": "embed.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}


def shipped_name(saved_name: str) -> str:
    """transformers' save_pretrained name -> the name in DeepSeek-V4-Flash's safetensors."""
    name = saved_name.removeprefix("model.")
    return _TOP_LEVEL.get(name, name)


def scale_name(weight_name: str) -> str:
    return weight_name.removesuffix(".weight") + ".scale"


def write_shipped_v4(source: Path, shipped: Path, twin: Path) -> None:
    shipped_tensors, twin_tensors = {}, {}
    for saved, tensor in load_file(source / "model.safetensors").items():
        name = shipped_name(saved)
        if FP8_WEIGHT.search(name):
            weight, scale = quantize_block_fp8(tensor, scale_fmt="ue8m0")
            dequantized = dequantize_block_fp8(weight, scale, tensor.dtype)
        elif FP4_WEIGHT.search(name):
            weight, scale = quantize_mxfp4(tensor)
            dequantized = dequantize_mxfp4(weight, scale, tensor.dtype)
        else:
            shipped_tensors[name] = twin_tensors[saved] = tensor
            continue
        shipped_tensors[name], shipped_tensors[scale_name(name)] = weight, scale
        twin_tensors[saved] = dequantized
    config = json.loads((source / "config.json").read_text())
    last_layer = f"layers.{config['num_hidden_layers'] - 1}."
    for name in [n for n in shipped_tensors if n.startswith(last_layer)]:
        shipped_tensors["mtp.0." + name.removeprefix(last_layer)] = shipped_tensors[name].clone()
    for folder, tensors in ((shipped, shipped_tensors), (twin, twin_tensors)):
        folder.mkdir(parents=True)
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    (twin / "config.json").write_text(json.dumps(config, indent=2))
    config = {**config, "quantization_config": V4_FLASH_QUANTIZATION, "expert_dtype": "fp4"}
    (shipped / "config.json").write_text(json.dumps(config, indent=2))


def rewrite_tensors(folder: Path, edit) -> None:
    """Pass a single-file checkpoint's tensors through `edit` in place."""
    path = folder / "model.safetensors"
    tensors = edit(load_file(path))
    save_file(tensors, path, metadata={"format": "pt"})


def shard_scales_apart(folder: Path) -> None:
    """Rewrite a single-file checkpoint as two shards with an index: the scales in the second,
    away from their weights (a sharded checkpoint may split a pair)."""
    tensors = load_file(folder / "model.safetensors")
    shards = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
    files = list(shards)
    for name, tensor in tensors.items():
        shards[files[name.endswith(".scale")]][name] = tensor
    for file, shard in shards.items():
        save_file(shard, folder / file, metadata={"format": "pt"})
    weight_map = {name: file for file, shard in shards.items() for name in shard}
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (folder / "model.safetensors").unlink()
