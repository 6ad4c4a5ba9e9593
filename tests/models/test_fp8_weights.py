"""fp8_weights=True: DeepSeek-V3 FP8 block-scaled weights kept in FP8 and multiplied W8A8.

A tiny transformers DeepSeek-V3 is rewritten the way DeepSeek stores V3 (every decoder-layer
linear weight in float8_e4m3fn plus `weight_scale_inv` per 128x128 block; the router, norms,
embeddings and lm_head unquantized). Sizes are chosen so that partial blocks occur (hidden 192,
q_lora_rank 96, kv_a 96 rows) while the stacked gate/up weights end on whole blocks.

Observed on CPU (float32), prompt logits fp8_weights=True vs the dequantized model:
- against the dequantized model whose FP8 layers see their inputs quantized per token x 128
  channels (what W8A8 means): identical (max |diff| 0.0);
- against the plain dequantized model, with every expert selected (no routing flips): relative
  L2 error per position median ~0.095, max ~0.17 (each FP8 GEMM alone: ~0.025; this random
  std-0.1 model amplifies perturbations: bfloat16 vs float32 alone reaches 0.25 on the top-2
  routed checkpoint). Greedy tokens agree on ~20 of 32 steps, so the test asserts on logits.
"""

import json

import pytest
import torch
from safetensors.torch import load_file

from rayinfer.config import ConfigError, ModelConfig, ParallelPlan
from rayinfer.kernels.fp8.fp8_quant import fp8_dequant_reference, fp8_quant_reference
from rayinfer.models.fp8 import check_fp8_weights, quantize_block_fp8
from rayinfer.models.loader import load_model
from tests.models.harness import TINY_DENSE, make_hf_checkpoint, make_prompts, run_greedy
from tests.models.test_deepseek import make_deepseek_checkpoint
from tests.models.test_loader import rewrite_checkpoint

FP8_SHAPES = dict(
    hidden_size=192,
    intermediate_size=256,
    moe_intermediate_size=128,
    q_lora_rank=96,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=32,
    v_head_dim=32,
    n_shared_experts=1,
)
ROUTED = dict(FP8_SHAPES, n_group=4, topk_group=2)  # top-2 of 8, group-limited
ALL_EXPERTS = dict(FP8_SHAPES, n_group=1, topk_group=1, num_experts_per_tok=8)
KEPT_IN_FP8 = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj", "gate_up_proj", "down_proj")


def quantize_like_deepseek_v3(tensors, keep=()):
    """Every decoder-layer linear weight (not the router, not norms) -> FP8 + block scales."""
    out = {}
    for name, tensor in tensors.items():
        is_linear = ".layers." in name and name.endswith(".weight") and tensor.dim() == 2
        if is_linear and not name.endswith("mlp.gate.weight") and name not in keep:
            out[name], out[name + "_scale_inv"] = quantize_block_fp8(tensor)
        else:
            out[name] = tensor
    return out


def make_fp8_checkpoint(tmp_path_factory, name, overrides):
    source = make_deepseek_checkpoint(tmp_path_factory.mktemp(name), "deepseek_v3", **overrides)
    target = tmp_path_factory.mktemp(name + "-fp8") / "ckpt"
    return source, rewrite_checkpoint(source, target, quantize_like_deepseek_v3)


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    return make_fp8_checkpoint(tmp_path_factory, "routed", ROUTED)


@pytest.fixture(scope="module")
def all_experts(tmp_path_factory):
    return make_fp8_checkpoint(tmp_path_factory, "all-experts", ALL_EXPERTS)


def load(path, dtype=torch.float32, fp8_weights=False):
    return load_model(ModelConfig.from_pretrained(path), dtype, "cpu", fp8_weights=fp8_weights)


