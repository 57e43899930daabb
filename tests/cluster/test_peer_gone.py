"""A rank's worker gone with its trainer, told to its run's other workers (peer_gone.py): the
record of a run's side store, the announcement, and the meeting before a save's group that
fails at once instead of waiting out the group's timeout."""

from __future__ import annotations

import datetime
import socket
import threading
import time

import pytest
import torch.distributed as dist

from asyncckpt.cluster import peer_gone


def _server() -> tuple[dist.TCPStore, int]:
    store = dist.TCPStore(
        "127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False
    )
    return store, store.port


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_rank_whose_worker_is_gone_tells_that_workers_run_only(tmp_path):
    server, port = _server()
    peer_gone.record_run(tmp_path, "127.0.0.1", port, "oldrun")
    peer_gone.note_worker(tmp_path, 3, "oldrun")  # rank 3's last worker served oldrun
    peer_gone.record_run(tmp_path, "127.0.0.1", port, "newrun")
    assert peer_gone.announce_if_gone(tmp_path, 3) == "oldrun"  # no lock held: it is gone
    assert server.get(peer_gone.gone_key("oldrun")) == b"3"
    assert not server.check([peer_gone.gone_key("newrun")])  # another run: not told
    assert peer_gone.announce_if_gone(tmp_path, 3) is None  # said once: its note went
    assert peer_gone.announce_if_gone(tmp_path, 4) is None  # no worker of rank 4 ever ran


def test_a_live_worker_is_not_said_gone(tmp_path):
    from asyncckpt.storage.localfs import lock_file, lock_path, unlock

    server, port = _server()
    peer_gone.record_run(tmp_path, "127.0.0.1", port, "run")
    peer_gone.note_worker(tmp_path, 1, "run")
    fd = lock_file(lock_path(tmp_path, "worker1"), wait=False)  # as the worker holds it
    assert fd is not None
    try:
        assert peer_gone.announce_if_gone(tmp_path, 1) is None
        assert not server.check([peer_gone.gone_key("run")])
    finally:
        unlock(fd)


def test_a_run_whose_store_is_gone_is_forgotten(tmp_path):
    peer_gone.record_run(tmp_path, "127.0.0.1", _free_port(), "deadrun")  # nobody serves it
    peer_gone.note_worker(tmp_path, 0, "deadrun")
    assert peer_gone.announce_if_gone(tmp_path, 0) is None
    assert peer_gone.recorded_runs(tmp_path) == {}
    peer_gone.record_run(tmp_path, "127.0.0.1", 1234, "x")
    peer_gone.forget_run(tmp_path, "x")
    assert peer_gone.recorded_runs(tmp_path) == {}


def test_records_of_crashed_runs_go_when_a_later_run_records_its_own(tmp_path):
    """A run whose rank 0 crashed never removed its record: each crash left one behind for
    good. A record only a worker's note leads to is kept; the others go."""
    for token in ("crashed1", "crashed2"):
        peer_gone.record_run(tmp_path, "127.0.0.1", 1, token)
    assert set(peer_gone.recorded_runs(tmp_path)) == {"crashed2"}  # (crashed1: no note)
    peer_gone.record_run(tmp_path, "127.0.0.1", 1, "waited-for")
    peer_gone.note_worker(tmp_path, 3, "waited-for")  # a worker of that run may still be met
    peer_gone.record_run(tmp_path, "127.0.0.1", 2, "now")
    assert peer_gone.recorded_runs(tmp_path) == {
        "waited-for": ("127.0.0.1", 1),
        "now": ("127.0.0.1", 2),
    }


def test_meet_returns_once_every_rank_came(tmp_path):
    server, _ = _server()
    other = threading.Thread(target=peer_gone.meet, args=(server, "run", "5.0", 2, 30, False))
    other.start()
    t0 = time.monotonic()
    peer_gone.meet(server, "run", "5.0", 2, 30, False)
    other.join(30)
    assert not other.is_alive() and time.monotonic() - t0 < 10


@pytest.mark.parametrize("says", [(False, False, False), (False, True, False), (True, False, True)])
def test_one_rank_asking_for_a_fresh_group_is_every_ranks_answer(says):
    """The meeting decides whether the group kept from the last save serves again: every rank
    must read the same answer, whichever rank asked and whenever it arrived (a rank reusing
    a group its peers re-form waits in a collective nobody else joins)."""
    server, _ = _server()
    answers: dict[int, bool] = {}

    def rank(r: int) -> None:
        if r == 2:
            time.sleep(0.3)  # (the last to arrive)
        answers[r] = peer_gone.meet(server, "run", f"6.{says}", 3, 30, says[r])

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert answers == dict.fromkeys(range(3), any(says))


