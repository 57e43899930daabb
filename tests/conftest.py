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


# The longest files first: under `-n 2 --dist loadfile` each process takes the next file as it
# finishes one, so starting with the long ones lets the short ones fill in beside them, instead
# of one process running the torture test alone at the end (about 2 minutes of the wall time).
SLOW_FILES_FIRST = (
    "test_torture.py",
    "test_benchmarks.py",
    "test_megatron_engine.py",
    "test_hf_trainer.py",
    "test_multirank.py",
    "test_lightning.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: order in a file kept
