"""GPU shares per worker: whole GPUs when there are enough, shared on a one-GPU machine so that
the disaggregated app (one prefill and one decode worker) starts, and a clear refusal otherwise;
and `disaggregate=auto`: colocated exactly where the two phases would share GPUs."""

import pytest

from rayinfer.app import phase_options
from rayinfer.config import ConfigError
from rayinfer.deployments.config import COLOCATED_PHASES, AppConfig
from rayinfer.deployments.gpu_sharing import gpus_needed, resolve_gpu_shares, serves_disaggregated
from rayinfer.deployments.runtime import kv_memory_config


def shares(config: AppConfig) -> tuple:
    return config.prefill.gpus_per_worker, config.decode.gpus_per_worker


def test_enough_gpus_give_each_worker_a_whole_one():
    config = AppConfig.from_args({"prefill.tp": 2})
    assert gpus_needed(config) == {"prefill": 2, "decode": 1}
    assert shares(resolve_gpu_shares(config, num_gpus=4)) == (1.0, 1.0)


def test_one_gpu_machine_shares_it_between_the_phases():
    config = resolve_gpu_shares(AppConfig.from_args({}), num_gpus=1)
    assert shares(config) == (0.5, 0.5)
    bundles = phase_options(config, config.decode, use_gpus=True)["placement_group_bundles"]
    assert bundles[1] == {"GPU": 0.5, "CPU": 1.0}


def test_more_minimum_replicas_share_finer():
    config = AppConfig.from_args(
        {"decode.autoscaling.min_replicas": 2, "decode.autoscaling.max_replicas": 2}
    )
    assert shares(resolve_gpu_shares(config, num_gpus=2)) == (0.5, 0.5)


def test_a_given_share_is_kept():
    config = AppConfig.from_args({"prefill.gpus_per_worker": 0.25, "decode.gpus_per_worker": 0.25})
    assert shares(resolve_gpu_shares(config, num_gpus=1)) == (0.25, 0.25)


def test_multi_worker_replicas_never_share_a_gpu():
    config = AppConfig.from_args({"prefill.tp": 2})
    with pytest.raises(ConfigError, match="prefill 2, decode 1 GPUs") as error:
        resolve_gpu_shares(config, num_gpus=2)
    assert "gpus_per_worker" in str(error.value)


def test_share_must_be_a_fraction_of_one_gpu():
    with pytest.raises(ConfigError, match="gpus_per_worker"):
        AppConfig.from_args({"decode.gpus_per_worker": 2})


def test_a_shared_gpu_sizes_each_cache_from_its_share():
    """Workers sharing a GPU each take utilization x their share, minus their own usage
    (workers/runner/kv_memory.py), so the setting does not need whole GPUs."""
    config = resolve_gpu_shares(
        AppConfig.from_args({"decode.gpu_memory_utilization": "0.8"}), num_gpus=1
    )
    assert shares(config) == (0.5, 0.5)
    decode = kv_memory_config(config.decode, "decode", use_gpus=True, max_model_len=256)
    assert (decode.gpu_memory_utilization, decode.gpu_share) == (0.8, 0.5)
    prefill = kv_memory_config(config.prefill, "prefill", use_gpus=True, max_model_len=256)
    assert (prefill.gpu_memory_utilization, prefill.gpu_share) == (0.9, 0.5)  # the default


@pytest.mark.parametrize(
    "args, use_gpus, num_gpus, disaggregated",
    [
        ({}, False, 0, True),  # no GPUs: Prefill + Decode on the CPU, as before
        ({}, True, 1, False),  # one GPU: the phases would share it, so one engine
        ({}, True, 2, True),  # a GPU each
        ({"prefill.tp": "2"}, True, 2, False),  # 3 workers on 2 GPUs
        ({"prefill.tp": "2"}, True, 3, True),
        ({"decode.autoscaling.min_replicas": "2", "decode.autoscaling.max_replicas": "2"},
         True, 2, False),
        ({"disaggregate": "true"}, True, 1, True),  # asked for: shares the GPU
        ({"prefill.gpus_per_worker": "0.25", "decode.gpus_per_worker": "0.75"}, True, 1, True),
        ({"disaggregate": "false"}, False, 0, False),  # asked for: colocated on the CPU too
        ({"disaggregate": "false"}, True, 8, False),
    ],
)  # fmt: skip
def test_auto_is_colocated_exactly_where_the_phases_would_share_gpus(
    args, use_gpus, num_gpus, disaggregated
):
    config = AppConfig.from_args(args)
    assert serves_disaggregated(config, use_gpus, num_gpus) is disaggregated


def test_a_colocated_engine_takes_whole_gpus_and_never_shares_unasked():
    config = resolve_gpu_shares(AppConfig.from_args({}), 1, COLOCATED_PHASES)
    assert config.engine.gpus_per_worker == 1.0
    assert config.prefill.gpus_per_worker is None  # not served
    assert gpus_needed(config, COLOCATED_PHASES) == {"engine": 1}
    two = AppConfig.from_args({"engine.tp": "2"})
    with pytest.raises(ConfigError, match=r"engine 2 GPUs .* has 1; lower engine\.tp"):
        resolve_gpu_shares(two, 1, COLOCATED_PHASES)
    replicas = AppConfig.from_args(
        {"engine.autoscaling.min_replicas": "2", "engine.autoscaling.max_replicas": "2"}
    )
    with pytest.raises(ConfigError, match="engine.gpus_per_worker"):
        resolve_gpu_shares(replicas, 1, COLOCATED_PHASES)
    asked = AppConfig.from_args({"engine.gpus_per_worker": "0.5"})
    assert resolve_gpu_shares(asked, 1, COLOCATED_PHASES).engine.gpus_per_worker == 0.5
