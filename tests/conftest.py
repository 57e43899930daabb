import pytest

from asyncckpt import faults


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
