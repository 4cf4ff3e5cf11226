"""The worker's flags: the kernel backend follows the device unless given."""

from __future__ import annotations

import pytest

from gpu_worker.cli import backend_caveat, parse_args


@pytest.mark.parametrize(
    "flags, backend",
    [
        ([], "torch"),
        (["--device", "cpu"], "torch"),
        (["--device", "cuda"], "triton"),
        (["--device", "cuda", "--backend", "torch"], "torch"),
        (["--device", "cpu", "--backend", "triton"], "triton"),
    ],
)
def test_the_backend_defaults_to_triton_on_cuda_and_torch_on_a_cpu(flags, backend):
    assert parse_args(["--manager", "127.0.0.1:1", *flags]).backend == backend


def test_the_torch_backend_on_cuda_is_warned_about():
    assert "--backend triton" in backend_caveat("cuda", "torch")
    assert backend_caveat("cuda", "triton") is None and backend_caveat("cpu", "torch") is None