def param_bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def test_fp8_weights_keep_float8_tensors_and_half_the_memory(routed):
    _, path = routed
    fp8_model = load(path, torch.bfloat16, fp8_weights=True)
    bf16_model = load(path, torch.bfloat16)
    stored = load_file(path / "model.safetensors")
    layer = fp8_model.model.layers[1]
    attn, moe = layer.self_attn, layer.mlp
    for linear in (attn.q_a_proj, attn.q_b_proj, attn.kv_a_proj_with_mqa, attn.o_proj):
        assert linear.weight.dtype == torch.float8_e4m3fn
        assert linear.weight_scale_inv.dtype == torch.float32
    shared = moe.shared_experts
    for linear in (shared.gate_up_proj, shared.down_proj):
        assert linear.weight.dtype == torch.float8_e4m3fn
    dense = fp8_model.model.layers[0].mlp
    assert dense.gate_up_proj.weight.dtype == torch.float8_e4m3fn
    assert moe.experts.w13.dtype == moe.experts.w2.dtype == torch.float8_e4m3fn
    assert moe.experts.w13_scale.shape == (8, 2, 2) and moe.experts.w2_scale.shape == (8, 2, 1)
    # stays in the model dtype: kv_b_proj (absorbed into W_UK/W_UV), embeddings, lm_head; the
    # router keeps float32 (it computes in float32)
    assert attn.kv_b_proj.weight.dtype == torch.bfloat16
    assert moe.gate.weight.dtype == torch.float32
    assert fp8_model.lm_head.weight.dtype == torch.bfloat16
    # the weights are the checkpoint's bytes, not a re-quantization
    name = "model.layers.1.mlp.experts.3.up_proj"
    assert torch.equal(
        moe.experts.w13[3, 128:].view(torch.uint8), stored[name + ".weight"].view(torch.uint8)
    )
    assert torch.equal(moe.experts.w13_scale[3, 1:], stored[name + ".weight_scale_inv"])
    gate_scale = stored["model.layers.0.mlp.gate_proj.weight_scale_inv"]
    assert torch.equal(dense.gate_up_proj.weight_scale_inv[:2], gate_scale)

    fp8_params = dict(fp8_model.named_parameters())
    quantized = [n for n, p in fp8_params.items() if p.dtype == torch.float8_e4m3fn]
    assert len(quantized) == 2 * 4 + 2 + 2 + 2  # 4 attention + dense MLP 2 + shared 2 + experts 2
    bf16_params = dict(bf16_model.named_parameters())
    fp8_bytes = param_bytes(fp8_params[n] for n in quantized)
    scale_bytes = param_bytes(
        p for n, p in fp8_params.items() if n.endswith("_scale_inv") or n.endswith("_scale")
    )
    bf16_bytes = param_bytes(bf16_params[n] for n in quantized)
    assert fp8_bytes == bf16_bytes // 2
    assert scale_bytes < 0.01 * bf16_bytes
    total_ratio = param_bytes(fp8_model.parameters()) / param_bytes(bf16_model.parameters())
    assert total_ratio < 0.65  # embeddings, lm_head and kv_b_proj stay bfloat16


def fake_quantize_fp8_inputs(model, fp8_model):
    """Quantize-dequantize (per token x 128 channels) the input of every dense layer that the
    FP8 model runs through fp8_gemm: the dequantized model then computes exactly W8A8."""
    fp8_modules = {
        n for n, m in fp8_model.named_modules() if getattr(m, "weight_scale_inv", None) is not None
    }
    for name, module in model.named_modules():
        if name in fp8_modules:
            forward = module.forward

            def quantized_input(x, forward=forward):
                flat = x.reshape(-1, x.shape[-1])
                return forward(fp8_dequant_reference(*fp8_quant_reference(flat)).view_as(x))

            module.forward = quantized_input
    assert fp8_modules