def test_meet_fails_at_once_when_a_rank_is_said_gone(tmp_path):
    server, port = _server()
    peer_gone.record_run(tmp_path, "127.0.0.1", port, "run")
    errors: list[BaseException] = []

    def waiting() -> None:
        try:
            peer_gone.meet(server, "run", "7.0", 2, 600, False)  # rank 1 never comes
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=waiting)
    t.start()
    time.sleep(0.5)
    assert t.is_alive()  # waiting for rank 1
    t0 = time.monotonic()
    peer_gone.note_worker(tmp_path, 1, "run")
    assert peer_gone.announce_if_gone(tmp_path, 1) == "run"  # rank 1's new engine, no worker
    t.join(30)
    assert not t.is_alive() and time.monotonic() - t0 < 5  # not the 600 s timeout
    assert isinstance(errors[0], peer_gone.PeerWorkerGone)
    assert "rank 1's worker is gone" in str(errors[0])


def test_meet_times_out_when_a_rank_never_comes_and_nobody_says(tmp_path):
    server, _ = _server()
    with pytest.raises(TimeoutError, match="1 rank"):
        peer_gone.meet(server, "run", "9.0", 2, 1.0, True)


def test_a_meeting_cut_by_a_replaced_side_store_meets_again_on_a_new_connection(monkeypatch):
    """Rank 0's worker serves the side store; when it is killed and replaced while another
    rank's worker meets for a save, that meeting's connection is reset. The save failed on
    that rank ("Connection reset by peer") and rank 0's new worker waited the whole timeout
    for it (tests/e2e/test_multirank.py's plan-caching test, 2 of ~10 runs under load). It meets
    again only where the new connection reached another store: on the same store its count
    may already be in, and counting it twice would let the others pass without a rank."""
    from asyncckpt.cluster import dist as _dist

    server, port = _server()
    cfg = _dist.DistConfig(0, 1, 0, "127.0.0.1", port, "run", timeout=30.0)

    class Reset:
        def set(self, *a):
            raise dist.DistNetworkError("Connection reset by peer")

        add = check = set

    def connections(*named: tuple[object, str | None]) -> list:
        got = list(named)
        ids: list = []
        monkeypatch.setattr(
            _dist, "job_store", lambda cfg, **kw: ids.append(got[0][1]) or got.pop(0)[0]
        )
        monkeypatch.setattr(_dist, "job_store_id", lambda cfg: ids[-1])
        return got

    left = connections((Reset(), "old"), (server, "new"))
    assert peer_gone.meet_on_side_store(cfg, "6.0", True) is True
    assert left == []
    left = connections((Reset(), "same"), (server, "same"))
    with pytest.raises(dist.DistNetworkError):  # the same store: not counted twice
        peer_gone.meet_on_side_store(cfg, "7.0", True)
    left = connections((Reset(), None), (server, "new"))
    with pytest.raises(dist.DistNetworkError):  # a store that never said which it is
        peer_gone.meet_on_side_store(cfg, "8.0", True)
    recovery = _dist.DistConfig(0, 1, 0, "127.0.0.1", port, "run", 30.0, str(server))
    left = connections((Reset(), "old"), (server, "new"))
    with pytest.raises(dist.DistNetworkError):  # a file store: nothing to reconnect to
        peer_gone.meet_on_side_store(recovery, "9.0", True)


def test_a_meeting_again_fails_once_rank_0s_new_worker_meets_a_later_save():
    """Met again on the store of rank 0's new worker: if that worker meets for a later save,
    this one died with the old worker and never completes; waiting would cost the timeout.
    Rank 0 still behind (the last save's tag) is waited for."""
    server, _ = _server()
    peer_gone.meet(server, "run", "5.0", 1, 30, False, rank=0)  # rank 0 met for 5.0
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        peer_gone.meet(server, "run", "6.0", 2, 1.0, False, rank=1, again=True)
    assert time.monotonic() - t0 >= 0.9  # rank 0 behind: waited for
    # a later step; a later attempt; a persisted memory checkpoint after its disk save, or of
    # a later step (worker.job_tag)
    later = (("7.0", "6.1"), ("6.3", "6.2"), ("6.5.memory", "6.5"), ("8.0", "7.1.memory"))
    for rank0_at, mine in later:
        server.set("asyncckpt/run/rank0-meets", rank0_at)
        t0 = time.monotonic()
        with pytest.raises(peer_gone.PeerWorkerGone, match=f"went on to save {rank0_at}"):
            peer_gone.meet(server, "run", mine, 2, 30, False, rank=1, again=True)
        assert time.monotonic() - t0 < 5
    with pytest.raises(TimeoutError):  # not met again: rank 0's tag is not looked at
        peer_gone.meet(server, "run", "6.4", 2, 0.5, False, rank=1)


def test_a_memory_checkpoint_persisted_after_its_steps_failed_disk_save_meets_anew():
    """The memory tier gives a disk save and the memory copy staged with it one attempt. The
    disk save fails after both ranks met (its count whole, its keys kept); the trainer then
    dies and the memory copy is persisted: under the disk save's tag, rank 0 would find the
    count whole and go on without rank 1. Under its own tag it waits for rank 1."""
    from asyncckpt.worker.loop import SaveJob, job_tag

    def job(tier: str) -> SaveJob:
        return SaveJob(1, 7, [], None, {}, None, {}, attempt=2, tier=tier)

    disk, memory = job_tag(job("disk")), job_tag(job("memory"))
    assert disk == "7.2" and memory != disk
    server, _ = _server()
    met: list[bool] = []
    ranks = [
        threading.Thread(
            target=lambda r=rank: met.append(
                peer_gone.meet(server, "run", disk, 2, 10.0, False, rank=r)
            )
        )
        for rank in (0, 1)
    ]
    for t in ranks:
        t.start()
    for t in ranks:
        t.join(15)
    assert met == [False, False]
    with pytest.raises(TimeoutError, match="never came"):
        peer_gone.meet(server, "run", memory, 2, 0.3, False, rank=0)


