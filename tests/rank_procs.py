"""One trainer script run as every rank, each a subprocess, for the tests that SIGKILL trainers.

Output goes to files, not pipes: a rank's worker inherits them and outlives its trainer, so a
pipe would keep the test waiting for the worker too. Leaving the ``with`` block kills any rank
still running (a test that failed half-way leaves no process behind).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

#: How long a rank may run before the test gives up on it.
RANK_TIMEOUT_S = 240


class Ranks:
    """The running ranks of one script: their processes and their output files."""

    def __init__(self, procs: dict[int, subprocess.Popen], logs: dict[int, tuple[Path, Path]]):
        self.procs = procs
        self.logs = logs

    def wait(self, ranks: Iterable[int] | None = None) -> None:
        """Wait for ``ranks`` (all by default) to exit."""
        for r in self.procs if ranks is None else ranks:
            self.procs[r].wait(timeout=RANK_TIMEOUT_S)

    def out(self, rank: int) -> str:
        return self.logs[rank][0].read_text()

    def err(self, rank: int) -> str:
        return self.logs[rank][1].read_text()

    def assert_exited(self, want: Callable[[int], int]) -> None:
        """Every rank exited with ``want(rank)`` (e.g. ``-signal.SIGKILL``); else its stderr."""
        for r, p in self.procs.items():
            assert p.returncode == want(r), f"rank {r}: {p.returncode}\n{self.err(r)}"


@contextmanager
def ranks_running(
    tmp_path: Path,
    script: str,
    name: str,
    world: int,
    args: Callable[[int], list[str]],
    envs: Mapping[int, Mapping[str, str]] | None = None,
) -> Iterator[Ranks]:
    """Write ``script`` to ``tmp_path/<name>.py`` and start it as ranks ``0..world-1`` with
    ``args(rank)`` after the script's path, and ``envs[rank]`` over this environment."""
    path = tmp_path / f"{name}.py"
    path.write_text(script)
    procs, logs = {}, {}
    try:
        for r in range(world):
            logs[r] = (tmp_path / f"{name}{r}.out", tmp_path / f"{name}{r}.err")
            with open(logs[r][0], "w") as out, open(logs[r][1], "w") as err:
                procs[r] = subprocess.Popen(
                    [sys.executable, str(path), *args(r)],
                    stdout=out,
                    stderr=err,
                    env={**os.environ, **(envs or {}).get(r, {})},
                )
        yield Ranks(procs, logs)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
