"""Fixtures of the GPU tests."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture
def exact_fp32_matmuls():
    """fp32 matmuls and convolutions without TF32 for the test (restored after): the GPU parity
    tests compare with torch at fp32 bounds, which TF32's 10-bit mantissa would not meet."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
