"""The weight formats a checkpoint folder may ship, and which scale belongs to which weight.

- Unquantized: every tensor in its stored dtype; no `quantization_config`.
- DeepSeek-V3 FP8 (`quantization_config = {"quant_method": "fp8", "weight_block_size": [128,
  128], "activation_scheme": "dynamic", "fmt": "e4m3"}`): `<p>.weight` float8_e4m3fn [N, K] and
  `<p>.weight_scale_inv` float32 [ceil(N / 128), ceil(K / 128)] (models/fp8.py).
- DeepSeek-V4 (V4-Flash, V4-Pro): the same config plus `"scale_fmt": "ue8m0"`, and at the top level
  of config.json `"expert_dtype": "fp4"` (transformers folds it into `quantization_config`):
  * dense linears: `<p>.weight` float8_e4m3fn [N, K] with `<p>.scale` float8_e8m0fnu (safetensors
    F8_E8M0) [ceil(N / 128), ceil(K / 128)]: power-of-two block scales. They are attention's
    wq_a, wq_b, wkv, wo_a, wo_b, the indexer's wq_b and the shared expert's w1, w2, w3.
  * routed experts `ffn.experts.<e>.w{1,3,2}.weight`: MXFP4, int8 (safetensors I8) [N, K / 2], two
    e2m1 values per byte, low nibble first, with `<p>.scale` float8_e8m0fnu [N, K / 32] (models/
    mxfp4.py). V4-Flash: w1 I8 [2048, 2048], scale F8_E8M0 [2048, 128] (hidden 4096).
  * unquantized: embed, head, the compressors' and the indexer's wkv / wgate, the indexer's
    weights_proj and the router gate (bf16); norms, hc_* (mHC), attn_sink, ape, the gate's
    bias and tid2eid (float32 / integer).
  * V4-Flash-Base (`expert_dtype` "fp8") keeps FP8 experts with float32 block scales.
  The tensor names have no `model.` prefix (`embed.weight`, `layers.0.attn.wq_a.scale`,
  `hc_head_fn`); transformers' save_pretrained writes `model.layers...` with the same leaves.

Sources (transformers 5.24): integrations/finegrained_fp8.py (FP8Experts with
`expert_dtype="fp4"`: int8 weights with K halved, one scale per 32 along K; Fp8Quantize's ue8m0
rounding 2^ceil(log2 s); Fp8Dequantize's e2m1 table and low-nibble-first unpacking, uint8 scales
as 2^(b - 127)); quantizers/quantizer_finegrained_fp8.py ("per-block scales under `.scale` (e.g.
DeepSeek-V4-Flash)", renamed to weight_scale_inv); models/deepseek_v4/configuration_deepseek_v4.py
(top-level expert_dtype) and modeling_deepseek_v4.py (`_keep_in_fp32_modules`: the compressor and
indexer projections ship bf16 without scales). DeepSeek's inference/model.py for V4 (Linear: FP4
weight [out, in // 2] float4_e2m1fn_x2, scale [out, in // 32] float8_e8m0fnu; FP8 scale
[ceil(out / 128), ceil(in / 128)] float8_e8m0fnu; fp4 scale 2^ceil(log2(amax / 6))) and
convert.py (FP4_TABLE, `low = x & 0x0F; high = x >> 4`). vLLM's models/deepseek_v4.py (`.scale`
for both; expert_dtype from hf_config, "fp4" by default; Flash-Base's float32 scales).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from rayinfer.config import ConfigError
from rayinfer.models.fp8 import FP8_BLOCK_SIZE, SCALE_SUFFIX, decode_scales, dequantize_block_fp8
from rayinfer.models.mxfp4 import as_packed_bytes, dequantize_mxfp4, is_packed_fp4

V4_SCALE_LEAF = ".scale"  # `<p>.scale` beside `<p>.weight`
_WEIGHT = re.compile(r"^(?P<prefix>.*)\.weight$")
SCALE_FORMATS = ("float", "ue8m0")
EXPERT_DTYPES = ("fp8", "fp4")


@dataclass(frozen=True)
class CheckpointFormat:
    """What config.json declares: `quantization_config` and (DeepSeek-V4) `expert_dtype`."""

    quant_method: str | None = None  # "fp8", or None for an unquantized checkpoint
    block_size: int = FP8_BLOCK_SIZE  # FP8 blocks are block_size x block_size
    scale_fmt: str = "float"  # "ue8m0": power-of-two scales
    expert_dtype: str = "fp8"  # "fp4": routed experts in MXFP4

    @classmethod
    def from_hf(cls, hf: dict) -> CheckpointFormat:
        quant = hf.get("quantization_config")
        if not quant:
            return cls()
        method = quant.get("quant_method")
        if method != "fp8":
            raise ConfigError(
                f"quantization_config.quant_method={method!r} is not supported; rayinfer loads "
                "unquantized checkpoints and FP8 block-scaled ones (quant_method 'fp8', with "
                "DeepSeek-V4's MXFP4 experts)"
            )
        block = quant.get("weight_block_size") or [FP8_BLOCK_SIZE, FP8_BLOCK_SIZE]
        if len(block) != 2 or block[0] != block[1] or block[0] <= 0:
            raise ConfigError(
                f"quantization_config.weight_block_size={block!r}; square blocks such as "
                f"[{FP8_BLOCK_SIZE}, {FP8_BLOCK_SIZE}] are supported"
            )
        scale_fmt = quant.get("scale_fmt") or "float"
        expert_dtype = quant.get("expert_dtype") or hf.get("expert_dtype") or "fp8"
        for key, value, allowed in (
            ("quantization_config.scale_fmt", scale_fmt, SCALE_FORMATS),
            ("expert_dtype", expert_dtype, EXPERT_DTYPES),
        ):
            if value not in allowed:
                raise ConfigError(f"{key}={value!r}; use one of {', '.join(allowed)}")
        return cls(method, block[0], scale_fmt, expert_dtype)

    def dequantize(
        self,
        weight: torch.Tensor,
        scale: torch.Tensor,
        dtype: torch.dtype,
        names: tuple[str, str],  # (weight name, scale name) for errors
    ) -> torch.Tensor:
        """A block-scaled FP8 or an MXFP4 weight in `dtype`; ValueError naming the tensors when
        the scale does not fit the weight or the weight's dtype is neither."""
        if weight.dtype == torch.float8_e4m3fn:
            return dequantize_block_fp8(weight, scale, dtype, self.block_size, names)
        self.check_packed(weight, names[0])
        return dequantize_mxfp4(weight, scale, dtype, names)

    def as_stored(self, weight: torch.Tensor, name: str) -> torch.Tensor:
        """A weight handed to a layer that keeps its format: FP8 as it is, packed FP4 as uint8."""
        if weight.dtype == torch.float8_e4m3fn:
            return weight
        self.check_packed(weight, name)
        return as_packed_bytes(weight)

    def scale_as_stored(self, scale: torch.Tensor, is_fp8: bool) -> torch.Tensor:
        """The scale of a kept weight: float32 for FP8 (what the FP8 GEMMs take; UE8M0 decodes
        exactly), the UE8M0 exponent bytes as uint8 for MXFP4."""
        if is_fp8:
            return decode_scales(scale)
        if scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
            raise ValueError(f"MXFP4 scales are UE8M0 (float8_e8m0fnu or uint8), not {scale.dtype}")
        return scale.view(torch.uint8)

    def check_packed(self, weight: torch.Tensor, name: str) -> None:
        if not is_packed_fp4(weight):
            raise ValueError(
                f"{name} has a scale but is {weight.dtype}; scaled weights are float8_e4m3fn "
                "(FP8 blocks) or int8 / uint8 / float4_e2m1fn_x2 (MXFP4)"
            )
        if self.expert_dtype != "fp4":
            raise ValueError(
                f"{name} is {weight.dtype} with a scale (MXFP4), but config.json declares no FP4 "
                "experts (expert_dtype 'fp4' at the top level or in quantization_config)"
            )


def scale_names(names) -> dict[str, str]:
    """Weight name -> its scale's name, for every `<p>.weight` with a `<p>.weight_scale_inv`
    (DeepSeek-V3) or a `<p>.scale` (DeepSeek-V4) among `names`."""
    names = set(names)
    scales: dict[str, str] = {}
    for name in names:
        match = _WEIGHT.match(name)
        if match is None:
            continue
        for scale in (name + SCALE_SUFFIX, match["prefix"] + V4_SCALE_LEAF):
            if scale in names:
                scales[name] = scale
                break
    return scales
