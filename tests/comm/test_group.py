"""The "rayinfer" backend in real Ray actors (CPU, gloo): world sizes 2, 4 and 8 share one set
of eight actors, created once for the module; each world size is its own collective group."""

import importlib
import sys

import pytest
import ray
import torch
from ray.util import collective as col

import rayinfer.comm  # noqa: F401  (registers the backend in the driver)
from rayinfer.comm.fp8 import error_bound
from rayinfer.comm.refs import (
    all_to_all_ref,
    identity_experts,
    moe_identity_ref,
    random_split_matrix,
)
from rayinfer.comm.topology import Topology
from rayinfer.kernels.moe.moe_combine import combine_row_index

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
WORLD_SIZES = (2, 4, 8)
SCHEDULES = ("nccl", "pairwise", "hierarchical")
TRANSPORTS = ("dist", "host")


@ray.remote(num_cpus=0)
class Member:
    def __init__(self):
        importlib.import_module("rayinfer.comm")  # registers the backend in this worker
        torch.set_num_threads(1)

    def join(self, world_size: int, rank: int, group_name: str) -> None:
        col.init_collective_group(world_size, rank, backend="rayinfer", group_name=group_name)

    def call(self, fn, group_name: str, *args):
        return fn(col.get_group_handle(group_name), *args)


@pytest.fixture(scope="module")
def members(ray_cluster):
    actors = [Member.remote() for _ in range(max(WORLD_SIZES))]
    ray.get([a.join.remote(n, r, f"ws{n}") for n in WORLD_SIZES for r, a in enumerate(actors[:n])])
    yield actors
    for a in actors:
        ray.kill(a)


def run(members, world_size: int, fn, *args) -> list:
    """fn(group, rank-independent args...) on every member of the world_size group."""
    return ray.get([a.call.remote(fn, f"ws{world_size}", *args) for a in members[:world_size]])


def two_islands(n: int) -> Topology:
    """Islands of even and odd ranks (not contiguous, so the island mapping is exercised)."""
    return Topology.from_matrix(
        [[10.0] * n] * n, islands=[list(range(0, n, 2)), list(range(1, n, 2))]
    )


def _all_to_all_cases(group, seed: int) -> list[str]:
    n, me = group.world_size, group.rank
    group.topology = two_islands(n)
    gen = torch.Generator().manual_seed(seed)
    failures = []
    for trial in range(2):
        matrix = random_split_matrix(n, 6, gen)
        matrix[trial % n] = [0] * n  # one rank sends nothing
        dtype = (torch.bfloat16, torch.int64)[trial]
        inputs = [(torch.randn(sum(row), 3, 5, generator=gen) * 100).to(dtype) for row in matrix]
        expected = all_to_all_ref(inputs, matrix)[me]
        for schedule in SCHEDULES:
            for transport in TRANSPORTS:
                out = torch.full_like(expected, 7)
                group.all_to_all(
                    out, inputs[me], [r[me] for r in matrix], matrix[me], schedule, transport
                )
                if not torch.equal(out, expected):
                    failures.append(f"rank {me} {schedule}/{transport} {dtype} {matrix}")
        out = torch.empty_like(expected)
        group.all_to_all(out, inputs[me], [r[me] for r in matrix], matrix[me])  # auto
        if not torch.equal(out, expected):
            failures.append(f"rank {me} auto {matrix}")
    return failures


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_to_all_equals_reference_for_every_schedule_and_transport(members, world_size):
    """Random uneven splits with zeros (and a rank that sends nothing), bf16 and int64 rows:
    exact equality with the single-process reference."""
    failures = run(members, world_size, _all_to_all_cases, world_size)
    assert sum(failures, []) == []


def _routing(num_tokens: int, num_experts: int, topk: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, 64, generator=gen)
    ids = torch.rand(num_tokens, num_experts, generator=gen).argsort(1)[:, :topk]
    weights = torch.rand(num_tokens, topk, generator=gen)
    return x, ids, weights


