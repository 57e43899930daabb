"""Torture: kill a training loop (or its worker) at random moments and at every fault point.

Each trial runs ``torture_train.py`` once as a subprocess on the same root. The run first
resumes -- that is the restart after the previous trial's crash, and it reports whether
``load_latest`` restored, bit for bit, the newest checkpoint the test saw committed on disk,
and whether the engine's start left any leftovers -- then saves every step (``KeepLast(2)``)
until the trial kills it:

* ``kill``: SIGKILL of the trainer after a random delay (during its start, its resume or its
  saves);
* ``worker``: SIGKILL of the worker after a random delay; the trainer sees ``WorkerDied`` and
  exits, or the test kills it, or the kill fell between saves and the loop goes on;
* ``point:<name>``: ``ASYNCCKPT_FAULTS=<name>=kill@k`` -- ``after_stage`` kills the trainer,
  every other point the worker (then as above);
* ``saved``: the trainer SIGKILLs itself right after its k-th save returned (and was reported);
* ``memory``: the loop saves to the memory tier every step and to disk every third
  (``engine.due``); the trainer SIGKILLs itself right after a memory save returned;
* ``node``: two simulated nodes of one rank (torchrun's environment, gloo, their own root),
  ``MemoryTier(replicas=1)``, a memory save every step and a disk save every third; once both
  ranks' memory saves were replicated, after a random delay (a replica may be on the wire),
  node 0 or node 1 is SIGKILLed whole (trainer and worker), then the other trainer. The root must verify,
  load one step bit for bit on every rank (never a mix), no newer than a step both ranks
  began saving (and bit for bit) and no older than one acknowledged committed (``node_trial``).

After ``saved`` and ``memory`` the newest committed step is exactly the newest one whose
``save()`` had returned (as the trainer reported it before dying): the worker wrote it, a
memory save included (invariant 12); after a ``kill`` it is at least that one.

Between trials (trainer gone, its orphaned worker gone and reaped): ``verify(root)`` passes for
every committed checkpoint, the tracker names a committed one, and the newest committed step
is at least the newest one the trainer was told had committed (nothing acknowledged is lost).

The default run does ``DEFAULT_TRIALS``; ``pytest -m torture`` runs ``ASYNCCKPT_TORTURE_TRIALS``
(default 500). ``ASYNCCKPT_TORTURE_SEED`` replays a run; ``ASYNCCKPT_TORTURE_SUMMARY`` names a
file that receives the running tally.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
import torch

from asyncckpt import SyncCheckpointEngine, faults, verify
from asyncckpt.core import layout as L

sys.path.insert(0, str(Path(__file__).parents[1]))
from torture_train import make_state, rank_state, same_state  # noqa: E402

TRAIN = Path(__file__).parents[1] / "torture_train.py"
DEFAULT_TRIALS = 20
STEPS_PER_RUN = 8
STEP_SLEEP = 0.02
#: Generous limits for things that normally take well under a second; never timing asserts.
ORPHAN_EXIT_LIMIT = 60.0
TRIAL_LIMIT = 240.0

PR_SET_CHILD_SUBREAPER = 36


@pytest.fixture
def subreaper():
    """Make this process the subreaper of its descendants, as init would be.

    PID 1 of some containers never reaps orphans; as subreaper, the orphaned worker of a killed
    trainer is re-parented to us, and we can check that it exits and reap it.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        pytest.skip(f"prctl(PR_SET_CHILD_SUBREAPER) failed: errno {ctypes.get_errno()}")
    yield
    libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


