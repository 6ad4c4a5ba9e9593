"""A tiny DeepSeek-V4 written by transformers, rewritten as DeepSeek-V4-Flash ships its weights
(tests/models/v4_shipped.py: FP8 e4m3 + UE8M0 128x128 block scales for the dense linears, MXFP4 +
UE8M0 per 32 for the routed experts, `.scale` names, V4-Flash's quantization_config), against
its dequantized twin: the same tensors, parameters and greedy tokens, and errors that name a
misshaped tensor.

Sizes: hidden 256 and moe_intermediate 128 give FP8 weights of several whole blocks (shared
w1 [128, 256], the indexer's wq_b [256, 32]) and partial ones (wq_a [32, 256]), and experts of
8 and 4 scale groups per row; transformers' dequantization needs whole blocks or a single one."""

import json
import shutil

import pytest
import torch
from safetensors import safe_open

import rayinfer
from rayinfer.config import ModelConfig
from rayinfer.layers.fused_experts import FusedExperts
from rayinfer.models.checkpoint_format import CheckpointFormat
from rayinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
from rayinfer.models.loader import CheckpointReader, WeightLoadError, load_model, stored_names
from tests.models.harness import TINY_V4, make_prompts, make_v4_checkpoint
from tests.models.v4_shipped import (
    rewrite_tensors,
    scale_name,
    shard_scales_apart,
    shipped_name,
    write_shipped_v4,
)

SIZES = dict(hidden_size=256, moe_intermediate_size=128)
EXPERT = "layers.1.ffn.experts.3.w1.weight"  # [128, 256] -> packed [128, 128], scale [128, 8]
DENSE = "layers.1.attn.indexer.wq_b.weight"  # [256, 32] -> scale [2, 1]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("v4-shipped")
    source = make_v4_checkpoint(root / "source", **SIZES)
    write_shipped_v4(source, root / "shipped", root / "twin")
    return root / "shipped", root / "twin"


def read_all(folder, dtype=torch.float32) -> dict[str, torch.Tensor]:
    config = json.loads((folder / "config.json").read_text())
    with CheckpointReader(folder, CheckpointFormat.from_hf(config)) as reader:
        return dict(reader.weights(dtype, "cpu"))


def load(folder, dtype=torch.float32):
    return load_model(ModelConfig.from_pretrained(folder), dtype, "cpu")


def copy_with(folder, target, edit):
    shutil.copytree(folder, target)
    rewrite_tensors(target, edit)
    return target


def test_shipped_checkpoint_stores_v4_flash_dtypes_and_shapes(folders):
    shipped, _ = folders
    with safe_open(shipped / "model.safetensors", "pt") as handle:
        slices = {name: handle.get_slice(name) for name in handle.keys()}
        info = {name: (s.get_dtype(), s.get_shape()) for name, s in slices.items()}
    assert info[EXPERT] == ("I8", [128, 128]) and info[scale_name(EXPERT)] == ("F8_E8M0", [128, 8])
    assert info[DENSE] == ("F8_E4M3", [256, 32]) and info[scale_name(DENSE)] == ("F8_E8M0", [2, 1])
    for plain in ("embed.weight", "head.weight", "layers.1.attn.compressor.wkv.weight"):
        assert info[plain][0] == "F32" and scale_name(plain) not in info
    assert info["hc_head_fn"][0] == "F32"
    num_scales = sum(name.endswith(".scale") and not name.startswith("mtp.") for name in info)
    assert num_scales == 4 * (5 + 3 + 8 * 3) + 2  # attention, shared, experts; 2 CSA indexers


