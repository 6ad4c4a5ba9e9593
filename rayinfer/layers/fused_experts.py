"""A rank's routed experts, stacked for the fused MoE kernel, and the checkpoint names of them.

`parse_expert_weight_name(name, projections)` splits a per-expert checkpoint name
(`...mlp.experts.3.gate_proj.weight`; Mixtral: pass `MIXTRAL_EXPERT_PROJECTIONS` for
`w1`/`w3`/`w2`) into (module prefix, expert id, part); `FusedExperts.load_expert_weight(expert_id,
part, tensor)` copies it into the stacked weights when this rank holds that expert.

FP8 weights (`fp8=True`): `w13`/`w2` in float8_e4m3fn with `w13_scale` [E_local, 2I/128,
ceil(H/128)] and `w2_scale` [E_local, ceil(H/128), I/128] block scales (I must be a multiple of
128: gate and up share one stacked weight); they load through the same call with `is_scale=True`.

MXFP4 weights (`weight_format="mxfp4"`, DeepSeek-V4-Flash): packed e2m1 bytes and one UE8M0
exponent byte per 32 values along K, kept packed (kernels/moe/fused_moe_mxfp4.py); the packed tensor
and its scale load through the same call (`is_scale=True` for the scale), shapes checked. On a
GPU the packed bytes are kept with their bit pairs swapped, the four-lane kernel's layout
(kernels/moe/mxfp4_layouts.py, `mxfp4_layout`); a load converts what it copies, and experts moved
to a GPU after loading convert when their kernels are set.

Expert parallelism: rank r holds experts [r * E_local, (r + 1) * E_local) of E = ep_size * E_local.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch
from torch import nn

from rayinfer.config import ConfigError
from rayinfer.kernels import ops
from rayinfer.kernels.backends import DEFAULT_BACKENDS, KernelBackends
from rayinfer.kernels.moe.fused_moe_mxfp4 import scales_fold
from rayinfer.kernels.moe.mxfp4_layouts import from_shipped, relayout_
from rayinfer.layers.layer_options import UsesKernelBackends
from rayinfer.layers.linear import FP8_BLOCK
from rayinfer.layers.parallel import SINGLE, ParallelContext, divide

WEIGHT_FORMATS = ("dense", "fp8", "mxfp4")
MXFP4_GROUP = 32  # e2m1 values per UE8M0 scale
_MXFP4_BYTES = (torch.int8, torch.uint8, getattr(torch, "float4_e2m1fn_x2", torch.uint8))
_UE8M0_BYTES = (torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8))
DEFAULT_EXPERT_PROJECTIONS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
MIXTRAL_EXPERT_PROJECTIONS = {"w1": "gate", "w3": "up", "w2": "down"}
_EXPERT_NAME = re.compile(r"^(?P<prefix>.*)\.experts\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")


class ExpertWeightName(NamedTuple):
    prefix: str  # module path holding `experts`, e.g. "model.layers.3.mlp"
    expert_id: int  # global expert id in the checkpoint
    part: str  # "gate", "up" or "down"


def parse_expert_weight_name(
    name: str, projections: dict[str, str] = DEFAULT_EXPERT_PROJECTIONS
) -> ExpertWeightName | None:
    """`<prefix>.experts.<e>.<proj>.weight` -> ExpertWeightName; None for any other name."""
    match = _EXPERT_NAME.match(name)
    if match is None or match["proj"] not in projections:
        return None
    return ExpertWeightName(match["prefix"], int(match["expert"]), projections[match["proj"]])


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def _mxfp4_bytes(loaded: torch.Tensor, is_scale: bool, what: str) -> torch.Tensor:
    """A checkpoint's packed e2m1 or UE8M0 tensor as its uint8 bytes (a view)."""
    allowed = _UE8M0_BYTES if is_scale else _MXFP4_BYTES
    if loaded.dtype not in allowed:
        raise ValueError(f"{what}: checkpoint tensor is {loaded.dtype}, expected one of {allowed}")
    return loaded if loaded.dtype == torch.uint8 else loaded.view(torch.uint8)


