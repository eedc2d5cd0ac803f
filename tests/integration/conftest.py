"""Shared fixtures: paths to the built binaries and the default model.

The tests run the real `aerie` binary. By default that is the ASan/UBSan
build (build/asan/aerie), so a leak or an out-of-bounds read in any command
fails the test that triggered it; AERIE_BIN overrides it.
"""
import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
GOLDEN = ROOT / "tests" / "golden"


def aerie_bin() -> Path:
    return Path(os.environ.get("AERIE_BIN", ROOT / "build" / "asan" / "aerie"))


class Result:
    def __init__(self, proc: subprocess.CompletedProcess):
        self.rc = proc.returncode
        self.out = proc.stdout
        self.err = proc.stderr

    def json(self):
        return json.loads(self.out)


def run_aerie(*args, env=None, input=None, timeout=120) -> Result:
    full_env = dict(os.environ)
    full_env.setdefault("ASAN_OPTIONS", "detect_leaks=1")
    # A stray AERIE_* in the caller's environment must not change results.
    for k in list(full_env):
        if k.startswith("AERIE_") and k != "AERIE_BIN":
            del full_env[k]
    if env:
        full_env.update(env)
    proc = subprocess.run([str(aerie_bin()), *map(str, args)], capture_output=True,
                          text=True, env=full_env, input=input, timeout=timeout,
                          cwd=ROOT)
    return Result(proc)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "serial: asserts on wall-clock time, so tools/run_tests.sh runs it after the others, "
        "with nothing beside it (the rest run two files at a time)")


@pytest.fixture(scope="session")
def model() -> Path:
    if not MODEL.exists():
        pytest.fail(f"{MODEL} is missing: run `make model` first")
    return MODEL


@pytest.fixture(scope="session")
def aerie():
    binary = aerie_bin()
    if not binary.exists():
        pytest.fail(f"{binary} is missing: run `make asan` first")
    return run_aerie
