"""Nothing read from the side store or the hot-resume socket runs as code.

The workers' side store is torch's TCPStore: anyone who reaches its port may ``set`` any key.
The hot resume's agreement (several ranks taking a step from memory) and the node-local load's
step agreement read values from it; the hot-resume client reads a surviving worker's offer
from a local socket. Each of those was a pickle: a stranger's value under the right key ran
its code in every process that read it. Now they are JSON, decoded by type: a pickle whose
``__reduce__`` would create a marker file, or a value of the wrong shape, is refused with an
error that says what and where, and the reader falls back as it does for any other failure
(the hot resume to the disk; the load's step agreement fails the load on the ranks that read
it: no step is chosen on a value nobody can vouch for).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import socket
import struct
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from asyncckpt import NoValidCheckpoint, SyncCheckpointEngine
from asyncckpt.cluster import dist as _dist


class Boom:
    """A pickle that creates ``marker`` when it is loaded (``open(marker, "w")``)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (open, (str(self.marker), "w"))


def boom(tmp_path: Path) -> tuple[bytes, Path]:
    marker = tmp_path / "ran-the-strangers-code"
    payload = pickle.dumps(Boom(marker))
    assert not marker.exists()
    return payload, marker


#: The run's secret in the node-local load's tests: its values in the store are signed with it.
SECRET = "a" * 64
#: What the refusal says: unsigned (a stranger), or signed and still not asyncckpt's JSON.
WHY = {False: "not written by this run", True: "not JSON"}


def signed(key: str, value: bytes) -> bytes:
    """``value`` as a process of the run (one that knows ``SECRET``) writes it under ``key``."""
    from asyncckpt.cluster.peerdata import SignedStore

    box = dist.HashStore()
    SignedStore(box, SECRET).set(key, value)
    return bytes(box.get(key))


