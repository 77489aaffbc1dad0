import pytest
import torch

import posenc  # noqa: F401  (loads libposenc.so: torch.ops.posenc.*)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
