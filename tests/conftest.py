"""Process-wide test setup.

Triton kernels run in the CPU interpreter unless a CUDA device is present.
The switch is read when a kernel module is imported, so it is set here,
before any test module imports one.
"""

import os
import shutil

if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
