"""One trainer script run as every rank, each a subprocess, for the tests that SIGKILL trainers.

Output goes to files, not pipes: a rank's worker inherits them and outlives its trainer, so a
pipe would keep the test waiting for the worker too. Leaving the ``with`` block kills any rank
still running (a test that failed half-way leaves no process behind).

Simulated nodes (``nodes_env``, ``sessions=True``, ``Ranks.lose_nodes``): torchrun's
environment on one machine, each trainer its own session, so a node's death is a ``killpg`` of
its trainers (their workers are in their groups).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
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

    def wait(self, ranks: Iterable[int] | None = None, timeout: float = RANK_TIMEOUT_S) -> None:
        """Wait for ``ranks`` (all by default) to exit."""
        for r in self.procs if ranks is None else ranks:
            self.procs[r].wait(timeout=timeout)

    def out(self, rank: int) -> str:
        return self.logs[rank][0].read_text()

    def err(self, rank: int) -> str:
        return self.logs[rank][1].read_text()

    def wait_for(self, word: str, timeout: float) -> None:
        """Until every rank has printed ``word``; a rank that exits first fails (its stderr)."""
        deadline = time.monotonic() + timeout
        for r, p in self.procs.items():
            while word not in self.out(r):
                assert p.poll() is None, f"rank {r} exited\n{self.err(r)}"
                assert time.monotonic() < deadline, f"rank {r}: no {word!r}\n{self.err(r)}"
                time.sleep(0.1)

    def lose_nodes(
        self, dead: set[int], per_node: int, workers: Mapping[int, int], gone_within: float
    ) -> None:
        """The nodes ``dead`` die whole (trainers and workers, SIGKILL), then the launcher
        tears down the other trainers; returns once the other workers (pids ``workers``) are
        gone (each writes what it holds, stands in for the dead, then exits)."""
        from test_flush_on_death import wait_gone

        lost = [r for r in self.procs if r // per_node in dead]
        rest = [r for r in self.procs if r // per_node not in dead]
        for r in lost:
            os.killpg(self.procs[r].pid, signal.SIGKILL)
        for r in lost:
            self.procs[r].wait(timeout=30)
            wait_gone(workers[r], 30)
        time.sleep(1.0)
        for r in rest:
            self.procs[r].send_signal(signal.SIGKILL)
            self.procs[r].wait(timeout=30)
        for r in rest:
            wait_gone(workers[r], gone_within)

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
    sessions: bool = False,
) -> Iterator[Ranks]:
    """Write ``script`` to ``tmp_path/<name>.py`` and start it as ranks ``0..world-1`` with
    ``args(rank)`` after the script's path, and ``envs[rank]`` over this environment.
    ``sessions``: each rank in a session of its own (a node, with its worker), killed whole."""
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
                    start_new_session=sessions,
                )
        yield Ranks(procs, logs)
    finally:
        for p in procs.values():
            if p.poll() is None:
                if sessions:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)
                else:
                    p.kill()
                p.wait()


def nodes_env(world: int, per_node: int) -> dict[int, dict[str, str]]:
    """torchrun's node variables for ranks ``0..world-1``, ``per_node`` ranks to a node."""
    return {
        r: {
            "GROUP_RANK": str(r // per_node),
            "LOCAL_WORLD_SIZE": str(per_node),
            "LOCAL_RANK": str(r % per_node),
        }
        for r in range(world)
    }
