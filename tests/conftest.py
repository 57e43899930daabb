import pytest

from asyncckpt import faults


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    """Run every ``@pytest.mark.anyio`` test under both anyio backends."""
    return request.param


@pytest.fixture(autouse=True)
def _no_faults_left_armed():
    faults.clear()
    yield
    faults.clear()
