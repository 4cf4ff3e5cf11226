"""Process-wide test setup.

The tests' device is decided once, in `devices.py` (imported first here, so
that `TRITON_INTERPRET` is set before any test module imports a kernel), and
served by the `device` fixture.

Hypothesis profiles, chosen with the `HYPOTHESIS_PROFILE` environment
variable (or pytest's `--hypothesis-profile`, which wins):

- `default` (when the variable is unset; `make test`): enough examples to
  find a broken invariant in seconds, small enough to keep the whole suite a
  few minutes long on a 2-core machine;
- `thorough`: ten times the examples and longer operation sequences in the
  stateful tests, for CI or a nightly run:
  `HYPOTHESIS_PROFILE=thorough .venv/bin/python -m pytest -q tests/core`.

The profile is loaded here, before any test module is imported, so every
`settings(...)` a test module builds inherits from it; a test that needs more
runs than others asks for a multiple of the profile's `max_examples` rather
than a fixed count, so `thorough` runs more everywhere.
"""

import os

import pytest
from devices import DEVICE
from hypothesis import settings

# Both profiles start from Hypothesis' own defaults, never from its derandomized
# "ci" profile (which it loads by itself when it detects a CI service).
_HYPOTHESIS_DEFAULTS = settings.get_profile("default")
settings.register_profile("default", _HYPOTHESIS_DEFAULTS, max_examples=100, stateful_step_count=40, deadline=None)
settings.register_profile("thorough", _HYPOTHESIS_DEFAULTS, max_examples=1000, stateful_step_count=100, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or "default")


@pytest.fixture(scope="session")
def device() -> str:
    """The device every test that computes uses: "cuda" when torch can use one, else "cpu"."""
    return DEVICE
