"""Shared fixtures: one Ray cluster for the whole test session (2-core CI machine).

Triton kernels run on CPU tensors through Triton's interpreter. The switch is read when a kernel
is decorated, so it is set here, before any test module imports rayinfer (whose comm and layers
import the kernel modules through ops.py)."""

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
# One torch (OpenMP) thread in this process too, as in the Ray workers and Serve processes the
# tests start: on 2 cores shared with those, two threads spin-wait on each other, and a tiny
# model's decode step in this process ran 3-4x slower beside one busy process (tens of times
# beside several). Set before anything imports torch; the subprocesses inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

if os.environ["TRITON_INTERPRET"] == "1":
    from interpreter_bounds import install

    install()


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