def test_transformers_dequantizes_the_shipped_checkpoint_to_the_twin(folders, monkeypatch):
    """transformers' own loader reads the names, nibble order and scale layout as we write them."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    # its environment check asks for accelerate, which only device maps use
    monkeypatch.setattr(FineGrainedFP8HfQuantizer, "validate_environment", lambda *a, **k: None)
    shipped, twin = folders
    dequantize = FineGrainedFP8Config(dequantize=True)
    state = AutoModelForCausalLM.from_pretrained(
        shipped, dtype=torch.float32, quantization_config=dequantize
    ).state_dict()
    expected = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).state_dict()
    assert state.keys() == expected.keys()
    assert [n for n, t in state.items() if not torch.equal(t, expected[n])] == []


def test_reader_gives_the_twins_tensors(folders):
    shipped, twin = folders
    tensors, twin_tensors = read_all(shipped), read_all(twin)
    mtp = {name for name in tensors if name.startswith("mtp.")}
    assert mtp and tensors.keys() - mtp == {shipped_name(n) for n in twin_tensors}
    for name, tensor in twin_tensors.items():
        assert tensor.dtype == tensors[shipped_name(name)].dtype, name
        assert torch.equal(tensor, tensors[shipped_name(name)]), name
    assert tensors[EXPERT].shape == (128, 256) and tensors[DENSE].shape == (256, 32)
    bf16 = read_all(shipped, torch.bfloat16)  # dequantized into the model dtype
    assert bf16[EXPERT].dtype == bf16[DENSE].dtype == torch.bfloat16
    assert bf16["embed.weight"].dtype == torch.float32  # unquantized tensors keep theirs


def test_kept_weights_come_as_stored_bytes(folders):
    shipped, _ = folders
    names = (EXPERT, scale_name(EXPERT), DENSE, scale_name(DENSE))
    with safe_open(shipped / "model.safetensors", "pt") as handle:
        stored = [handle.get_tensor(name) for name in names]
    config = json.loads((shipped / "config.json").read_text())
    with CheckpointReader(shipped, CheckpointFormat.from_hf(config)) as reader:
        reader.keep_as_stored({EXPERT, DENSE}, "kept", "")
        assert set(names) <= reader.names
        packed, scale, fp8, fp8_scale = (reader.read(n, torch.float32, "cpu") for n in names)
    assert packed.dtype == scale.dtype == torch.uint8  # the MXFP4 kernel's layout
    assert torch.equal(packed, stored[0].view(torch.uint8))
    assert torch.equal(scale, stored[1].view(torch.uint8))
    assert fp8.dtype == torch.float8_e4m3fn
    assert torch.equal(fp8.view(torch.uint8), stored[2].view(torch.uint8))
    assert fp8_scale.dtype == torch.float32 and torch.equal(fp8_scale, stored[3].float())


def test_kept_names_are_matched_in_the_checkpoints_spelling():
    """A model asks for its names; the checkpoint may spell them with transformers' prefix."""
    model = DeepseekV4ForCausalLM  # normalize_checkpoint_name is a staticmethod
    file_of = dict.fromkeys(["model.layers.1.ffn.experts.3.w1.weight", "embed.weight"], "f")
    kept = stored_names(model, {"layers.1.ffn.experts.3.w1.weight"}, file_of)
    assert kept == {"model.layers.1.ffn.experts.3.w1.weight"}


def test_kept_experts_run_in_mxfp4_experts_like_the_twins(folders):
    """The reader's kept bytes are what FusedExperts(weight_format="mxfp4") loads and runs."""
    shipped, twin = folders
    prefix, num_experts = "layers.1.ffn.experts", TINY_V4["n_routed_experts"]
    parts = {"w1": "gate", "w3": "up", "w2": "down"}
    names = {
        f"{prefix}.{e}.{w}.weight": (e, part)
        for e in range(num_experts)
        for w, part in parts.items()
    }
    packed = FusedExperts(num_experts, 256, 128, swiglu_limit=10.0, weight_format="mxfp4")
    dense = FusedExperts(num_experts, 256, 128, swiglu_limit=10.0)
    config = json.loads((shipped / "config.json").read_text())
    with CheckpointReader(shipped, CheckpointFormat.from_hf(config)) as reader:
        reader.keep_as_stored(set(names), "kept", "")
        for name, (expert, part) in names.items():
            assert packed.load_expert_weight(expert, part, reader.read(name, None, "cpu"))
            scale = reader.read(scale_name(name), None, "cpu")
            assert packed.load_expert_weight(expert, part, scale, is_scale=True)
    twin_tensors = read_all(twin)
    for name, (expert, part) in names.items():
        dense.load_expert_weight(expert, part, twin_tensors["model." + name])
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(6, 256, generator=generator)
    topk_ids = torch.randint(0, num_experts, (6, 2), generator=generator)
    topk_weights = torch.rand(6, 2, generator=generator)
    expected = dense(x, topk_weights, topk_ids)
    torch.testing.assert_close(packed(x, topk_weights, topk_ids), expected)


