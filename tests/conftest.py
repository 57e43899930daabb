import os
import sys
from pathlib import Path

import pytest
import torch

from asyncckpt import faults

#: The tests live by wing (tests/<wing>/), their shared helpers beside this file. A test, or a
#: script it runs in a subprocess, imports a helper or another test's helpers by module name
#: (``from statecmp import ...``, ``from test_multirank import run_ranks``): every folder goes
#: on the path, here and in the environment that subprocesses inherit.
TESTS = Path(__file__).parent
_DIRS = [str(TESTS), *sorted(str(d) for d in TESTS.iterdir() if any(d.glob("test_*.py")))]
sys.path[:0] = [d for d in _DIRS if d not in sys.path]
os.environ["PYTHONPATH"] = os.pathsep.join(
    [*_DIRS, *([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])]
)


@pytest.fixture
def anyio_backend():
    """``@pytest.mark.anyio`` tests run under asyncio; mark a test with
    ``pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])`` to run it under trio as well."""
    return "asyncio"


@pytest.fixture(autouse=True)
def _no_faults_left_armed():
    faults.clear()
    yield
    faults.clear()


@pytest.fixture
def torch_crc32():
    """Set ``torch.save``'s CRC-32 option (``torch_crc32(False)``) through torch's public API;
    the test's value is undone after it.

    Never monkeypatch torch's config proxy: pytest 9.2's undo deletes the setting, and every
    later ``torch.save`` in the process fails.
    """
    before = torch.serialization.get_crc32_options()
    try:
        yield torch.serialization.set_crc32_options
    finally:
        torch.serialization.set_crc32_options(before)


@pytest.fixture(autouse=True)
def _torch_save_settings_intact():
    # A test that leaves torch's save settings changed (or deleted) breaks every later save in
    # its process, far from the cause: fail the test that did it instead.
    before = torch.serialization.get_crc32_options()
    yield
    try:
        after = torch.serialization.get_crc32_options()
    except AttributeError as e:
        pytest.fail(f"this test deleted torch's compute_crc32 setting ({e})")
    if after != before:
        torch.serialization.set_crc32_options(before)
        pytest.fail(f"this test left torch's compute_crc32 at {after} (was {before})")
