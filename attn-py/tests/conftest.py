"""Shared helpers of the attn package's tests: the golden fixtures and tolerances."""

import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))

FIXTURES = pathlib.Path(__file__).resolve().parents[2] / "tests" / "fixtures"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def assert_close(got, want, atol, rtol, what=""):
    """``got`` within ``atol + rtol |want|`` of ``want`` everywhere (NaN where want is NaN)."""
    got, want = got.double(), want.double()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol, equal_nan=True, msg=lambda m: f"{what}: {m}")
