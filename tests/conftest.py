"""Shared fixtures: one Ray cluster for the whole test session (2-core CI machine)."""

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster shared by every test that needs one; shut down at session end."""
    import ray

    if not ray.is_initialized():
        ray.init(
            num_cpus=4,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
        )
    yield ray
    ray.shutdown()