def test_fp8_path_is_exactly_w8a8_of_the_dequantized_weights(routed):
    """On CPU the routed experts' FP8 fused MoE dequantizes its weights (ops.fused_moe's
    reference); the dense layers quantize their inputs like the GPU kernels do."""
    _, path = routed
    fp8_model = load(path, fp8_weights=True)
    reference = load(path)
    fake_quantize_fp8_inputs(reference, fp8_model)
    config = ModelConfig.from_pretrained(path)
    prompts = make_prompts(config.vocab_size)
    ours = run_greedy(fp8_model, config, prompts, max_new_tokens=8)
    expected = run_greedy(reference, config, prompts, max_new_tokens=8)
    for mine, theirs in zip(ours.prompt_logits, expected.prompt_logits, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
    assert ours.token_ids == expected.token_ids


def test_fp8_logits_stay_within_activation_quantization_error(all_experts):
    """vs the dequantized model (activations not quantized); every expert is selected so that
    a routing flip cannot make the comparison discontinuous."""
    _, path = all_experts
    config = ModelConfig.from_pretrained(path)
    prompts = make_prompts(config.vocab_size)
    ours = run_greedy(load(path, fp8_weights=True), config, prompts, max_new_tokens=8)
    expected = run_greedy(load(path), config, prompts, max_new_tokens=8)
    mine, theirs = torch.cat(ours.prompt_logits), torch.cat(expected.prompt_logits)
    relative = (mine - theirs).norm(dim=-1) / theirs.norm(dim=-1)  # per position
    assert relative.median() < 0.15, relative
    assert relative.max() < 0.3, relative
    assert (mine.argmax(-1) == theirs.argmax(-1)).float().mean() > 0.7


def test_llm_generates_with_fp8_weights(routed):
    from rayinfer import LLM, SamplingParams

    _, path = routed
    llm = LLM(str(path), device="cpu", fp8_weights=True, max_model_len=64, num_kv_blocks=32)
    model = llm.engine.executor.runner.model
    assert model.model.layers[1].mlp.experts.w13.dtype == torch.float8_e4m3fn
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    (output,) = llm.generate([[1, 2, 3, 4, 5]], params)
    assert len(output.token_ids) == 4
    # random weights in FP8 (benchmarks of full-size shapes): the same layers hold float8
    dummy = LLM(str(path), device="cpu", load_format="dummy", fp8_weights=True, num_kv_blocks=32)
    dummy_model = dummy.engine.executor.runner.model
    assert dummy_model.model.layers[0].self_attn.o_proj.weight.dtype == torch.float8_e4m3fn
    assert len(dummy.generate([[1, 2, 3]], params)[0].token_ids) == 4


def test_checkpoint_without_fp8_weights_is_a_config_error(routed):
    source, _ = routed
    with pytest.raises(ConfigError, match="fp8_weights=true.*no FP8 block-scaled weights"):
        load(source, fp8_weights=True)
    from rayinfer import LLM

    with pytest.raises(ConfigError, match="no FP8 block-scaled weights"):
        LLM(str(source), device="cpu", fp8_weights=True)


def test_layer_left_unquantized_is_a_config_error(routed, tmp_path):
    source, _ = routed
    name = "model.layers.1.self_attn.o_proj.weight"
    edit = lambda tensors: quantize_like_deepseek_v3(tensors, keep={name})  # noqa: E731
    partial = rewrite_checkpoint(source, tmp_path / "partial", edit)
    with pytest.raises(ConfigError, match=f"{name}.*no scale_inv"):
        load(partial, fp8_weights=True)
    load(partial)  # dequantized loading still takes it


def test_tensor_parallel_split_of_a_block_is_a_config_error(routed):
    _, path = routed
    config = ModelConfig.from_pretrained(path)
    check_fp8_weights(config, tp_size=1)
    # o_proj's input: 4 heads x v_head_dim 32 = 128 -> 64 per rank at tp=2
    with pytest.raises(
        ConfigError,
        match=r"tp=2 splits num_attention_heads\*v_head_dim=128 into 64 per rank.*use tp in \[1\]",
    ):
        check_fp8_weights(config, tp_size=2)
    from rayinfer import LLM

    with pytest.raises(ConfigError, match="tp=2 splits"):  # before any worker starts
        LLM(str(path), device="cpu", fp8_weights=True, parallel=ParallelPlan(tp=2))


def test_gate_up_sharing_a_block_and_other_families_are_config_errors(routed, tmp_path):
    _, path = routed
    hf = json.loads((path / "config.json").read_text())
    config = ModelConfig.from_hf_dict({**hf, "moe_intermediate_size": 96}, path=str(path))
    with pytest.raises(ConfigError, match="moe_intermediate_size=96 is not a multiple of 128"):
        check_fp8_weights(config)
    llama = make_hf_checkpoint(tmp_path / "llama", "llama", **TINY_DENSE)
    with pytest.raises(ConfigError, match="DeepSeek V2/V3 checkpoints only.*LlamaForCausalLM"):
        load(llama, fp8_weights=True)


def test_serve_config_takes_fp8_weights_top_level_and_per_phase(routed):
    from rayinfer.app import check_phase_fp8_weights
    from rayinfer.deployments.config import AppConfig

    source, path = routed
    config = AppConfig.from_args({"fp8_weights": "true", "decode.fp8_weights": "false"})
    assert config.prefill.uses_fp8_weights(config.fp8_weights)
    assert not config.decode.uses_fp8_weights(config.fp8_weights)
    assert not AppConfig.from_args({}).decode.uses_fp8_weights(False)
    model_config = ModelConfig.from_pretrained(path)
    check_phase_fp8_weights(config, model_config, path)
    split = AppConfig.from_args({"decode.fp8_weights": True, "decode.tp": 2})
    with pytest.raises(ConfigError, match=r"decode.fp8_weights=true: decode.tp=2 splits"):
        check_phase_fp8_weights(split, model_config, path)
    with pytest.raises(ConfigError, match="^fp8_weights=true, but the checkpoint"):
        check_phase_fp8_weights(config, ModelConfig.from_pretrained(source), source)
