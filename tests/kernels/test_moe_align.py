"""moe_align: slots grouped by expert, padded to tiles, against the torch reference."""

import pytest
import torch

from rayinfer.kernels.moe.moe_align import moe_align, moe_align_reference


def _runs_sorted(alignment, block_m):
    """Slot ids with each tile-aligned expert run sorted (order inside a run is arbitrary)."""
    ids = alignment.sorted_slot_ids.clone()
    experts = alignment.block_expert_ids.repeat_interleave(block_m)  # [P_max]
    for expert in experts.unique().tolist():
        rows = (experts == expert).nonzero(as_tuple=True)[0]
        ids[rows] = ids[rows].sort().values
    return ids


def _routing(case, generator):
    num_tokens, top_k, num_experts = case["T"], case["K"], case["E"]
    if case.get("one_expert"):
        return torch.full((num_tokens, top_k), 2, dtype=torch.int64)
    scores = torch.rand(num_tokens, case.get("E_routed", num_experts), generator=generator)
    ids = scores.topk(top_k, dim=-1).indices
    if case.get("foreign"):
        ids[::2, 0] = -1  # experts held by another rank
        ids[1::3, -1] = num_experts
    return ids


CASES = {
    "normal": dict(T=32, K=2, E=8, block_m=16),
    "odd": dict(T=6, K=3, E=5, block_m=4),
    "one_token": dict(T=1, K=4, E=16, block_m=16),
    "all_one_expert": dict(T=9, K=1, E=4, block_m=8, one_expert=True),
    "topk_equals_experts": dict(T=7, K=6, E=6, block_m=2),
    "idle_experts": dict(T=5, K=2, E=12, E_routed=4, block_m=4),
    "foreign_ids": dict(T=12, K=3, E=6, block_m=4, foreign=True),
    "many": dict(T=300, K=8, E=64, block_m=16),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32])
def test_moe_align_matches_reference(name, ids_dtype):
    case = CASES[name]
    topk_ids = _routing(case, torch.Generator().manual_seed(len(name))).to(ids_dtype)
    ours = moe_align(topk_ids, case["E"], case["block_m"])
    ref = moe_align_reference(topk_ids, case["E"], case["block_m"])
    torch.testing.assert_close(ours.num_padded_slots, ref.num_padded_slots, rtol=0, atol=0)
    torch.testing.assert_close(ours.block_expert_ids, ref.block_expert_ids, rtol=0, atol=0)
    ours_ids = _runs_sorted(ours, case["block_m"])
    torch.testing.assert_close(ours_ids, _runs_sorted(ref, case["block_m"]), rtol=0, atol=0)


def test_moe_align_rejects_bad_block():
    with pytest.raises(ValueError, match="power of two"):
        moe_align(torch.zeros(2, 2, dtype=torch.int64), 4, 12)