@dataclass
class Tally:
    trials: int = 0
    trainer_kills: int = 0  # SIGKILL of the trainer (by the test, a fault point or itself)
    kills_after_save: int = 0  # of them, by itself right after a save returned ("saved")
    kills_after_memory_save: int = 0  # ... right after a memory save returned ("memory")
    node_kills: int = 0  # whole simulated nodes SIGKILLed ("node")
    node_memory_resumes: int = 0  # of them, resumed from a memory step the survivor wrote
    worker_kills: int = 0  # SIGKILL of the worker (by the test or by a fault point)
    clean_exits: int = 0
    resumes_checked: int = 0
    verified_resumes: int = 0
    points_fired: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        return (
            f"trials={self.trials} kills={self.trainer_kills + self.worker_kills} "
            f"(trainer={self.trainer_kills} worker={self.worker_kills}; "
            f"right after save returned={self.kills_after_save} "
            f"after a memory save={self.kills_after_memory_save}; "
            f"nodes={self.node_kills}, resumed from memory={self.node_memory_resumes}) "
            f"clean_exits={self.clean_exits} verified_resumes={self.verified_resumes}"
            f"/{self.resumes_checked} failures={len(self.failures)} "
            f"points_fired={json.dumps(self.points_fired, sort_keys=True)} "
            f"seconds_per_trial={self.seconds / max(self.trials, 1):.1f}"
        )


def _descendants(pid: int) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _children() -> set[int]:
    return {c.pid for c in psutil.Process().children()}


