"""argparse value types shared by the command lines, each naming the limit it enforces, and the parser
they share (one-line errors, the version)."""

from __future__ import annotations

import argparse
from typing import NoReturn


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def fraction(text: str) -> float:
    """A number in (0, 1]."""
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def package_version() -> str:
    """This install's version, from the package metadata (`--version` of both commands)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kv-manager-service")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


class OneLineErrors(argparse.ArgumentParser):
    """An ArgumentParser whose mistakes are one line, naming `--help`, not the whole usage first."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
