"""`python -m rayinfer.bench kernels dsa` without a GPU: it says so and exits 0; its byte
accounting is GLM-5's; its flags parse; the sweep's pick and its JSON snippet (the timer faked)."""

import math

import pytest
import torch

from rayinfer.bench import dsa_sweep, kernels, kernels_dsa
from rayinfer.kernels.tile_configs import pick_tile_config


def test_without_cuda_the_group_says_so_and_succeeds(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "dsa" in kernels.groups()
    assert kernels.main(["dsa", "--json", "unused.json", "--sweep", "--config-out", "x"]) == 0
    assert "no CUDA device" in capsys.readouterr().out


def test_flags_parse_and_config_out_needs_the_sweep(capsys):
    args = kernels_dsa.parse_args(["--sweep", "--config-out", "tiles.json", "--json", "r.json"])
    assert (args.sweep, args.config_out, args.json) == (True, "tiles.json", "r.json")
    args = kernels_dsa.parse_args([])
    assert (args.sweep, args.config_out, args.json) == (False, None, None)
    with pytest.raises(SystemExit) as exit_info:
        kernels_dsa.parse_args(["--config-out", "tiles.json"])
    assert exit_info.value.code == 2 and "--config-out needs --sweep" in capsys.readouterr().err


def test_bytes_that_sparse_decode_and_the_indexer_must_read():
    row = (512 + 64) * 2  # c_kv and k_pe in bf16
    assert kernels_dsa.attention_bytes(16) == 16 * 2048 * row + 16 * 64 * row
    assert kernels_dsa.indexer_bytes(16, 131072) == 16 * 131072 * 128 * 2
    assert kernels_dsa.dense_bytes(16, 131072) == 16 * 131072 * row


def test_cases_past_the_memory_limit_are_skipped_and_say_why():
    million = 1 << 20
    assert kernels_dsa.too_large("mla_dense_decode", 16, million) is None  # 19 GB
    assert kernels_dsa.too_large("mla_dense_decode", 64, million) == "77 GB of cache > 60 GB"
    assert kernels_dsa.too_large("dsa_indexer_decode", 64, million) == "94 GB of cache > 60 GB"
    assert kernels_dsa.too_large("sparse_mla_decode", 64, million) is None  # one shared context


def test_speedup_is_dense_over_selection_plus_sparse_attention():
    case = dict(batch=16, context=131072)
    sparse = dict(kernel="sparse_mla_decode", ms=0.1, **case)
    row = kernels_dsa.speedup_row(sparse, dict(ms=0.3, **case), dict(ms=2.0, **case))
    assert row["speedup"] == pytest.approx(2.0 / 0.4)
    assert "skipped" in kernels_dsa.speedup_row(sparse, None, dict(ms=2.0, **case))


def test_swept_configs_carry_the_keys_their_kernels_read():
    sparse_keys = pick_tile_config("sparse_mla", "default", "default", 64)
    assert dsa_sweep.SPARSE_MLA_SWEEP[0] == sparse_keys  # the current entry is a candidate
    assert all(set(c) == set(sparse_keys) for c in dsa_sweep.SPARSE_MLA_SWEEP)
    index_keys = pick_tile_config("dsa_indexer", "default", "default", 1)
    assert dsa_sweep.INDEXER_SWEEP[0] == index_keys
    assert all(set(c) == set(index_keys) for c in dsa_sweep.INDEXER_SWEEP)
    assert 15 <= len(dsa_sweep.SPARSE_MLA_SWEEP) <= 25 and 15 <= len(dsa_sweep.INDEXER_SWEEP) <= 25


class FakeCase:
    """Config "a" fails to compile, "b" is wrong, "c" is fastest at batch 1, "d" elsewhere."""

    MS = {"c": {1: 1.0, 16: 3.0, 64: 9.0}, "d": {1: 2.0, 16: 2.0, 64: 4.0}}

    def __init__(self, batch, context):
        self.batch = batch

    def error(self, params):
        if params["name"] == "a":
            raise RuntimeError("out of resources: shared memory")
        return 1.0 if params["name"] == "b" else 0.0

    def run(self, params):
        return self.MS[params["name"]][self.batch]


def test_sweep_skips_failing_configs_and_picks_by_geometric_mean(monkeypatch):
    monkeypatch.setattr(dsa_sweep, "quick_ms", lambda fn: fn())
    configs = [dict(name=n) for n in "abcd"]
    result = dsa_sweep.sweep_kernel("fake", configs, FakeCase, tolerance=1e-3)
    assert {r["params"]["name"] for r in result["rows"]} == {"c", "d"}
    assert result["best_per_shape"][1] == dict(ms=1.0, params=dict(name="c"))
    assert result["best_per_shape"][64]["params"] == dict(name="d")
    assert result["best"] == dict(name="d")  # 2 x 2 x 4 < 1 x 3 x 9
    snippet = dsa_sweep.config_snippet(
        {"sparse_mla": result, "dsa_indexer": dict(best=None)}, "NVIDIA H200"
    )
    assert snippet == {"sparse_mla": {"NVIDIA H200": {"default": {"64": dict(name="d")}}}}


def test_a_config_that_fails_at_a_sweep_shape_is_not_picked(monkeypatch):
    monkeypatch.setattr(dsa_sweep, "quick_ms", lambda fn: fn())
    monkeypatch.setitem(FakeCase.MS, "d", {1: 2.0, 16: math.inf, 64: 4.0})
    result = dsa_sweep.sweep_kernel("fake", [dict(name="c"), dict(name="d")], FakeCase, 1e-3)
    assert result["best"] == dict(name="c")