def _reap_and_check_gone(
    pids: set[int], ours_before: set[int], limit: float = ORPHAN_EXIT_LIMIT
) -> list[int]:
    """Wait for ``pids`` (and any orphan re-parented to us since ``ours_before`` was taken) to
    exit; reap them. Returns those still alive after ``limit`` seconds."""
    pids = set(pids) | (_children() - ours_before)
    deadline = time.monotonic() + limit
    while True:
        alive = set()
        for pid in pids:
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
                if done == 0:
                    alive.add(pid)
                continue
            except ChildProcessError:
                pass  # not our child: gone, or reaped by someone else
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.add(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return sorted(alive)
        pids = alive
        time.sleep(0.05)


def _read_events(stream, q: queue.Queue) -> None:
    for line in stream:
        line = line.strip()
        if line.startswith("{"):
            try:
                q.put(json.loads(line))
            except json.JSONDecodeError:
                q.put({"event": "garbled", "line": line})
    q.put(None)


class Trial:
    """One subprocess run of the training script and the kill the trial planned for it."""

    def __init__(self, root: Path, logdir: Path, n: int, mode: str, rng: random.Random):
        self.root, self.n, self.mode, self.rng = root, n, mode, rng
        self.events: list[dict] = []
        self.killed_trainer_ourselves = False
        self.killed_worker_ourselves = False
        env = dict(os.environ)
        env.pop(faults.ENV_VAR, None)
        extra: list[str] = []
        if mode.startswith("point:"):
            point = mode.split(":", 1)[1]
            after = rng.randint(0, 4 if point == "mid_shard_write" else 2)
            env[faults.ENV_VAR] = f"{point}=kill@{after}"
        elif mode == "saved":
            extra = ["--die-after-saves", str(rng.randint(1, STEPS_PER_RUN - 2))]
        elif mode == "memory":
            extra = ["--memory-every", "1", "--disk-every", "3", "--die-tier", "memory"]
            extra += ["--die-after-saves", str(rng.randint(1, STEPS_PER_RUN - 3))]
        self.errlog = logdir / f"trial-{n:04d}-{mode.replace(':', '-')}.err"
        self.err = open(self.errlog, "w")  # noqa: SIM115 - closed in finish()
        # Our own children from before (e.g. multiprocessing's resource tracker) are not the
        # trainer's orphans.
        self.children_before = _children()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(TRAIN),
                str(root),
                "--steps",
                str(STEPS_PER_RUN),
                "--step-sleep",
                str(STEP_SLEEP),
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=self.err,
            text=True,
            env=env,
        )
        self.launched = time.monotonic()
        self.q: queue.Queue = queue.Queue()
        self.reader = threading.Thread(
            target=_read_events, args=(self.proc.stdout, self.q), daemon=True
        )
        self.reader.start()
        self.known_pids: set[int] = set()

    def _next_event(self, timeout: float) -> dict | None | str:
        try:
            ev = self.q.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return "timeout"
        if ev is not None:
            self.events.append(ev)
        return ev

    def wait_for(self, name: str, limit: float) -> dict | None:
        """The first event ``name`` (None if the output ended or ``limit`` passed)."""
        deadline = time.monotonic() + limit
        while True:
            ev = self._next_event(deadline - time.monotonic())
            if ev == "timeout" or ev is None:
                return None
            if ev["event"] == name:
                return ev

    def sleep_collecting(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while self.proc.poll() is None:
            ev = self._next_event(min(deadline - time.monotonic(), 0.05))
            if ev is None:
                return
            if time.monotonic() >= deadline:
                return

    def kill_trainer(self) -> None:
        if self.proc.poll() is None:
            self.known_pids |= set(_descendants(self.proc.pid))
            self.proc.send_signal(signal.SIGKILL)
            self.killed_trainer_ourselves = True

    def kill_worker(self, pid: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            self.killed_worker_ourselves = True

    def run(self) -> None:
        rng = self.rng
        save_window = STEPS_PER_RUN * (STEP_SLEEP + 0.03) + 0.2
        if self.mode == "kill":
            if rng.random() < 0.3:  # anywhere, from the launch on (start, cleanup, resume)
                self.sleep_collecting(rng.uniform(0.0, 4.0))
            else:
                self.wait_for("started", TRIAL_LIMIT)
                self.sleep_collecting(rng.uniform(0.0, save_window))
            self.kill_trainer()
        elif self.mode in ("saved", "memory"):  # it kills itself; its orphan worker writes
            started = self.wait_for("started", TRIAL_LIMIT)
            if started is not None:
                self.known_pids.add(started["worker_pid"])
        elif self.mode == "worker":
            started = self.wait_for("started", TRIAL_LIMIT)
            if started is not None:
                self.known_pids.add(started["worker_pid"])
                self.sleep_collecting(rng.uniform(0.0, save_window))
                self.kill_worker(started["worker_pid"])
                self._after_worker_death()
        else:
            started = self.wait_for("started", TRIAL_LIMIT)
            if started is not None:
                self.known_pids.add(started["worker_pid"])
                self._after_worker_death(random_kill=False)
        self.finish()

    def _after_worker_death(self, random_kill: bool = True) -> None:
        # The trainer sees the failure and exits; half the time we kill it then instead (or,
        # for a kill of ours that fell between saves, at a random moment).
        kill_it = self.rng.random() < 0.5
        if random_kill and kill_it and self.rng.random() < 0.5:
            self.sleep_collecting(self.rng.uniform(0.0, 1.5))
            self.kill_trainer()
            return
        deadline = time.monotonic() + TRIAL_LIMIT
        while self.proc.poll() is None and time.monotonic() < deadline:
            ev = self._next_event(0.05)
            if ev is None:
                break
            if isinstance(ev, dict) and ev["event"] == "save_failed" and kill_it:
                self.kill_trainer()
                return

    def finish(self) -> None:
        try:
            self.proc.wait(TRIAL_LIMIT)
        except subprocess.TimeoutExpired:
            self.kill_trainer()
            self.proc.wait()
            self.events.append({"event": "hung"})
        self.leftover_pids = _reap_and_check_gone(self.known_pids, self.children_before)
        self.reader.join(ORPHAN_EXIT_LIMIT)
        while True:
            try:
                ev = self.q.get_nowait()
            except queue.Empty:
                break
            if ev is not None:
                self.events.append(ev)
        self.proc.stdout.close()
        self.err.close()

    # -------------------------------------------------------------------- what happened
    def of(self, name: str) -> list[dict]:
        return [e for e in self.events if e["event"] == name]

    def stderr_tail(self) -> str:
        try:
            return self.errlog.read_text()[-3000:]
        except OSError:
            return ""


def _check_root(root: Path, acked: int | None) -> tuple[int | None, list[str]]:
    """Invariants of a root right after a crash (before any restart). Returns the step a
    restart must resume from, and the problems found."""
    problems = []
    rep = verify(root, "global_step")
    for c in rep.checkpoints:
        if not c.ok:
            problems.append(f"committed checkpoint {c.step} fails verification: {c.problems}")
    if rep.tracker_problem:
        problems.append(f"tracker: {rep.tracker_problem}")
    steps = [c.step for c in rep.checkpoints]
    if acked is not None and (not steps or steps[-1] < acked):
        problems.append(f"step {acked} was acknowledged as committed, newest on disk: {steps}")
    return (steps[-1] if steps else None), problems


def _events_of(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            out.append(json.loads(line))
    return out


def node_trial(base: Path, logdir: Path, n: int, rng: random.Random) -> tuple[list[str], str]:
    """A ``node`` trial (module docstring), on a root of its own. Returns the problems found
    and the resumed checkpoint's tier ("memory", "disk", or "" when nothing committed)."""
    root = base.parent / f"{base.name}-node-{n}"
    outs = {r: logdir / f"trial-{n:04d}-node-rank{r}.out" for r in range(2)}
    procs: dict[int, subprocess.Popen] = {}
    bad: list[str] = []
    ours_before = _children()
    for r in range(2):
        env = dict(os.environ, GROUP_RANK=str(r), LOCAL_WORLD_SIZE="1", LOCAL_RANK="0")
        env.pop(faults.ENV_VAR, None)
        cmd = [sys.executable, str(TRAIN), str(root), "--world", "2", "--rank", str(r)]
        cmd += ["--store", str(logdir / f"node-{n}.store"), "--disk-every", "3"]
        cmd += ["--step-sleep", str(STEP_SLEEP)]
        # Files, not pipes: a worker inherits them and outlives its trainer.
        with open(outs[r], "w") as out, open(outs[r].with_suffix(".err"), "w") as err:
            procs[r] = subprocess.Popen(
                cmd, stdout=out, stderr=err, env=env, start_new_session=True
            )  # a node = its trainer's process group (its worker included)
    events: dict[int, list[dict]] = {0: [], 1: []}
    workers: set[int] = set()
    try:
        deadline = time.monotonic() + TRIAL_LIMIT
        while not all(any(e["event"] == "replicated" for e in events[r]) for r in range(2)):
            if any(p.poll() is not None for p in procs.values()) or time.monotonic() > deadline:
                bad.append("the ranks did not both replicate a memory save")
                break
            time.sleep(0.1)
            events = {r: _events_of(outs[r]) for r in range(2)}
        time.sleep(rng.uniform(0.0, 1.0))  # anywhere in the saves that follow
        events = {r: _events_of(outs[r]) for r in range(2)}
        workers = {e["worker_pid"] for r in range(2) for e in events[r] if e["event"] == "started"}
        dead = rng.randrange(2)  # node 0 too: its worker served the side store
        with contextlib.suppress(ProcessLookupError):
            os.killpg(procs[dead].pid, signal.SIGKILL)  # the whole node: trainer and worker
        procs[dead].wait(ORPHAN_EXIT_LIMIT)
        procs[1 - dead].send_signal(signal.SIGKILL)  # then the launcher tears down the other
        procs[1 - dead].wait(ORPHAN_EXIT_LIMIT)
    finally:
        for p in procs.values():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    # The survivor's worker writes (standing in for the dead rank with its replica), then exits.
    alive = _reap_and_check_gone(workers, ours_before, TRIAL_LIMIT)
    if alive:
        bad.append(f"workers still alive: {alive}")
    events = {r: _events_of(outs[r]) for r in range(2)}
    # What each rank had begun to save: a save handed to its worker may commit although the
    # kill came before the trainer reported its return ("staged"); its bytes are checked below.
    staged = [
        max((e["step"] for e in events[r] if e["event"] == "saving"), default=0) for r in (0, 1)
    ]
    acked = max(
        (e["step"] for r in (0, 1) for e in events[r] if e["event"] == "committed"), default=None
    )
    if not root.exists():
        return bad + ["the root was never made"], ""
    newest, problems = _check_root(root, acked)
    bad += problems
    tier = ""
    if newest is not None:
        if newest > min(staged):
            bad.append(f"step {newest} committed; the ranks began saving up to {staged}")
        target = {k: v for r in (0, 1) for k, v in rank_state(0, r).items()}
        with SyncCheckpointEngine(root) as engine:
            resumed = engine.load_latest(target)
            tier = next(c.tier for c in engine.list_checkpoints() if c.step == resumed)
        want = {k: v for r in (0, 1) for k, v in rank_state(newest, r).items()}
        if resumed != newest or not same_state(target, want):
            bad.append(f"resumed {resumed}, not step {newest} bit for bit on every rank")
    shutil.rmtree(root, ignore_errors=True)
    return bad, tier


def run_torture(root: Path, logdir: Path, trials: int, seed: int, summary: Path | None) -> Tally:
    rng = random.Random(seed)
    tally = Tally()
    # The first trials visit every fault point once; then a random mix.
    # (The remote tier's points are test_s3.py's: this trainer saves to a local root.)
    named = [f"point:{p}" for p in faults.LOCAL_POINTS]
    plan = named + ["node"] + ["kill", "worker", "saved", "memory"] * 2
    acked: int | None = None  # newest step the trainer was told had committed
    expected: int | None = None  # what the next start must resume from
    for n in range(trials):
        if n < len(plan):
            mode = plan[n]
        else:
            r = rng.random()
            mode = (
                "kill"
                if r < 0.3
                else "worker"
                if r < 0.45
                else "saved"
                if r < 0.6
                else "memory"
                if r < 0.75
                else "node"
                if r < 0.8
                else rng.choice(named)
            )
        t0 = time.monotonic()
        if mode == "node":
            bad, tier = node_trial(root, logdir, n, rng)
            tally.seconds += time.monotonic() - t0
            tally.trials += 1
            tally.node_kills += 1
            tally.node_memory_resumes += tier == "memory"
            for b in bad:
                tally.failures.append(f"trial {n} (node, seed {seed}): {b}")
            continue
        t = Trial(root, logdir, n, mode, rng)
        t.run()
        tally.seconds += time.monotonic() - t0
        tally.trials += 1
        where = f"trial {n} ({mode}, seed {seed})"
        bad: list[str] = []

        started = t.of("started")
        if started:
            tally.resumes_checked += 1
            s = started[0]
            ok = s["resumed"] == expected and s["leftovers"] == []
            ok = ok and (s["resumed"] is None or s["state_ok"])
            if ok:
                tally.verified_resumes += 1
            else:
                bad.append(f"resume: expected step {expected}, no leftovers; got {s}")
        for ev in t.of("committed"):
            acked = ev["step"] if acked is None else max(acked, ev["step"])

        rc = t.proc.returncode
        fired = None
        returned = [e["step"] for e in t.of("staged")]
        if rc == -signal.SIGKILL:
            tally.trainer_kills += 1
            if mode == "saved":
                tally.kills_after_save += 1
            elif mode == "memory":
                tally.kills_after_memory_save += 1
            elif not t.killed_trainer_ourselves:
                fired = "after_stage"
        elif mode in ("saved", "memory"):
            bad.append(f"the trainer did not kill itself after a save: exit code {rc}")
        elif rc == 0:
            tally.clean_exits += 1
        elif rc != 3:
            bad.append(f"trainer exit code {rc}")
        failed = t.of("save_failed")
        done = t.of("done")
        restarts = max([e.get("worker_restarts", 0) for e in failed + done] or [0])
        worker_died = restarts > 0 or any(f["type"] == "WorkerDied" for f in failed)
        if failed and not worker_died:
            bad.append(f"a save failed without a worker death: {failed}")
        if t.killed_worker_ourselves or (mode.startswith("point:") and worker_died):
            tally.worker_kills += 1
            if mode.startswith("point:"):
                fired = mode.split(":", 1)[1]
        if fired:
            tally.points_fired[fired] = tally.points_fired.get(fired, 0) + 1
        if t.of("hung"):
            bad.append("the trainer did not finish")
        if t.leftover_pids:
            bad.append(f"processes of the killed trainer still alive: {t.leftover_pids}")

        expected, problems = _check_root(root, acked)
        bad += problems
        # Invariant 12: every save that returned is committed once its trainer is dead.
        if returned and mode in ("saved", "memory", "kill") and rc == -signal.SIGKILL:
            newest = max(returned)
            exact = mode != "kill"  # a random kill may land after a save it never reported
            if expected is None or expected < newest or (exact and expected != newest):
                bad.append(
                    f"save() of step {newest} had returned before the trainer died; the "
                    f"newest committed step is {expected}"
                )
        for b in bad:
            tally.failures.append(f"{where}: {b}\n--- stderr ---\n{t.stderr_tail()}")
        if summary is not None:
            summary.write_text(f"seed={seed} {tally.summary()}\n" + "\n".join(tally.failures))

    # The last restart, in this process: start (cleans leftovers), resume, compare.
    state = make_state(0)
    with SyncCheckpointEngine(root) as engine:
        leftovers = [n for n in os.listdir(root) if L.is_leftover(n)]
        resumed = engine.load_latest(state)
    tally.resumes_checked += 1
    if resumed == expected and leftovers == [] and same_state(state, make_state(resumed)):
        tally.verified_resumes += 1
    else:
        tally.failures.append(f"final resume: expected {expected}, got {resumed}, {leftovers}")
    if expected is not None:
        assert resumed is not None
    if summary is not None:
        summary.write_text(f"seed={seed} {tally.summary()}\n" + "\n".join(tally.failures))
    return tally


def _seed() -> int:
    env = os.environ.get("ASYNCCKPT_TORTURE_SEED")
    return int(env) if env else random.SystemRandom().randrange(1 << 30)


def _summary_path() -> Path | None:
    p = os.environ.get("ASYNCCKPT_TORTURE_SUMMARY")
    return Path(p) if p else None


def _check(tally: Tally, trials: int) -> None:
    print(tally.summary())
    assert not tally.failures, "\n\n".join(tally.failures[:5])
    assert tally.trials == trials
    assert tally.verified_resumes == tally.resumes_checked


@pytest.mark.integration
def test_torture_default(tmp_path, subreaper):
    seed = _seed()
    logdir = tmp_path / "logs"
    logdir.mkdir()
    tally = run_torture(tmp_path / "ckpts", logdir, DEFAULT_TRIALS, seed, _summary_path())
    _check(tally, DEFAULT_TRIALS)
    # Every named point was reached and fired in its trial.
    assert set(tally.points_fired) == set(faults.LOCAL_POINTS), tally.points_fired
    assert tally.trainer_kills + tally.worker_kills >= DEFAULT_TRIALS // 2


@pytest.mark.integration
def test_torture_node_trials(tmp_path, subreaper):
    """The ``node`` kind alone, twice (the default run has it once)."""
    seed = _seed()
    rng = random.Random(seed)
    logdir = tmp_path / "logs"
    logdir.mkdir()
    tiers = []
    for n in range(2):
        bad, tier = node_trial(tmp_path / "ckpts", logdir, n, rng)
        assert bad == [], f"seed {seed}: {bad}"
        tiers.append(tier)
    print(f"seed={seed} resumed tiers={tiers}")
    assert all(t in ("disk", "memory") for t in tiers), tiers  # something always committed


@pytest.mark.torture
def test_torture_long(tmp_path, subreaper):
    trials = int(os.environ.get("ASYNCCKPT_TORTURE_TRIALS", "500"))
    seed = _seed()
    logdir = tmp_path / "logs"
    logdir.mkdir()
    tally = run_torture(tmp_path / "ckpts", logdir, trials, seed, _summary_path())
    _check(tally, trials)


def test_make_state_is_a_function_of_the_step():
    assert same_state(make_state(7), make_state(7))
    assert not same_state(make_state(7), make_state(8))
    a = make_state(3)
    a["model"]["b"] = a["model"]["b"].clone()
    a["model"]["b"].view(torch.int16)[0] ^= 1  # one flipped bit
    assert not same_state(a, make_state(3))
