"""The device every test that computes runs on, decided once for the whole suite.

`DEVICE` is "cuda" when this torch can use a CUDA device, otherwise "cpu".
On the CPU, Triton kernels run in the interpreter: `TRITON_INTERPRET=1` is
read when a kernel module is imported, so it is set here, and `conftest.py`
imports this module before any test module imports a kernel. A GPU machine
with a CPU build of torch therefore tests like a CPU machine.

Tests take the `device` fixture (`conftest.py`), or import `DEVICE` from
here when they need it at collection time (`from devices import DEVICE`).
"""

import os

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