def assert_same_parameters(model, twin_model) -> None:
    """The same values, `model`'s routed experts kept packed (MXFP4 bytes and exponents that
    dequantize to the twin's experts)."""
    from rayinfer.kernels.moe.fused_moe_mxfp4 import dequantize_mxfp4_reference

    params, twin_params = dict(model.named_parameters()), dict(twin_model.named_parameters())
    for name, param in params.items():
        if name.endswith(("experts.w13", "experts.w2")):
            assert param.dtype == torch.uint8, name  # kept packed
            values = dequantize_mxfp4_reference(param, params[name + "_scale"])
            assert torch.equal(values.to(twin_params[name].dtype), twin_params[name]), name
        elif not name.endswith("_scale"):
            assert torch.equal(param, twin_params[name]), name


def test_shipped_and_twin_load_the_same_parameters(folders):
    shipped, twin = folders
    assert_same_parameters(load(shipped), load(twin))


def test_sharded_checkpoint_with_scales_apart_loads_the_same(folders, tmp_path):
    shipped, twin = folders
    sharded = tmp_path / "sharded"
    shutil.copytree(shipped, sharded)
    shard_scales_apart(sharded)
    assert_same_parameters(load(sharded), load(twin))


def test_shipped_and_twin_generate_the_same_tokens(folders):
    greedy = rayinfer.SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    prompts = make_prompts(128, lengths=(5, 17, 3, 30))
    tokens = []
    for folder in folders:
        llm = rayinfer.LLM(str(folder), device="cpu", dtype="float32")
        tokens.append([output.token_ids for output in llm.generate(prompts, greedy)])
    assert tokens[0] == tokens[1]
    assert [len(t) for t in tokens[0]] == [20] * len(prompts)


@pytest.mark.parametrize(
    "name, shape, match",
    [
        # a scale per 32 of only part of the row
        (scale_name(EXPERT), (128, 7), r"w1\.weight \(128, 128\).*w1\.scale of shape \(128, 8\)"),
        # one row short
        (scale_name(EXPERT), (127, 8), r"w1\.scale of shape \(128, 8\).*it has \(127, 8\)"),
        # the packed bytes of a narrower row
        (EXPERT, (128, 120), r"w1\.weight \(128, 120\).*it has \(128, 8\), which fits"),
        # FP8 blocks: a scale grid of the wrong size
        (scale_name(DENSE), (1, 1), r"wq_b\.scale shape \(1, 1\).*wq_b\.weight \(256, 32\)"),
    ],
)
def test_misshaped_scale_or_packed_weight_names_the_tensor(folders, tmp_path, name, shape, match):
    shipped, _ = folders

    def misshape(tensors):
        return {**tensors, name: torch.zeros(shape, dtype=tensors[name].dtype)}

    broken = copy_with(shipped, tmp_path / "broken", misshape)
    with pytest.raises(WeightLoadError, match=match):
        load(broken)


def test_fp4_experts_undeclared_in_config_are_an_error_naming_the_tensor(folders, tmp_path):
    shipped, _ = folders
    broken = tmp_path / "undeclared"
    shutil.copytree(shipped, broken)
    config = json.loads((broken / "config.json").read_text())
    del config["expert_dtype"]
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightLoadError, match=r"experts\.\d+\.w[123]\.weight.*declares no FP4"):
        load(broken)
