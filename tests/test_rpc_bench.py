"""bench/rpc_bench.py's same-run comparison with vLLM: how it runs the baselines kit's program, and its flags."""

from __future__ import annotations

import importlib.util
import re
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def rpc_bench():
    sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("rpc_bench", ROOT / "bench" / "rpc_bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]
        sys.path.remove(str(ROOT / "bench"))


def test_the_baseline_program_gets_its_arguments_and_path_and_its_json_line_is_read(rpc_bench, tmp_path):
    source = tmp_path / "vllm-src"
    source.mkdir()
    program = tmp_path / "baseline.py"
    program.write_text(textwrap.dedent(
        f"""
        import json, os, sys
        assert os.environ["PYTHONPATH"] == {str(source)!r}, os.environ["PYTHONPATH"]
        n, p, d = map(int, sys.argv[1:])
        print("warming up")
        print(json.dumps({{"step_ms_p50": n / 128 + d, "prefill_ms_total": p / 10}}))
        """
    ))  # fmt: skip
    baseline = rpc_bench.VllmBaseline(Path(sys.executable), source, program)
    assert baseline.run(256, 1000, 3) == (5.0, 100.0)


def test_a_failing_baseline_is_reported_with_its_stderr(rpc_bench, tmp_path):
    program = tmp_path / "baseline.py"
    program.write_text("import sys; sys.exit('no module named vllm')")
    with pytest.raises(RuntimeError, match="the vLLM baseline failed .1.: no module named vllm"):
        rpc_bench.VllmBaseline(Path(sys.executable), tmp_path, program).run(1, 1, 1)


def test_the_vllm_flags_go_together_and_must_exist(rpc_bench, tmp_path, capsys):
    for argv, message in (
        (["--vllm-python", sys.executable], "go together"),
        (["--vllm-python", sys.executable, "--vllm-source", str(tmp_path), "--vllm-baseline", str(tmp_path / "x.py")],
         "--vllm-baseline .*x.py: no such file"),
    ):  # fmt: skip
        with pytest.raises(SystemExit) as exited:
            rpc_bench.main(argv)
        assert exited.value.code == 2
        assert re.search(message, capsys.readouterr().err)
