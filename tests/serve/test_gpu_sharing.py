"""GPU shares per worker: whole GPUs when there are enough, shared on a one-GPU machine so that
the default app (one prefill and one decode worker) starts, and a clear refusal otherwise."""

import pytest

from rayinfer.app import phase_options
from rayinfer.config import ConfigError
from rayinfer.deployments.config import AppConfig
from rayinfer.deployments.gpu_sharing import gpus_needed, resolve_gpu_shares


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


def test_sizing_the_cache_from_memory_does_not_share_a_gpu():
    """Workers sharing a GPU would each count on the same free memory: set num_kv_blocks."""
    config = AppConfig.from_args({"decode.gpu_memory_utilization": "0.9"})
    with pytest.raises(ConfigError, match=r"decode\.gpu_memory_utilization.*num_kv_blocks"):
        resolve_gpu_shares(config, num_gpus=1)
    assert shares(resolve_gpu_shares(config, num_gpus=2)) == (1.0, 1.0)
