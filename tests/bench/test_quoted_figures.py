"""The benchmark figures the README and the docs quote are the ones in `benchmarks/results/`
(issue 54 item 4): each quote below names the results file and the key path its numbers come
from and how the page rounds them, and the page must say exactly that. Every number with a unit
in the README's "Headline figures" section must be one of these quotes, so a headline cannot
be written (or left) without a results file behind it."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
MIB = 2**20
GIB = 2**30


@dataclass(frozen=True)
class Fig:
    """One number: read at ``path`` ("/"-separated keys; several paths joined by "|" are reduced
    by ``how``) in a results file, divided by ``per``, written with the format ``spec``."""

    file: str
    path: str
    spec: str = ".2f"
    per: float = 1.0
    how: str = "one"  # "one", "min" or "max"

    def text(self) -> str:
        values = [_read(self.file, p) / self.per for p in self.path.split("|")]
        if self.how == "one":
            assert len(values) == 1, self
        value = {"one": values[0], "min": min(values), "max": max(values)}[self.how]
        assert not math.isnan(value), self
        return format(value, self.spec)


@dataclass(frozen=True)
class Quote:
    """A passage of ``page`` whose ``{}`` are the figures, in order."""

    page: str
    passage: str
    figs: tuple[Fig, ...]

    def text(self) -> str:
        return self.passage.format(*(f.text() for f in self.figs))


@cache
def _load(file: str) -> object:
    return json.loads((RESULTS / file).read_text())


def _read(file: str, path: str) -> float:
    node = _load(file)
    for key in path.split("/"):
        node = node[int(key)] if isinstance(node, list) else node[key]  # type: ignore[index]
    assert isinstance(node, int | float) and not isinstance(node, bool), (file, path, node)
    return float(node)


OV = "overhead.json"
ASYNC = "methods/asyncckpt"
DCP_PROC = "methods/dcp.async_save:process+shm-stager"
DCP_THREAD = "methods/dcp.async_save:thread"
TL = "training_loop.json"
OT2, OT1 = "offload_throttle.json", "offload_throttle_threads1.json"
SC = "scale.json"
ST = "start_time.json"
LOADS = "|".join(f"rows/{r}/load_vs_dcp_load_{k}" for r in (2, 3) for k in ("warm", "cold"))

README_QUOTES = [
    Quote(
        "README.md",
        "| stall of a save ({} GiB, {} tensors) | {} s median, {}x a warm copy of the same bytes;"
        " `dcp.async_save` {}-{} s |",
        (
            Fig(OV, "state_bytes", per=GIB),
            Fig(OV, "state_tensors", ".0f"),
            Fig(OV, f"{ASYNC}/stall_seconds/median", ".3f"),
            Fig(OV, f"{ASYNC}/ratio_stall_vs_paired_copy"),
            Fig(
                OV, f"{DCP_PROC}/stall_seconds/median|{DCP_THREAD}/stall_seconds/median", how="min"
            ),
            Fig(
                OV, f"{DCP_PROC}/stall_seconds/median|{DCP_THREAD}/stall_seconds/median", how="max"
            ),
        ),
    ),
    Quote(
        "README.md",
        "| first save | {} s; `dcp.async_save`'s fastest first save {} s |",
        (
            Fig(OV, f"{ASYNC}/stall_first_seconds", ".3f"),
            Fig(OV, f"{DCP_THREAD}/stall_first_seconds", ".3f"),
        ),
    ),
    Quote(
        "README.md",
        "| background write | {} MB/s with `O_DIRECT`, {}x a buffered write + fsync |",
        (
            Fig(OV, f"{ASYNC}/write_throughput_bytes_per_s", ".0f", per=1e6),
            Fig(OV, f"{ASYNC}/ratio_throughput_vs_paired_raw_write"),
        ),
    ),
    Quote(
        "README.md",
        "| CPU training loop, a save every 10 steps | {}% step time; steps beside a write {}% |",
        (
            Fig(TL, f"{ASYNC}/overhead_pct", "+.2f"),
            Fig(TL, f"{ASYNC}/during_write_slowdown_pct", "+.2f"),
        ),
    ),
    Quote(
        "README.md",
        "| Adam on the CPU beside a write, `for_optimizer_offload()` | {}% (1 thread) / {}%"
        " (2 threads); throttling off: {}% / {}% |",
        (
            Fig(OT1, "modes/on/slowdown_pct", "+.1f"),
            Fig(OT2, "modes/on/slowdown_pct", "+.1f"),
            Fig(OT1, "modes/off/slowdown_pct", "+.0f"),
            Fig(OT2, "modes/off/slowdown_pct", "+.0f"),
        ),
    ),
    Quote(
        "README.md",
        "| host memory, memory tier with a disk save in flight ({} MiB state) | peak PSS of"
        " trainer + worker {}x the state:",
        (
            Fig("memory_peak.json", "state_bytes", ".0f", per=MIB),
            Fig("memory_peak.json", "peak_ratio"),
        ),
    ),
    Quote(
        "README.md",
        "| 20,000 tensors: stall / time to durable | {} s ({}x `torch._foreach_copy_`) / {} s"
        " ({}x `dcp.async_save`) |",
        (
            Fig(SC, "rows/2/asyncckpt_stall_s", ".3f"),
            Fig(SC, "rows/2/stall_vs_foreach"),
            Fig(SC, "rows/2/asyncckpt_durable_s"),
            Fig(SC, "rows/2/durable_vs_dcp_thread"),
        ),
    ),
    Quote(
        "README.md",
        "| `load_latest` with verification vs `dcp.load` | {}-{}x at 20k and 100k tensors; 1 GiB:"
        " {}x warm, {}x cold |",
        (
            Fig(SC, LOADS, how="min"),
            Fig(SC, LOADS, how="max"),
            Fig(SC, "big_summary/load_vs_dcp_load_warm"),
            Fig(SC, "big_summary/load_vs_dcp_load_cold"),
        ),
    ),
]

DOCS_QUOTES = [
    Quote(
        "docs/benchmarks.md",
        "| {}x the fastest warm copy, paired per save ({} s median) |",
        (
            Fig(OV, f"{ASYNC}/ratio_stall_vs_paired_copy"),
            Fig(OV, f"{ASYNC}/stall_seconds/median", ".3f"),
        ),
    ),
    Quote(
        "docs/benchmarks.md",
        "| median {}x ({} vs {} s, process executor + shm stager; {}x paired); first save {}x"
        " ({} vs {} s, the fastest DCP first save: thread executor) |",
        (
            Fig(OV, "comparisons/fastest_dcp_async/asyncckpt_stall_ratio"),
            Fig(OV, f"{ASYNC}/stall_seconds/median", ".3f"),
            Fig(OV, f"{DCP_PROC}/stall_seconds/median", ".3f"),
            Fig(OV, "comparisons/fastest_dcp_async/asyncckpt_stall_ratio_paired"),
            Fig(OV, "comparisons/fastest_dcp_async/asyncckpt_first_stall_ratio"),
            Fig(OV, f"{ASYNC}/stall_first_seconds", ".3f"),
            Fig(OV, f"{DCP_THREAD}/stall_first_seconds", ".3f"),
        ),
    ),
    Quote(
        "docs/benchmarks.md",
        "| {}x paired per save ({} MB/s; O_DIRECT) |",
        (
            Fig(OV, f"{ASYNC}/ratio_throughput_vs_paired_raw_write"),
            Fig(OV, f"{ASYNC}/write_throughput_bytes_per_s", ".0f", per=1e6),
        ),
    ),
    Quote(
        "docs/benchmarks.md",
        "| staging memory <= 1x state per save in flight | {}x |",
        (Fig(OV, f"{ASYNC}/staging_bytes_per_state_byte"),),
    ),
    Quote(
        "docs/benchmarks.md",
        "| {}% ± {} A/B vs the no-checkpoint runs of the same 10 rounds; {}% paired",
        (
            Fig(TL, f"{ASYNC}/overhead_pct", "+.2f"),
            Fig(TL, f"{ASYNC}/overhead_sem_pct"),
            Fig(TL, f"{ASYNC}/overhead_vs_own_quiet_steps_pct", "+.2f"),
        ),
    ),
    Quote(
        "docs/benchmarks.md",
        "| {}% (20 steps); write + commit {} s median under that load |",
        (
            Fig(TL, f"{ASYNC}/during_write_slowdown_pct", "+.2f"),
            Fig(TL, f"{ASYNC}/write_commit_seconds/median", ".3f"),
        ),
    ),
    Quote(
        "docs/benchmarks.md",
        "| {}% ± {} A/B, {}% paired, {}% during a write |",
        (
            Fig(TL, f"{ASYNC}:offload/overhead_pct", "+.2f"),
            Fig(TL, f"{ASYNC}:offload/overhead_sem_pct"),
            Fig(TL, f"{ASYNC}:offload/overhead_vs_own_quiet_steps_pct", "+.2f"),
            Fig(TL, f"{ASYNC}:offload/during_write_slowdown_pct", "+.2f"),
        ),
    ),
    Quote(
        "docs/benchmarks.md",
        "`for_optimizer_offload()`: {}% (1 Adam thread), {}% (2 threads); with"
        " `pause_writes_during` {}% / {}% |",
        (
            Fig(OT1, "modes/on/slowdown_pct", "+.1f"),
            Fig(OT2, "modes/on/slowdown_pct", "+.1f"),
            Fig(OT1, "modes/on+pause/slowdown_pct", "+.1f"),
            Fig(OT2, "modes/on+pause/slowdown_pct", "+.1f"),
        ),
    ),
    Quote(
        "docs/benchmarks.md",
        "| {}% (1 thread), {}% (2 threads) |",
        (
            Fig(OT1, "modes/off/slowdown_pct", "+.0f"),
            Fig(OT2, "modes/off/slowdown_pct", "+.0f"),
        ),
    ),
    Quote(
        "docs/benchmarks.md",
        "| 20k: {}x ({} vs {} s), 100k: {}x ({} vs {} s), each save against the copy timed just"
        " before it; medians of separate runs {}x / {}x |",
        (
            Fig(SC, "rows/2/stall_vs_foreach"),
            Fig(SC, "rows/2/asyncckpt_stall_s", ".3f"),
            Fig(SC, "rows/2/paired_foreach_s", ".3f"),
            Fig(SC, "rows/3/stall_vs_foreach"),
            Fig(SC, "rows/3/asyncckpt_stall_s", ".3f"),
            Fig(SC, "rows/3/paired_foreach_s", ".3f"),
            Fig(SC, "rows/2/stall_vs_foreach_unpaired"),
            Fig(SC, "rows/3/stall_vs_foreach_unpaired"),
        ),
    ),
    Quote(
        "docs/benchmarks.md",
        "| {}x ({} vs {} s, thread executor;",
        (
            Fig(SC, "rows/2/durable_vs_dcp_thread"),
            Fig(SC, "rows/2/asyncckpt_durable_s"),
            Fig(SC, "rows/2/dcp_thread_durable_s"),
        ),
    ),
    Quote(
        "docs/benchmarks.md",
        "| {}x (durable {} s, O_DIRECT; buffered write + fsync {} s) |",
        (
            Fig(SC, "big_summary/big_raw_vs_durable"),
            Fig(SC, "big_summary/asyncckpt_durable_s", ".3f"),
            Fig(SC, "big_summary/raw_write_fsync_s"),
        ),
    ),
    Quote(
        "docs/benchmarks.md",
        "| 20k: {}x warm, {}x cold; 100k: {}x / {}x; 1 GiB: {}x / {}x |",
        (
            Fig(SC, "rows/2/load_vs_dcp_load_warm"),
            Fig(SC, "rows/2/load_vs_dcp_load_cold"),
            Fig(SC, "rows/3/load_vs_dcp_load_warm"),
            Fig(SC, "rows/3/load_vs_dcp_load_cold"),
            Fig(SC, "big_summary/load_vs_dcp_load_warm"),
            Fig(SC, "big_summary/load_vs_dcp_load_cold"),
        ),
    ),
    Quote(
        "docs/benchmarks.md",
        "entering the engine returns in {} s (median; the worker's own start-up, which it no"
        " longer waits for, took {} s median, {}-{} s); a first `save` made at once waits for"
        " the worker, {} s; one made 5 s after start, {} s",
        (
            Fig(ST, "seconds/start/median", ".3f"),
            Fig(ST, "seconds/ready/median", ".1f"),
            Fig(ST, "seconds/ready/min", ".1f"),
            Fig(ST, "seconds/ready/max", ".1f"),
            Fig(ST, "seconds/first_save_now/median", ".1f"),
            Fig(ST, "seconds/first_save_after/median", ".2f"),
        ),
    ),
    Quote(
        "docs/getting-started.md",
        "the worker's start took {} s (median of {} fresh processes; {}-{} s), a `save` made"
        " at once waited {} s for it, one made 5 s after the start {} s",
        (
            Fig(ST, "seconds/ready/median", ".1f"),
            Fig(ST, "seconds/ready/n", ".0f"),
            Fig(ST, "seconds/ready/min", ".1f"),
            Fig(ST, "seconds/ready/max", ".1f"),
            Fig(ST, "seconds/first_save_now/median", ".1f"),
            Fig(ST, "seconds/first_save_after/median", ".2f"),
        ),
    ),
    Quote(
        "docs/getting-started.md",
        "Memory saves beside disk saves, two copies (measured peak: {}x the state)",
        (Fig("memory_peak.json", "peak_ratio"),),
    ),
]

DT = "differential_threshold.json"
DOCS_QUOTES += [
    Quote(
        "docs/how-to/memory-tier.md",
        "| memory tier + disk saves | 2 | {}x |",
        (Fig("memory_peak.json", "peak_ratio"),),
    ),
    *(
        Quote(  # the run the results file holds: the table's last column
            "docs/how-to/differential-saves.md",
            "| {}x ({} / {} ms) |",
            (
                Fig(DT, f"threshold/sizes/{kib}/fingerprint_over_copy"),
                Fig(DT, f"threshold/sizes/{kib}/fingerprint_s", ".0f", per=1e-3),
                Fig(DT, f"threshold/sizes/{kib}/copy_s", ".0f", per=1e-3),
            ),
        )
        for kib in (4, 64, 256, 512, 1024, 4096)
    ),
]

CS = "chunked_staging.json"
DOCS_QUOTES += [
    *(
        Quote(
            "docs/how-to/host-memory-budget.md",
            f"| {label} | {{}} | {{}} s | {{}} s |",
            (
                Fig(CS, f"budgets/{b}/chunks", ".0f"),
                Fig(CS, f"budgets/{b}/stall_s", ".3f"),
                Fig(CS, f"budgets/{b}/durable_s", ".3f"),
            ),
        )
        for b, label in (
            ("1.0x", "the whole state"),
            ("0.5x", "half the state"),
            ("0.25x", "a quarter of the state"),
        )
    ),
    Quote(
        "docs/how-to/host-memory-budget.md",
        "Under a {} MiB budget the processes' memory (PSS) rose by at most {}x the state",
        (Fig(CS, "peak/budget_bytes", ".0f", per=MIB), Fig(CS, "peak/peak_ratio")),
    ),
]

B2B = "s3_back_to_back.json"
DOCS_QUOTES += [
    Quote(
        "docs/how-to/object-storage.md",
        "the saves before the queue filled waited at most {} s, a save once it was full waited up "
        "to {} s (uploads took {} s each, median); the first save of a run also waits for the "
        "worker's start ({} s there)",
        (
            Fig(B2B, "back_to_back/2/max_wait_before_the_queue_filled_seconds"),
            Fig(B2B, "back_to_back/2/max_wait_once_full_seconds", ".1f"),
            Fig(B2B, "back_to_back/2/median_upload_seconds"),
            Fig(B2B, "back_to_back/2/first_save_wait_seconds", ".1f"),
        ),
    ),
]

#: A number with a unit, as the headline writes its figures.
FIGURE = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?(?:x|%| s\b| MB/s| GB/s)")


def _flat(text: str) -> str:
    """The page as one line: a passage may wrap anywhere."""
    return re.sub(r"\s+", " ", text)


@cache
def _page(page: str) -> str:
    return _flat((REPO / page).read_text())


def _headline() -> str:
    text = _page("README.md")
    start = text.index("## Headline figures")
    end = text.find(" ## ", start + 3)
    return text[start : end if end > 0 else len(text)]


@pytest.mark.parametrize("quote", README_QUOTES + DOCS_QUOTES, ids=lambda q: q.passage[:40])
def test_the_page_quotes_the_results_file(quote: Quote) -> None:
    text = quote.text()
    assert text in _page(quote.page), f"{quote.page} should say, from {quote.figs[0].file}:\n{text}"


def test_every_headline_figure_comes_from_a_results_file() -> None:
    head = _headline()
    covered = [
        (m.start(), m.end()) for q in README_QUOTES for m in re.finditer(re.escape(q.text()), head)
    ]
    loose = [
        m.group()
        for m in FIGURE.finditer(head)
        if not any(a <= m.start() and m.end() <= b for a, b in covered)
    ]
    assert not loose, f"README headline figures with no results file behind them: {loose}"


def test_figures_are_read_and_found_as_written() -> None:
    assert Fig(OV, f"{ASYNC}/stall_seconds/median", ".3f").text() == "0.151"
    assert Fig(OT1, "modes/on/slowdown_pct", "+.1f").text() == "-0.4"
    assert FIGURE.findall("is 1.47x the copy, 0.233 s, +3.95%, 1754 MB/s; 2 threads") == [
        "1.47x",
        "0.233 s",
        "+3.95%",
        "1754 MB/s",
    ]