class FusedExperts(UsesKernelBackends, nn.Module):
    """This rank's routed experts, stacked.

    w13 [E_local, 2I, H]: gate rows then up rows of each expert; w2 [E_local, H, I]: down.
    weight_format: "dense" (the model's dtype), "fp8" (same as fp8=True) or "mxfp4" (packed
    e2m1 bytes w13 [E_local, 2I, H/2], w2 [E_local, H, I/2] and UE8M0 byte scales w13_scale
    [E_local, 2I, H/32], w2_scale [E_local, H, I/32]; DeepSeek-V4-Flash's experts as shipped).
    swiglu_limit (DeepSeek-V4): the activation is silu(min(gate, l)) * clamp(up, -l, l).
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        parallel: ParallelContext = SINGLE,
        fp8: bool = False,
        swiglu_limit: float | None = None,
        weight_format: str | None = None,
    ):
        super().__init__()
        self.num_experts = num_experts
        self.swiglu_limit = swiglu_limit
        self.weight_format = weight_format or ("fp8" if fp8 else "dense")
        if self.weight_format not in WEIGHT_FORMATS or (fp8 and self.weight_format != "fp8"):
            raise ConfigError(f"expert weight_format={weight_format!r} (fp8={fp8}); use one of "
                              f"{WEIGHT_FORMATS}")  # fmt: skip
        self.intermediate_size = intermediate_size
        self.num_local_experts = divide(num_experts, parallel.ep_size, "n_routed_experts")
        self.first_local_expert = parallel.ep_rank * self.num_local_experts
        self.w13_scale = self.w2_scale = None
        self._small_scales: bool | None = None  # MXFP4: every scale byte <= 128, once read
        self.mxfp4_layout = "shipped"  # MXFP4 bytes as kept (kernels/moe/mxfp4_layouts.py)
        self._kernels = DEFAULT_BACKENDS
        if self.weight_format == "mxfp4":
            self._make_mxfp4_weights(hidden_size, intermediate_size)
            if self.w13.is_cuda:  # W4A16 until the kernels say otherwise: nothing loaded yet
                self.mxfp4_layout = "swapped"
            return
        shape13 = (self.num_local_experts, 2 * intermediate_size, hidden_size)
        shape2 = (self.num_local_experts, hidden_size, intermediate_size)
        dtype = torch.float8_e4m3fn if self.weight_format == "fp8" else None
        self.w13 = _frozen(torch.empty(shape13, dtype=dtype))
        self.w2 = _frozen(torch.empty(shape2, dtype=dtype))
        if self.weight_format == "fp8":
            if intermediate_size % FP8_BLOCK:
                raise ConfigError(
                    f"fp8_weights: moe_intermediate_size={intermediate_size} is not a multiple of "
                    f"{FP8_BLOCK}, so gate and up cannot share one block-scaled w13; "
                    "use fp8_weights=False"
                )
            blocks = lambda n: -(-n // FP8_BLOCK)  # noqa: E731
            scale13 = (self.num_local_experts, blocks(2 * intermediate_size), blocks(hidden_size))
            scale2 = (self.num_local_experts, blocks(hidden_size), blocks(intermediate_size))
            self.w13_scale = _frozen(torch.empty(scale13, dtype=torch.float32))
            self.w2_scale = _frozen(torch.empty(scale2, dtype=torch.float32))

    def _make_mxfp4_weights(self, hidden_size: int, intermediate_size: int) -> None:
        if hidden_size % MXFP4_GROUP or intermediate_size % MXFP4_GROUP:
            raise ConfigError(
                f"MXFP4 experts: hidden_size={hidden_size} and moe_intermediate_size="
                f"{intermediate_size} must be multiples of {MXFP4_GROUP} (one scale per 32)"
            )
        experts, inter = self.num_local_experts, intermediate_size
        byte = torch.uint8
        self.w13 = _frozen(torch.empty(experts, 2 * inter, hidden_size // 2, dtype=byte))
        self.w2 = _frozen(torch.empty(experts, hidden_size, inter // 2, dtype=byte))
        self.w13_scale = _frozen(
            torch.empty(experts, 2 * inter, hidden_size // MXFP4_GROUP, dtype=byte)
        )
        self.w2_scale = _frozen(torch.empty(experts, hidden_size, inter // MXFP4_GROUP, dtype=byte))

    def load_expert_weight(
        self, expert_id: int, part: str, loaded: torch.Tensor, is_scale: bool = False
    ) -> bool:
        """Copy one expert's `gate`/`up` [I, H] or `down` [H, I] (is_scale: its FP8 block scales
        [I/128, H/128] or [H/128, I/128]; MXFP4: packed [I, H/2] or [H, I/2] bytes (int8, uint8
        or float4_e2m1fn_x2), is_scale: UE8M0 [I, H/32] or [H, I/32] (uint8 or
        float8_e8m0fnu)); False if the expert is not held on this rank."""
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert {expert_id} outside n_routed_experts={self.num_experts}")
        local = expert_id - self.first_local_expert
        if not 0 <= local < self.num_local_experts:
            return False
        if is_scale and self.w13_scale is None:
            raise ValueError("these experts keep no FP8 scales (fp8_weights is off)")
        mxfp4 = self.weight_format == "mxfp4"
        size = self.intermediate_size // FP8_BLOCK if is_scale and not mxfp4 else None
        size = size or self.intermediate_size
        if is_scale:
            stacked = (self.w2_scale if part == "down" else self.w13_scale).data
        else:
            stacked = (self.w2 if part == "down" else self.w13).data
        rows = {"gate": slice(0, size), "up": slice(size, 2 * size), "down": slice(None)}[part]
        target = stacked[local, rows]
        what = f"{part} scale" if is_scale else part
        if mxfp4:
            if is_scale:
                self._small_scales = None  # read again at the next run
            what = f"MXFP4 {what}" + ("" if is_scale else " (packed, two values a byte)")
            loaded = _mxfp4_bytes(loaded, is_scale, f"expert {expert_id} {what}")
        if target.shape != loaded.shape:
            raise ValueError(
                f"expert {expert_id} {what}: checkpoint shape {tuple(loaded.shape)}, "
                f"expected {tuple(target.shape)}"
            )
        if target.dtype == torch.float8_e4m3fn and loaded.dtype != torch.float8_e4m3fn:
            raise ValueError(
                f"expert {expert_id} {part}: checkpoint tensor is {loaded.dtype}, but the experts "
                "keep FP8 block-scaled weights (fp8_weights=True)"
            )
        if mxfp4 and not is_scale and self.mxfp4_layout != "shipped":
            loaded = from_shipped(loaded.to(target.device), self.mxfp4_layout)
        target.copy_(loaded)
        return True

    def run(self, x, topk_weights, local_ids):
        """The fused MoE over this rank's experts; local_ids [T, K] outside [0, E_local) skip."""
        return ops.fused_moe(
            x, self.w13, self.w2, topk_weights, local_ids, self.w13_scale, self.w2_scale,
            swiglu_limit=self.swiglu_limit, backends=self.kernels,
            mxfp4_small_scales=self.mxfp4_small_scales(),
            mxfp4_layout=self.mxfp4_layout,
        )  # fmt: skip

    @property
    def kernels(self) -> KernelBackends:
        return self._kernels

    @kernels.setter
    def kernels(self, kernels: KernelBackends) -> None:
        """The backends (layer_options.configure_layers, after loading): MXFP4 experts on a GPU
        move to the four-lane kernel's layout (a no-op where they already are in it)."""
        self._kernels = kernels
        if self.weight_format == "mxfp4" and self.w13.is_cuda:
            self.use_mxfp4_layout("swapped")

    def use_mxfp4_layout(self, layout: str) -> None:
        """Keep the packed experts in this layout from now on (the stored bytes rewritten)."""
        relayout_(self.w13.data, self.mxfp4_layout, layout)
        relayout_(self.w2.data, self.mxfp4_layout, layout)
        self.mxfp4_layout = layout

    def mxfp4_small_scales(self) -> bool:
        """Whether every MXFP4 scale is at most 2 (byte <= 128), as trained weights' are: the
        kernel then multiplies each dequantized pair once. Read from the device once after
        loading, never while a CUDA graph is being captured (False then: the exact two-factor
        form, as for any other scales)."""
        if self.weight_format != "mxfp4":
            return False
        if self._small_scales is None:
            if self.w13.is_cuda and torch.cuda.is_current_stream_capturing():
                return False
            self._small_scales = scales_fold(self.w13_scale, self.w2_scale)
        return self._small_scales

    def forward(self, x, topk_weights, topk_ids):
        """x [T, H], topk_weights [T, K] float32, topk_ids [T, K] global ids -> [T, H].

        Under expert parallelism the result holds only this rank's experts' share.
        """
        if self.num_local_experts == self.num_experts:  # every expert is here: ids as they are
            return self.run(x, topk_weights, topk_ids)
        # [T, K]: ids outside [0, E_local) are other ranks' experts, which fused_moe skips (one
        # launch; masking them to -1 first took three more per MoE layer)
        return self.run(x, topk_weights, topk_ids - self.first_local_expert)
