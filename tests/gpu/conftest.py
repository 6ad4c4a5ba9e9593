"""Fixtures of the GPU tests: each tiny checkpoint of families.FAMILIES made once a session, and
a skip of every test where tests/conftest.py left Triton's interpreter on over a CUDA GPU (it
would run the kernels on the host, and the Gluon ones not at all):

    TRITON_INTERPRET=0 python -m pytest -q -m gpu tests/gpu
"""

import os

import pytest
import torch

from tests.gpu.families import FAMILIES, WITH_ROUTING_BIASES
from tests.models.harness import make_deepseek_checkpoint, make_hf_checkpoint


@pytest.fixture(scope="session")
def checkpoint_of(tmp_path_factory):
    """checkpoint_of(family) -> the folder of FAMILIES[family], written on first use."""
    made = {}

    def checkpoint(family: str):
        if family not in made:
            model_type, overrides = FAMILIES[family]
            folder = tmp_path_factory.mktemp(family)
            if family in WITH_ROUTING_BIASES:
                made[family] = make_deepseek_checkpoint(folder, model_type, **overrides)
            else:
                made[family] = make_hf_checkpoint(folder, model_type, **overrides)
        return made[family]

    return checkpoint


@pytest.fixture(autouse=True)
def compiled_triton():
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("Triton's interpreter is on: run the GPU tests with TRITON_INTERPRET=0")