class Seen:
    """One rank's view of the shared store; ``get`` of ``key`` answers ``value`` (what a
    stranger wrote there between the honest rank's write and this read; ``sign``: as a
    process that knows the run's secret would, e.g. another asyncckpt version)."""

    def __init__(
        self, store: Any, key: str | None = None, value: bytes = b"", sign: bool = False
    ) -> None:
        self.store, self.key = store, key
        self.value = signed(key, value) if sign and key is not None else value

    def get(self, key: str) -> bytes:
        return self.value if key == self.key else self.store.get(key)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def threads(target: Any, world: int) -> None:
    ts = [threading.Thread(target=target, args=(r,)) for r in range(world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not any(t.is_alive() for t in ts)


# ------------------------------------------------------------------ the hot resume's agreement


def _early_offer(rank: int, world: int, timeout: float = 30.0) -> Any:
    from asyncckpt.memory.hot_serve import Offer

    cfg = _dist.DistConfig(rank, world, rank, "127.0.0.1", 1, "tok", timeout, secret=SECRET)
    staged = {"w": (torch.float32, (4,), 0x1234)}
    return Offer(3, rank, (), {"w": (0, 0, 16)}, (16,), 0, staged, {}, {}, cfg, world)


def _agree_as_rank_1(
    monkeypatch, tmp_path: Path, rank_0_said: bytes, sign: bool = False
) -> tuple[bool, str]:
    """Rank 1 of two agrees while rank 0's key holds ``rank_0_said`` (a stranger's; ``sign``:
    written by a process that knows the run's secret)."""
    from asyncckpt.memory.hot_agree import agree

    key = "asyncckpt/tok/hot-early/0"
    store = dist.HashStore()
    store.set(key, signed(key, rank_0_said) if sign else rank_0_said)
    monkeypatch.setattr(_dist, "side_store", lambda cfg: store)
    return agree(_early_offer(1, 2), 1, 2, True)


@pytest.mark.parametrize("sign", [False, True])
def test_a_strangers_pickle_as_a_ranks_word_runs_nothing_and_sends_the_rank_to_disk(
    tmp_path, monkeypatch, sign
):
    payload, marker = boom(tmp_path)
    agreed, why = _agree_as_rank_1(monkeypatch, tmp_path, payload, sign)
    assert not marker.exists()
    assert not agreed
    assert "refused" in why and "asyncckpt/tok/hot-early/0" in why and WHY[sign] in why, why


def test_a_forged_well_formed_word_from_outside_the_run_sends_the_rank_to_disk(
    tmp_path, monkeypatch
):
    """Rank 0's word as asyncckpt writes it, the same step and checksums, written by a process
    without the run's secret: believed, it would make rank 1 keep memory rank 0 never took."""
    forged = b'{"step": 3, "tensors": {"w": 4660}, "objects": {}}'
    agreed, why = _agree_as_rank_1(monkeypatch, tmp_path, forged)
    assert not agreed
    assert "not written by this run" in why, why
    assert _agree_as_rank_1(monkeypatch, tmp_path, forged, sign=True) == (True, "")


@pytest.mark.parametrize(
    "said, problem",
    [
        (b"{not json", "not JSON"),
        (b'{"step": "3", "tensors": {}, "objects": {}}', "step"),
        (b'{"step": 3, "tensors": {"w": -1}, "objects": {}}', "'w'"),
        (b'{"step": 3, "tensors": {"w": 4294967296}, "objects": {}}', "'w'"),
        (b'{"step": 3, "tensors": {"w": true}, "objects": {}}', "'w'"),
        (b'{"step": 3, "tensors": {}}', "objects"),
        (b'{"step": 3, "tensors": {}, "objects": {}, "more": 1}', "more"),
        (b"[3, {}, {}]", "object"),
        (b'{"step": NaN, "tensors": {}, "objects": {}}', "NaN"),
        (b"\xff\xfe", "not JSON"),
    ],
)
def test_a_malformed_word_is_refused_and_sends_the_rank_to_disk(
    tmp_path, monkeypatch, said, problem
):
    agreed, why = _agree_as_rank_1(monkeypatch, tmp_path, said, sign=True)
    assert not agreed
    assert "refused" in why and problem in why, why


def test_two_honest_ranks_still_agree_over_json(monkeypatch):
    from asyncckpt.memory.hot_agree import agree

    store = dist.HashStore()
    monkeypatch.setattr(_dist, "side_store", lambda cfg: store)
    said: list[Any] = [None, None]

    def rank(r: int) -> None:
        said[r] = agree(_early_offer(r, 2), r, 2, True)

    threads(rank, 2)
    assert said == [(True, ""), (True, "")]


# ------------------------------------------------------------------ the node-local load's agreement


def _choose(
    tmp_path: Path, monkeypatch, views: list[Any], world: int = 2, timeout: float = 20.0
) -> list[Any]:
    """Every rank's ``StepAgreement.choose`` at once (one rank per node, each with its own
    empty root and steps [10, 20]): its ``Agreed``, or the exception it raised."""
    from asyncckpt.trainer.local_load import StepAgreement

    monkeypatch.setattr(_dist, "side_store", lambda cfg: views[cfg.rank])
    out: list[Any] = [None] * world

    def rank(r: int) -> None:
        cfg = _dist.DistConfig(
            r, world, r, "127.0.0.1", 1, "tok", timeout, ranks_per_node=1, secret=SECRET
        )
        root = tmp_path / f"node{r}"
        root.mkdir()
        try:
            out[r] = StepAgreement(cfg, root, "global_step").choose([10, 20])
        except Exception as e:  # noqa: BLE001 - checked by the test
            out[r] = e

    threads(rank, world)
    return out


PLAN = "asyncckpt/tok/load-steps/1/plan"
RANK_1_WORD = "asyncckpt/tok/load-steps/1/1"


@pytest.mark.parametrize("sign", [False, True])
def test_a_strangers_pickle_as_the_plan_runs_nothing_and_fails_that_ranks_load(
    tmp_path, monkeypatch, sign
):
    payload, marker = boom(tmp_path)
    shared = dist.HashStore()
    out = _choose(tmp_path, monkeypatch, [Seen(shared), Seen(shared, PLAN, payload, sign)])
    assert not marker.exists()
    assert out[0].choice.step == 20  # rank 0 read its own plan
    assert isinstance(out[1], NoValidCheckpoint), out[1]
    msg = str(out[1])
    assert "refused" in msg and PLAN in msg and WHY[sign] in msg, msg
    assert shared.num_keys() == 0  # the load's keys removed as after any load


@pytest.mark.parametrize("sign", [False, True])
def test_a_strangers_pickle_as_a_ranks_word_runs_nothing_and_fails_every_ranks_load(
    tmp_path, monkeypatch, sign
):
    payload, marker = boom(tmp_path)
    shared = dist.HashStore()
    views = [Seen(shared, RANK_1_WORD, payload, sign), Seen(shared)]
    out = _choose(tmp_path, monkeypatch, views)
    assert not marker.exists()
    for r in (0, 1):  # rank 0 says why in the plan: no rank waits for a plan that never comes
        assert isinstance(out[r], NoValidCheckpoint), out[r]
        msg = str(out[r])
        assert "refused" in msg and RANK_1_WORD in msg and WHY[sign] in msg, msg


def test_a_forged_well_formed_plan_from_outside_the_run_is_refused(tmp_path, monkeypatch):
    """A plan as asyncckpt writes it (an older step, a replica to drop), by a process that does
    not know the run's secret: acted on, it would load another step or drop a held replica."""
    forged = (
        b'{"step": 10, "fetch": {}, "fell_back": false, "reason": "", '
        b'"addrs": {}, "drop": {"0": {"1": [20]}}}'
    )
    shared = dist.HashStore()
    out = _choose(tmp_path, monkeypatch, [Seen(shared), Seen(shared, PLAN, forged)])
    assert out[0].choice.step == 20  # rank 0's own plan: the newest step
    assert isinstance(out[1], NoValidCheckpoint), out[1]
    assert "not written by this run" in str(out[1]) and PLAN in str(out[1])


@pytest.mark.parametrize(
    "key, said, problem",
    [
        (
            PLAN,
            b'{"step": "20", "fetch": {}, "fell_back": false, "reason": "", '
            b'"addrs": {}, "drop": {}}',
            "step",
        ),  # fmt: skip
        (
            PLAN,
            b'{"step": 20, "fetch": {"1": 7}, "fell_back": false, "reason": "", '
            b'"addrs": {}, "drop": {}}',
            "fetch",
        ),  # fmt: skip  (rank 7 of 2)
        (
            PLAN,
            b'{"step": 20, "fetch": {}, "fell_back": false, "reason": "", '
            b'"addrs": {"0": ["h", 70000]}, "drop": {}}',
            "addrs",
        ),  # fmt: skip
        (
            PLAN,
            b'{"step": 20, "fetch": {}, "fell_back": false, "reason": "", '
            b'"addrs": {}, "drop": {"0": {"1": ["../x"]}}}',
            "drop",
        ),  # fmt: skip
        (PLAN, b"[20, {}, {}]", "object"),
        (RANK_1_WORD, b'{"disk": ["20"], "held": {}, "addr": null}', "disk"),
        (RANK_1_WORD, b'{"disk": [20], "held": {"x": [1]}, "addr": null}', "held"),
        (RANK_1_WORD, b'{"disk": [20], "held": {}}', "addr"),
        (RANK_1_WORD, b'{"disk": [20], "held": {}, "addr": [1, 2]}', "addr"),
    ],
)
def test_a_malformed_agreement_value_is_refused(tmp_path, monkeypatch, key, said, problem):
    shared = dist.HashStore()  # (signed: what a process of the run wrote, then decoded)
    views = [Seen(shared, key, said, True) if key == RANK_1_WORD else Seen(shared), Seen(shared)]
    if key == PLAN:
        views = [Seen(shared), Seen(shared, key, said, True)]
    out = _choose(tmp_path, monkeypatch, views)
    refused = [1] if key == PLAN else [0, 1]
    for r in refused:
        assert isinstance(out[r], NoValidCheckpoint), out[r]
        msg = str(out[r])
        assert "refused" in msg and key in msg and problem in msg, msg


def test_a_fetch_outcome_is_a_string_or_refused():
    from asyncckpt.cluster.peerdata import Malformed, dumps
    from asyncckpt.trainer.local_load import decode_outcome

    assert decode_outcome(dumps("ok"), "k") == "ok"
    assert decode_outcome(dumps("node 1: OSError: gone"), "k") == "node 1: OSError: gone"
    for bad in (pickle.dumps("ok"), b"ok", b"1", b"null"):
        with pytest.raises(Malformed, match="refused"):
            decode_outcome(bad, "k")


# ------------------------------------------------------------------ the hot-resume socket


def _serve_once(root: Path, rank: int, data: bytes, head: int, fds: list[int]) -> threading.Thread:
    """A process of this user offering ``data`` on the hot-resume socket of ``root`` and
    ``rank``: its first ``head`` bytes with ``fds`` (SCM_RIGHTS), then the rest."""
    from asyncckpt.memory.hot_serve import socket_name

    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(socket_name(root, rank))
    server.listen(1)

    def run() -> None:
        with server:
            conn, _ = server.accept()
            with conn:
                socket.send_fds(conn, [data[:head]], fds)
                conn.sendall(data[head:])
                conn.settimeout(60)
                try:
                    conn.recv(1)  # until the client hangs up
                except OSError:
                    pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _memfd(size: int = 4096) -> int:
    fd = os.memfd_create("asyncckpt-test")
    os.ftruncate(fd, size)
    return fd


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _header(n: int) -> bytes:
    from asyncckpt.memory.hot_offer import HEADER, MAGIC

    return HEADER.pack(MAGIC, n)


def _legacy(payload: bytes) -> tuple[bytes, int]:
    """What a worker of the earlier version sent: the pickle's length, then the pickle."""
    return struct.pack("<Q", len(payload)) + payload, 8


def _framed(payload: bytes) -> tuple[bytes, int]:
    head = _header(len(payload))
    return head + payload, len(head)


@pytest.mark.parametrize("frame", [_legacy, _framed], ids=["legacy-header", "this-header"])
def test_the_hot_resume_client_refuses_a_pickled_offer_and_runs_nothing(tmp_path, frame):
    from asyncckpt.memory.hot_resume import ask

    payload, marker = boom(tmp_path)
    fd = _memfd()
    before = _open_fds()
    data, head = frame(payload)
    server = _serve_once(tmp_path, 0, data, head, [fd])
    source, why = ask(tmp_path, 0)
    server.join(60)
    assert not marker.exists()
    assert source is None and "refused" in why, why
    assert _open_fds() == before  # the descriptors that came with it are closed
    os.close(fd)


def _offer_json(**change: Any) -> dict:
    offer = {
        "v": 1, "step": 3, "rank": 0, "files": ["__0_0.distcp"], "tensors": {"w": [0, 0, 16]},
        "sizes": [4096], "pid": 1, "staged": None, "objects": None, "paths": None,
        "vote": None, "world_size": 1,
    }  # fmt: skip
    offer.update(change)
    return offer


@pytest.mark.parametrize(
    "offer, fds, problem",
    [
        (b"\x00" * 64, 1, "not JSON"),
        (json.dumps(_offer_json(step="3")).encode(), 1, "step"),
        (json.dumps(_offer_json(sizes=[4096, 4096])).encode(), 1, "descriptor"),
        (json.dumps(_offer_json(tensors={"w": [1, 0, 16]})).encode(), 1, "arena"),
        (json.dumps(_offer_json(tensors={"w": [0, 4090, 16]})).encode(), 1, "arena"),
        (json.dumps(_offer_json(sizes=[-1])).encode(), 1, "sizes"),
        (json.dumps(_offer_json(v=2)).encode(), 1, "version"),
        (json.dumps(_offer_json(staged={"w": ["os.system", [4], 1]})).encode(), 1, "dtype"),
        (json.dumps(_offer_json(staged={"w": ["float32", [5], 1]})).encode(), 1, "bytes"),
        (json.dumps(_offer_json(objects={"m": "%%%"})).encode(), 1, "base64"),
        (json.dumps(_offer_json(paths={"w": [["x", "w"]]})).encode(), 1, "paths"),
        (json.dumps(_offer_json(vote={"rank": 0})).encode(), 1, "vote"),
    ],
)
def test_the_hot_resume_client_refuses_a_malformed_offer(tmp_path, offer, fds, problem):
    from asyncckpt.memory.hot_resume import ask

    mine = [_memfd() for _ in range(fds)]
    before = _open_fds()
    data, head = _framed(offer)
    server = _serve_once(tmp_path, 0, data, head, mine)
    source, why = ask(tmp_path, 0)
    server.join(60)
    assert source is None and "refused" in why and problem in why, why
    assert _open_fds() == before
    for fd in mine:
        os.close(fd)


@pytest.mark.parametrize("kind", ["small", "pipe"])
def test_the_hot_resume_client_maps_only_shared_memory_as_large_as_its_arena(tmp_path, kind):
    from asyncckpt.memory.hot_resume import ask

    if kind == "small":
        mine = [_memfd(1024)]  # the offer says 4096
    else:
        r, w = os.pipe()
        os.close(w)
        mine = [r]
    before = _open_fds()
    data, head = _framed(json.dumps(_offer_json()).encode())
    server = _serve_once(tmp_path, 0, data, head, mine)
    source, why = ask(tmp_path, 0)
    server.join(60)
    assert source is None and "refused" in why and "descriptor 0" in why, why
    assert _open_fds() == before
    os.close(mine[0])


def test_the_hot_resume_client_refuses_a_garbage_header(tmp_path):
    from asyncckpt.memory.hot_resume import ask

    fd = _memfd()
    server = _serve_once(tmp_path, 0, b"GARBAGE!" * 4, 16, [fd])
    source, why = ask(tmp_path, 0)
    server.join(60)
    assert source is None and "refused" in why and "header" in why, why
    os.close(fd)


def test_a_pickled_offer_runs_nothing_and_the_load_reads_the_disk(tmp_path):
    root = tmp_path / "r"
    with SyncCheckpointEngine(root, keep=None) as engine:
        engine.save(1, {"w": torch.arange(8.0)}).committed_sync(60)
    payload, marker = boom(tmp_path)
    fd = _memfd()
    data, head = _legacy(payload)  # what a worker of the earlier version sent
    server = _serve_once(root, 0, data, head, [fd])
    target = {"w": torch.zeros(8)}
    with SyncCheckpointEngine(root, keep=None) as engine:
        assert engine.load_latest(target) == 1
        report = engine.last_load_report
    server.join(60)
    os.close(fd)
    assert not marker.exists()
    assert torch.equal(target["w"], torch.arange(8.0))
    assert report.source == "disk" and "refused" in report.source_reason, report.source_reason


# ------------------------------------------------------------------ the offer's own round trip


def test_an_offer_goes_over_the_wire_as_it_was():
    from asyncckpt.memory.hot_offer import Offer, decode_offer, encode_offer

    cfg = _dist.DistConfig(
        1, 2, 1, "10.0.0.1", 29500, "tok", timeout=12.5, recovery_store="/tmp/fs", ranks_per_node=2
    )
    staged = {
        "a": (torch.bfloat16, (2, 3), 7),
        "b": (torch.bool, (), 0),
        "c": (torch.int64, (0, 4), 4294967295),
    }
    paths = {"a": [("d", "model"), ("l", 0), ("d", 3)], "b": [("d", "b")], "c": [("d", "c")]}
    offer = Offer(
        9, 1, ("__1_0.distcp",), {"a": (0, 0, 12), "b": (0, 64, 1), "c": (1, 0, 0)},
        (128, 64), 4242, staged, {"m": b"\x00\x80obj"}, paths, cfg, 2,
    )  # fmt: skip
    back = decode_offer(encode_offer(offer), 2)
    assert back == offer
    assert isinstance(back.vote, _dist.DistConfig) and back.vote == cfg
    # The run's secret travels to the new engine (a process of the same user: the socket's
    # peer credentials), which signs its words in the old run's side store with it.
    offer.vote = dataclasses.replace(cfg, secret="ab" * 32)
    assert decode_offer(encode_offer(offer), 2).vote.secret == "ab" * 32
    assert isinstance(back.files, tuple) and isinstance(back.sizes, tuple)
    committed = Offer(9, 0, (), {}, (), 1)  # a committed step: no staged memory, no vote
    assert decode_offer(encode_offer(committed), 0) == committed