def _moe_roundtrip(group, num_experts: int, topk: int, transport: str, is_async: bool):
    num_tokens = (0, 1, 5, 33)[group.rank % 4]  # a rank with no tokens, one with a single token
    x, ids, weights = _routing(num_tokens, num_experts, topk, seed=group.rank)
    kw = dict(num_experts=num_experts, transport=transport)
    if is_async:
        res = group.dispatch_async(x, ids, weights, **kw).wait()
    else:
        res = group.dispatch(x, ids, weights, **kw)
    assert res.x.shape[0] == res.topk_ids.shape[0] == sum(res.handle.out_splits)
    assert bool((res.topk_weights[res.topk_ids < 0] == 0).all())
    per_rank = num_experts // group.world_size
    unique_pairs = {(t, e // per_rank) for t, row in enumerate(ids.tolist()) for e in row}
    assert sum(res.handle.in_splits) == len(
        unique_pairs
    )  # one row per (token, rank), not per expert
    # combine's [T, world] row index, built in dispatch from the routing, names the same rows
    # as the one built from the sent token ids and split sizes
    assert torch.equal(
        res.handle.row_index,
        combine_row_index(res.handle.send_token_ids, res.handle.in_splits, num_tokens),
    )
    out = identity_experts(res.x, res.topk_weights)
    y = (
        group.combine_async(out, res.handle, transport=transport).wait()
        if is_async
        else (group.combine(out, res.handle, transport=transport))
    )
    torch.testing.assert_close(y, moe_identity_ref(x, weights), rtol=1e-5, atol=1e-5)
    return True


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize(
    "num_experts,topk,transport,is_async",
    [(16, 4, "dist", False), (16, 4, "host", True), (8, 8, "host", False)],
    ids=["dist", "host-async", "topk-equals-experts"],
)
def test_dispatch_identity_combine_returns_input_times_weight_sum(
    members, world_size, num_experts, topk, transport, is_async
):
    if num_experts % world_size:
        pytest.skip("experts must split evenly")
    assert all(run(members, world_size, _moe_roundtrip, num_experts, topk, transport, is_async))


def _all_tokens_roundtrip(group, num_experts: int, topk: int, transport: str, use_fp8: bool):
    """Every token to every rank (dedup=False, counts given): no token is dropped or doubled, and
    combine returns what the deduplicated exchange returns, exactly."""
    counts = [(0, 1, 5, 33)[r % 4] for r in range(group.world_size)]
    x, ids, weights = _routing(counts[group.rank], num_experts, topk, seed=group.rank)
    kw = dict(num_experts=num_experts, transport=transport, use_fp8=use_fp8)
    every = group.dispatch(x, ids, weights, tokens_per_rank=counts, dedup=False, **kw)
    assert every.x.shape[0] == sum(counts)  # all tokens of every rank arrived here
    assert bool((every.topk_weights[every.topk_ids < 0] == 0).all())
    per_rank = num_experts // group.world_size
    held = int((every.topk_ids >= 0).sum())
    arrived = group.dispatch(x, ids, weights, **kw)  # deduplicated: the same expert slots here
    assert held == int((arrived.topk_ids >= 0).sum())
    assert bool((every.topk_ids < per_rank).all())
    back = group.combine(identity_experts(every.x, every.topk_weights), every.handle)
    y = group.combine(identity_experts(arrived.x, arrived.topk_weights), arrived.handle)
    assert torch.equal(back, y)
    if not use_fp8:
        torch.testing.assert_close(back, moe_identity_ref(x, weights), rtol=1e-5, atol=1e-5)
    return True


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize(
    "transport,use_fp8", [("dist", False), ("host", False), ("host", True)], ids=str
)
def test_all_tokens_dispatch_matches_the_deduplicated_one(members, world_size, transport, use_fp8):
    assert all(run(members, world_size, _all_tokens_roundtrip, 16, 4, transport, use_fp8))


def _skip_self_roundtrip(group, transport: str, use_fp8: bool):
    """skip_self (local_first's exchange): a rank's tokens go to the other ranks only; with its
    own experts' share passed to combine as an addend, combine returns what the exchange that
    sends every rank its own tokens too returns."""
    num_experts, topk = 16, 4
    counts = [(0, 1, 5, 33)[r % 4] for r in range(group.world_size)]
    x, ids, weights = _routing(counts[group.rank], num_experts, topk, seed=group.rank)
    kw = dict(num_experts=num_experts, transport=transport, use_fp8=use_fp8,
              tokens_per_rank=counts, dedup=False)  # fmt: skip
    others = group.dispatch(x, ids, weights, skip_self=True, **kw)
    assert others.x.shape[0] == sum(counts) - counts[group.rank]  # nothing of its own came back
    assert others.handle.in_splits[group.rank] == others.handle.out_splits[group.rank] == 0
    every = group.dispatch(x, ids, weights, **kw)
    per_rank = num_experts // group.world_size
    mine = (ids // per_rank) == group.rank  # [T, K]: this rank's experts' slots
    own = identity_experts(x, torch.where(mine, weights, 0.0))  # computed here, from x itself
    back = group.combine(identity_experts(others.x, others.topk_weights), others.handle,
                         addends=(own,))  # fmt: skip
    y = group.combine(identity_experts(every.x, every.topk_weights), every.handle)
    tol = 0.07 if use_fp8 else 1e-5  # fp8: own rows skip the e4m3 round trip here, not there
    torch.testing.assert_close(back, y, rtol=tol, atol=tol)
    if not use_fp8:
        torch.testing.assert_close(back, moe_identity_ref(x, weights), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="skip_self needs the all-tokens exchange"):
        group.dispatch(x, ids, weights, num_experts=num_experts, skip_self=True, dedup=True)
    return True


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize(
    "transport,use_fp8", [("dist", False), ("host", False), ("host", True)], ids=str
)
def test_skip_self_with_the_own_share_added_matches_every_rank(
    members, world_size, transport, use_fp8
):
    assert all(run(members, world_size, _skip_self_roundtrip, transport, use_fp8))


def _two_channels(group):
    """Host-staged exchanges on channels 0 and 1 (independent pipelines), interleaved."""
    n = group.world_size
    matrix = random_split_matrix(n, 40, torch.Generator().manual_seed(7))
    in_splits, out_splits = matrix[group.rank], [row[group.rank] for row in matrix]
    results = []
    for channel in (0, 1, 1, 0):
        inp = torch.arange(sum(in_splits) * 3, dtype=torch.float32).view(-1, 3) + channel
        out = torch.empty(sum(out_splits), 3)
        group.all_to_all(out, inp, out_splits, in_splits, "pairwise", "host", matrix, channel)
        results.append(out)
    inp = torch.arange(sum(in_splits) * 3, dtype=torch.float32).view(-1, 3)
    reference = torch.empty(sum(out_splits), 3)
    group.all_to_all(reference, inp, out_splits, in_splits, "nccl", "dist", matrix)
    exact = [torch.equal(out, reference + channel) for out, channel in zip(results, (0, 1, 1, 0))]
    distinct = group.transport("host", 1) is not group.transport("host", 0)
    return distinct and all(exact)


def test_host_channels_are_independent_pipelines_with_the_same_result(members):
    assert all(run(members, 2, _two_channels))


def _mailbox_exchanges(group, channel: int):
    """The host transport with its mailbox path on (the kernel in Triton's interpreter): blocks
    up to 100 bytes go through host mailboxes, larger ones through the copy pipeline, in the
    same exchange; every schedule, bf16 (30-byte rows) and int64 (120-byte rows)."""
    from rayinfer.exchange_config import HostStagedConfig

    n, me = group.world_size, group.rank
    group.use_host_staged(HostStagedConfig(direct_max_bytes=100))
    transport = group.transport("host", channel)  # made now, with the setting above
    group.topology = two_islands(n)
    gen = torch.Generator().manual_seed(11)
    failures = []
    for trial in range(4):
        matrix = random_split_matrix(n, 6, gen)
        dtype = (torch.bfloat16, torch.int64)[trial % 2]
        inputs = [(torch.randn(sum(row), 3, 5, generator=gen) * 100).to(dtype) for row in matrix]
        expected = all_to_all_ref(inputs, matrix)[me]
        for schedule in SCHEDULES:
            out = torch.full_like(expected, 7)
            group.all_to_all(
                out, inputs[me], [r[me] for r in matrix], matrix[me], schedule, "host",
                matrix, channel,
            )  # fmt: skip
            if not torch.equal(out, expected):
                failures.append(f"rank {me} {schedule} {dtype} {matrix}")
    return failures, transport.mailboxes.launches


@pytest.mark.parametrize("world_size", (2, 4))
def test_host_mailbox_path_equals_reference_beside_the_pipeline(members, world_size):
    results = run(members, world_size, _mailbox_exchanges, 3)
    assert sum((failures for failures, _ in results), []) == []
    assert all(launches > 0 for _, launches in results)  # the mailbox path did run


def _bad_token_counts(group):
    x, ids, weights = _routing(3, 8, 2, seed=0)
    errors = []
    for counts, dedup in [([3] * (group.world_size + 1), None), ([4] * group.world_size, None),
                          (None, False)]:  # fmt: skip
        try:
            group.dispatch(x, ids, weights, num_experts=8, tokens_per_rank=counts, dedup=dedup)
        except ValueError as error:
            errors.append(str(error))
    return errors


def test_token_counts_that_cannot_be_right_are_refused(members):
    errors = run(members, 2, _bad_token_counts)[0]
    assert len(errors) == 3
    assert "tokens_per_rank" in errors[0] and "one count per rank (2)" in errors[0]
    assert "3 (this rank's tokens) at position" in errors[1]
    assert "pass tokens_per_rank" in errors[2]


def test_expected_share_decides_between_the_two_exchanges():
    from rayinfer.comm.moe import ALL_TOKENS_MIN_SHARE, expected_share_per_rank

    # DeepSeek-V2-Lite on 2 ranks: almost every token needs the other rank -> all tokens
    assert expected_share_per_rank(64, 6, 2) == pytest.approx(0.988, abs=1e-3)
    # DeepSeek-V3 on 8 ranks: a third of the tokens would travel for nothing -> deduplicate
    assert expected_share_per_rank(256, 8, 8) < ALL_TOKENS_MIN_SHARE
    assert expected_share_per_rank(8, 8, 2) == 1.0  # top-k = all experts: every rank needed


def test_which_exchange_dispatch_takes():
    """What MoE layers ask before choosing to run their own tokens locally (local_first)."""
    from rayinfer.comm.moe import sends_all_tokens

    assert sends_all_tokens(64, 6, 2, [5, 7], dedup=None)  # V2-Lite shapes, counts known
    assert not sends_all_tokens(64, 6, 2, None, dedup=None)  # counts unknown: deduplicate
    assert not sends_all_tokens(256, 8, 8, [5] * 8, dedup=None)  # V3 on 8 ranks
    assert sends_all_tokens(256, 8, 8, [5] * 8, dedup=False)
    assert not sends_all_tokens(64, 6, 2, [5, 7], dedup=True)


def _fp8_error(group):
    x, ids, weights = _routing(40, 16, 4, seed=10 + group.rank)
    x = (x * torch.logspace(-3, 2, 64)).to(torch.bfloat16)  # channels across five decades
    exact = group.dispatch(x, ids, weights, num_experts=16, transport="host")
    fp8 = group.dispatch(x, ids, weights, num_experts=16, transport="host", use_fp8=True)
    assert torch.equal(fp8.topk_ids, exact.topk_ids)
    err = (fp8.x.float() - exact.x.float()).abs()
    return float((err / error_bound(exact.x)).max()) if err.numel() else 0.0


@pytest.mark.parametrize("world_size", (2, 8))
def test_fp8_dispatch_error_within_documented_bound(members, world_size):
    """fp8.py documents |err| <= |x| (2^-4 + 2^-8) + scale 2^-10; bf16 dispatch is the truth."""
    assert max(run(members, world_size, _fp8_error)) <= 1.0


def _standard_collectives(group, name: str):
    n, me = group.world_size, group.rank
    base = torch.arange(6, dtype=torch.float32) + 10 * me
    t = base.clone()
    col.allreduce(t, name)
    torch.testing.assert_close(t, sum(torch.arange(6.0) + 10 * r for r in range(n)))
    t = base.clone()
    col.allreduce(t, name, op=col.types.ReduceOp.MAX)
    torch.testing.assert_close(t, torch.arange(6.0) + 10 * (n - 1))
    gathered = [torch.empty(6) for _ in range(n)]
    col.allgather(gathered, base, name)
    torch.testing.assert_close(
        torch.stack(gathered), torch.stack([torch.arange(6.0) + 10 * r for r in range(n)])
    )
    t = base.clone()
    col.broadcast(t, src_rank=n - 1, group_name=name)
    torch.testing.assert_close(t, torch.arange(6.0) + 10 * (n - 1))
    t = base.clone()
    col.reduce(t, dst_rank=1, group_name=name)
    expected = sum(torch.arange(6.0) + 10 * r for r in range(n)) if me == 1 else base
    torch.testing.assert_close(t, expected)
    parts = [base + i for i in range(n)]
    out = torch.empty(6)
    col.reducescatter(out, parts, name)
    torch.testing.assert_close(out, sum(torch.arange(6.0) + 10 * r + me for r in range(n)))
    col.barrier(name)
    if me in (0, 1):
        t = base.clone() if me == 0 else torch.empty(6)
        col.send(t, 1, name) if me == 0 else col.recv(t, 0, name)
        torch.testing.assert_close(t, torch.arange(6.0))
    return True


@pytest.mark.parametrize("world_size", (2, 4))
def test_standard_collectives_match_torch(members, world_size):
    """allreduce (sum, max), allgather, broadcast, reduce, reducescatter, barrier, send/recv
    through ray.util.collective's own functions."""
    assert all(run(members, world_size, _standard_collectives, f"ws{world_size}"))


def _probe(group, cache_dir: str):
    from rayinfer.comm import probe as probe_module

    sizes = (4 << 10, 256 << 10)
    folder = __import__("pathlib").Path(cache_dir)
    first = probe_module.probe(group, iters=2, message_bytes=sizes, cache_dir=folder)
    again = probe_module.probe(group, iters=2, message_bytes=sizes, cache_dir=folder)  # cached
    return first == again and len(first.bandwidth) == group.world_size


def test_probe_measures_and_caches(members, tmp_path):
    assert all(run(members, 2, _probe, str(tmp_path)))
    assert len(list(tmp_path.glob("topology-*.json"))) == 1


def test_declarative_group_from_the_driver_then_destroyed(members):
    """create_collective_group in the driver; members find the group on first use, use both
    transports, then destroy it (shared memory unmapped, process group shut down)."""
    col.create_collective_group(members[:2], 2, [0, 1], backend="rayinfer", group_name="declared")
    assert all(ray.get([a.call.remote(_use_then_destroy, "declared") for a in members[:2]]))


def _use_then_destroy(group):
    t = torch.ones(3)
    col.allreduce(t, "declared")
    out = torch.empty(4, 2)
    group.all_to_all(out, torch.full((4, 2), float(group.rank)), [2, 2], [2, 2], "nccl", "host")
    col.destroy_collective_group("declared")
    return (
        bool((t == 2).all())
        and out[:2].sum() == 0
        and out[2:].sum() == 4
        and not (col.is_group_initialized("declared"))
    )
