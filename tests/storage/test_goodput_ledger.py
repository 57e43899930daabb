"""The goodput ledger's arithmetic (storage/goodput.py): categories, restarts, the file."""

from __future__ import annotations

import json

from asyncckpt.storage import goodput as G


def run(rid: str, start: float, end: float, **kw) -> G.RunRecord:
    return G.RunRecord(rid, start, end, **kw)


def test_productive_is_the_wall_time_less_every_other_category():
    r = run(
        "a", 100.0, 200.0, startup_seconds=5.0, load_seconds=3.0, save_blocking_seconds=2.0,
        wasted_steps=10, step_seconds=0.5,
    )  # fmt: skip
    assert r.wall_seconds == 100.0
    assert r.wasted_seconds == 5.0
    assert r.productive_seconds == 85.0
    d = r.as_dict()
    assert d["productive_seconds"] == 85.0 and d["wasted_seconds"] == 5.0


def test_productive_never_goes_negative_and_unknown_step_time_wastes_nothing():
    r = run("a", 0.0, 1.0, startup_seconds=5.0, wasted_steps=7)
    assert r.wasted_seconds == 0.0
    assert r.productive_seconds == 0.0


def test_wasted_steps_are_the_previous_runs_steps_past_the_resumed_one():
    assert G.wasted_steps(87, 50) == 37
    assert G.wasted_steps(50, 50) == 0
    assert G.wasted_steps(40, 50) == 0  # resumed past it (another run's newer step)
    assert G.wasted_steps(None, 50) == 0


def test_summarize_adds_categories_and_counts_the_gap_between_runs_apart():
    a = run("a", 0.0, 100.0, startup_seconds=4.0, save_blocking_seconds=1.0)
    b = run(
        "b", 110.0, 210.0, startup_seconds=6.0, load_seconds=2.0, resumed_step=50,
        wasted_steps=20, step_seconds=0.1,
    )  # fmt: skip
    t = G.summarize([a, b])
    assert t.runs == 2
    assert t.wall_seconds == 200.0
    assert t.down_seconds == 10.0
    assert t.startup_seconds == 10.0 and t.load_seconds == 2.0
    assert t.wasted_steps == 20 and abs(t.wasted_seconds - 2.0) < 1e-9
    assert abs(t.productive_seconds - (95.0 + 90.0)) < 1e-9
    assert t.goodput is not None and abs(t.goodput - 185.0 / 200.0) < 1e-9
    assert G.summarize([]).goodput is None


def test_restart_cost_is_the_mean_of_the_runs_that_resumed():
    runs = [
        run("a", 0, 1, startup_seconds=9.0),  # the first run resumed nothing: not a restart
        run("b", 2, 3, startup_seconds=3.0, load_seconds=1.0, resumed_step=5),
        run("c", 4, 5, startup_seconds=5.0, load_seconds=3.0, resumed_step=9),
    ]
    assert G.restart_seconds(runs) == 6.0
    assert G.restart_seconds(runs[:1]) is None


def test_put_replaces_a_run_by_id_and_keeps_the_newest_runs(monkeypatch):
    monkeypatch.setattr(G, "MAX_RUNS", 3)
    led = G.Ledger()
    for i in range(5):
        led.put(run(str(i), i, i + 1))
    assert [r.run_id for r in led.runs] == ["2", "3", "4"]
    led.put(run("3", 3, 9))
    assert [r.updated_at for r in led.runs] == [3, 9, 5]


def test_the_file_round_trips_and_a_damaged_one_reads_as_none(tmp_path):
    assert G.read_ledger(tmp_path) is None
    led = G.Ledger([run("a", 1.0, 2.0, resumed_step=3, highest_step=8, closed=True)])
    G.write_ledger(tmp_path, led)
    d = json.loads((tmp_path / G.LEDGER_NAME).read_text())
    assert d["version"] == G.VERSION and d["total"]["runs"] == 1
    back = G.read_ledger(tmp_path)
    assert back is not None and back.runs == led.runs
    (tmp_path / G.LEDGER_NAME).write_text("{not json")
    assert G.read_ledger(tmp_path) is None
    assert [p.name for p in tmp_path.iterdir()] == [G.LEDGER_NAME]  # no temporary left


def test_the_on_disk_format_page_names_every_key_the_ledger_writes(tmp_path):
    """The reference page's ledger section lists every key of the file as written."""
    import re
    from pathlib import Path

    G.write_ledger(tmp_path, G.Ledger([run("a", 0.0, 10.0, step_seconds=0.1, resumed_step=3)]))
    written = json.loads((tmp_path / G.LEDGER_NAME).read_text())
    keys = set(written) | set(written["total"]) | set(written["runs"][0])
    page = Path(__file__).parents[2] / "docs" / "reference" / "on-disk-format.md"
    section = page.read_text().split("## The goodput ledger", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([a-z_]+)`", section))
    assert keys <= named, sorted(keys - named)
    assert G.LEDGER_NAME in page.read_text()