_SERVE_LATE = """
import datetime, sys, time
import torch.distributed as dist
from asyncckpt.cluster import dist as _dist
fd, port, delay, name = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
store = dist.TCPStore("127.0.0.1", port, None, True, datetime.timedelta(seconds=30),
                      wait_for_workers=False, use_libuv=True, master_listen_fd=fd)
time.sleep(delay)  # as dist.serve: the store accepts first, and names itself after
store.set(_dist.STORE_ID_KEY, name)
time.sleep(120)
"""


class _Served:
    """Side stores served as rank 0's workers serve them (``dist.serve``), each a process on
    the one listening socket its trainer keeps; ``serve(delay, name)`` starts the next one,
    which names itself ``delay`` seconds after it accepts."""

    def __init__(self) -> None:
        from asyncckpt.cluster.framing import listen

        self.listener = listen()
        self.port = self.listener.getsockname()[1]
        self.procs: list = []

    def serve(self, delay: float, name: str):
        import subprocess
        import sys

        fd = self.listener.fileno()
        argv = [sys.executable, "-c", _SERVE_LATE, str(fd), str(self.port), str(delay), name]
        self.procs.append(subprocess.Popen(argv, pass_fds=(fd,)))
        return self.procs[-1]

    def connect(self, cfg) -> None:
        """This worker's connection (``job_store``), once the first store serves."""
        from asyncckpt.cluster import dist as _dist

        deadline = time.monotonic() + 60
        while _dist.job_store_id(cfg) is None and time.monotonic() < deadline:
            _dist.forget_job_store(cfg)
            _dist.job_store(cfg)
            time.sleep(0.1)

    def replace(self, old, delay: float, name: str) -> None:
        """Rank 0's worker ``old`` killed, a new one serving (named after ``delay`` s)."""
        old.kill()
        old.wait(30)
        self.serve(delay, name)

    def close(self, cfg) -> None:
        from asyncckpt.cluster import dist as _dist

        _dist.forget_job_store(cfg)
        _dist._job_store_id.pop((cfg.host, cfg.port), None)
        for p in self.procs:
            p.kill()
            p.wait(30)
        self.listener.close()


@pytest.fixture
def served_old():
    """A store served as ``"old"``, this worker connected to it: (served, cfg, old)."""
    from asyncckpt.cluster import dist as _dist

    served = _Served()
    cfg = _dist.DistConfig(0, 1, 0, "127.0.0.1", served.port, "run", timeout=30.0)
    old = served.serve(0.0, "old")
    try:
        served.connect(cfg)
        assert _dist.job_store_id(cfg) == "old"
        yield served, cfg, old
    finally:
        served.close(cfg)


def test_a_meeting_again_waits_for_the_new_store_to_say_which_it_is(monkeypatch, served_old):
    """Rank 0's new worker serves its store as soon as the store listens and names it just
    after (``dist.serve``). A rank whose meeting was cut reconnects at once, in the socket's
    backlog, and asked for the name before it was set: "a store that never said which it is",
    so it gave the save up (the plan-caching test of tests/e2e/test_multirank.py, once in a CI
    run). The new store is waited for to name itself; that worker meets again there."""
    from asyncckpt.cluster import dist as _dist

    served, cfg, old = served_old
    real_meet = peer_gone.meet
    calls: list[bool] = []

    def meet_while_rank_0s_worker_is_replaced(store, *args, **kw):
        if not calls:  # the first meeting: its store's server dies under it
            served.replace(old, 3.0, "new")
        calls.append(kw.get("again", False))
        return real_meet(store, *args, **kw)

    monkeypatch.setattr(peer_gone, "meet", meet_while_rank_0s_worker_is_replaced)
    assert peer_gone.meet_on_side_store(cfg, "6.0", False) is False
    assert calls == [False, True]  # cut, then met again on the new store
    assert _dist.job_store_id(cfg) == "new"


def test_a_connection_replaced_between_saves_learns_the_new_stores_name(served_old):
    """Rank 0's worker replaced between two saves: the next save's ``job_store`` reconnects
    (the old connection fails its check) and read the new store's name before it was set:
    none. A meeting of that save cut by yet another replacement then could not tell the
    stores apart and gave the save up. A store after a named one is waited for to say its."""
    from asyncckpt.cluster import dist as _dist

    served, cfg, old = served_old
    served.replace(old, 3.0, "new")
    _dist.job_store(cfg)  # the next save's: reconnects, in the backlog
    assert _dist.job_store_id(cfg) == "new"
