"""Write tests/fixtures/format_v1: checkpoints committed by the code of 2026-11 (commit 1645e0a).

Run once, then never again: the fixture's point is that it was written by OLD code, so that
tests/formats/test_format_fixture.py proves that checkpoints committed before a change still load
after it. A change of the on-disk format adds a new fixture directory beside this one.

    python scripts/make_format_fixture.py tests/fixtures/format_v1
"""

from __future__ import annotations

import sys
from pathlib import Path

from asyncckpt import KeepLast, SyncCheckpointEngine
from asyncckpt.formats.components import Component

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from format_fixture_state import fixture_state  # noqa: E402


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=False)
    with SyncCheckpointEngine(out / "dcp", keep=KeepLast(2)) as engine:
        for step in (10, 20, 30):
            engine.save(step, fixture_state(step), metrics={"loss": 1.0 / step})
    components = {
        "policy": Component("dcp", "policy"),
        "data": Component("pt", "data.pt"),
    }
    with SyncCheckpointEngine(out / "components", components=components) as engine:
        engine.save(5, {"policy": fixture_state(5)["model"], "data": {"epoch": 1, "seen": 640}})


if __name__ == "__main__":
    main(Path(sys.argv[1]))
