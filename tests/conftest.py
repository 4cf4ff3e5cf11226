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

Tests marked `thorough` (heavy end-to-end ones, tens of seconds each on a
CPU) run only with the `thorough` profile or an explicit `-m`; otherwise they
are deselected, and pytest says how many.
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


# Heavy tests, tens of seconds each on a CPU (`@pytest.mark.thorough`), would take `make test` from a few
# minutes to over ten on 2 cores: they are deselected (counted, not skipped) unless the profile is
# `thorough`, as in CI, or an explicit `-m` expression decides the selection.
THOROUGH_DESELECTED = pytest.StashKey[int]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    profile = config.getoption("hypothesis_profile", None) or os.environ.get("HYPOTHESIS_PROFILE")
    if profile == "thorough" or config.getoption("markexpr"):
        return
    deselected = [item for item in items if item.get_closest_marker("thorough")]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if not item.get_closest_marker("thorough")]
    if hasattr(config, "workeroutput"):  # a pytest-xdist worker: its controller prints no "N deselected"
        config.workeroutput["thorough_deselected"] = len(deselected)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """pytest-xdist's controller: what its workers deselected (each collects every test, so the largest)."""
    count = getattr(node, "workeroutput", {}).get("thorough_deselected", 0)
    node.config.stash[THOROUGH_DESELECTED] = max(count, node.config.stash.get(THOROUGH_DESELECTED, 0))


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    if count := config.stash.get(THOROUGH_DESELECTED, 0):
        terminalreporter.write_line(f"{count} thorough tests deselected (HYPOTHESIS_PROFILE=thorough or -m thorough)")


@pytest.fixture(scope="session")
def device() -> str:
    """The device every test that computes uses: "cuda" when torch can use one, else "cpu"."""
    return DEVICE
