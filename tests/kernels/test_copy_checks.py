"""copy_blocks' precondition on host integers: what the worker checks before a delta's copies move."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kernels.copy_checks import check_copies


def test_good_copies_pass():
    check_copies([], 4)
    check_copies([(0, 1), (0, 2), (0, 3)], 4)  # one source, several destinations
    check_copies([(3, 0), (2, 1)], 4)


@pytest.mark.parametrize(
    "copies, message",
    [
        ([(0, 1), (4, 2)], r"block ids in \[0, 4\) \(num_blocks\): copy 1 is 4 -> 2"),
        ([(0, -1)], r"block ids in \[0, 4\) \(num_blocks\): copy 0 is 0 -> -1"),
        ([(0, 1), (2, 1)], "must not repeat a destination block: copy 1 is 2 -> 1"),
        ([(0, 1), (1, 2)], "destination block as a source in the same call: copy 0 is 0 -> 1"),
        ([(1, 1)], "destination block as a source"),
    ],
)
def test_bad_copies_name_the_rule_and_the_copy(copies, message):
    with pytest.raises(ValueError, match=message):
        check_copies(copies, 4)


def test_the_check_imports_no_triton():
    """The worker imports it with its runner, before `kernels.load` decides how Triton runs."""
    code = "import sys, kernels.copy_checks; print('triton' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"
