"""The README as a new user meets it (issue 11): its two set-up commands are what CI runs, and
every Python snippet and the command-line block run as written, in a fresh directory, with the
checkout's asyncckpt (the fresh-venv run of the first command is `.ci/run`'s job)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

from snippets import env, run_python

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def blocks(lang: str) -> list[str]:
    return [m.group(2) for m in FENCE.finditer(README.read_text()) if m.group(1) == lang]


def test_setup_commands_are_what_ci_runs():
    # The two set-up commands chain torch's install with the rest; the CPU-only machine's
    # `pip install torch==... --index-url ...` beside them is a step before, not a third one.
    setup = [
        b.strip()
        for b in blocks("bash")
        if b.strip().startswith("pip install torch==") and "&&" in b
    ]
    assert len(setup) == 2, "the README holds two set-up commands (example, tests)"
    example, tests = setup
    assert "python examples/" in example and "pytest" in tests
    ci = (REPO / ".ci" / "run").read_text()
    for cmd in setup:
        assert cmd in ci, f".ci/run must run the README's command verbatim: {cmd}"
    # A failure anywhere in a chain fails CI: under `set -e`, a command of an `a && b` list
    # that fails, other than the last, does not stop the script (the quick suite's failures
    # once hid behind a passing integration run). So a chain is the last command of its
    # subshell, or it is guarded by `|| failed+=(...)`, which the end of the script turns into
    # its exit code.
    lines = [ln for ln in ci.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    for i, line in enumerate(lines):
        if "&&" in re.sub(r"'[^']*'", "", line.split("  #")[0]):  # (not inside awk's quotes)
            guarded = "|| failed+=(" in line
            assert guarded or lines[i + 1].strip() == ")", f"a failure here is lost: {line}"
    assert "if ((${#failed[@]})); then" in ci and ci.rstrip().endswith("fi")
    # The heavier integration tests have a README command of their own, out of the quick suite
    # and out of CI (with them, CI ran past its 90-minute limit).
    integration = next(
        line.split("#")[0].strip()
        for b in blocks("bash")
        for line in b.splitlines()
        if '-m "integration' in line
    )
    assert integration not in ci and "not integration" in tests
    # The example's command runs in a fresh venv with no extras: an undeclared import fails it.
    assert "venv" in ci and "[" not in example
    # Each runs in a fresh venv of its own, made by .ci/run and activated right before it: the
    # machine's Python, with its older tools, once hid a failing fresh set-up. The example
    # goes first, with no extra installed; the tests' venv is activated in CI's own shell, not
    # in a subshell that ends before the stages after it.
    assert ci.index(example) < ci.index(tests)
    made = [v.strip('"') for v in re.findall(r"^\s*python -m venv (\S+)$", ci, re.M)]
    sourced = re.findall(r'^(\s*)source "?([^"\s]+)/bin/activate"?$', ci, re.M)
    assert len(set(made)) == len(made) >= 2, made
    assert [v for _, v in sourced] == made, (made, sourced)
    before_example = ci[: ci.index(example)]
    before_tests = ci[ci.index(example) + len(example) : ci.index(tests)]
    assert f"{made[0]}/bin/activate" in before_example
    assert f'python -m venv "{made[1]}"' in before_tests
    assert ("", made[1]) in sourced, "the tests' venv is activated in CI's own shell"
    # After them, the docs site is built by the README's command, in a fresh venv with the docs
    # extra (and torch installed first, as the README's first command does); then the package
    # is built and its wheel and sdist installed in fresh venvs of their own.
    docs = next(
        line.split("#")[0].strip()
        for b in blocks("bash")
        for line in b.splitlines()
        if "mkdocs build --strict" in line
    )
    assert '".[docs]"' in docs and f"pip install torch==2.13.0 && {docs}" in ci
    after = ci[ci.index(tests) :]
    assert docs in after and "python -m build" in after[after.index(docs) :]
    # The tests that read the built site skip in the tests' venv (no docs extra): they run here.
    assert "tests/test_reference.py" in after[after.index(docs) : after.index("python -m build")]
    docs_venv = after[: after.index(docs)].rsplit("python -m venv ", 1)[1].split()[0].strip('"')
    assert docs_venv in made[2:], (docs_venv, made)


def test_the_test_command_installs_from_the_committed_constraints():
    """A fresh machine resolves the test tools CI passed with, not the newest of the day."""
    tests = next(b.strip() for b in blocks("bash") if "pytest" in b and "pip install" in b)
    found = re.search(r"pip install -c (\S+) ", tests)
    assert found, "the test command must install with -c <constraints file>"
    pins = {}
    for line in (REPO / found.group(1)).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"not an exact pin: {line}"
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    for tool in ("pytest", "pytest-asyncio", "pytest-xdist", "hypothesis", "trio", "ruff", "moto"):
        assert tool in pins, f"{tool} is not pinned"
    # torch is the first command's (and scripts/torch_matrix.sh's) choice, not the file's.
    assert "torch" not in pins
    pyproject = (REPO / "pyproject.toml").read_text()
    megatron = re.search(r'"megatron-core==([^"]+)"', pyproject)
    assert megatron and pins["megatron-core"] == megatron.group(1)


def test_python_snippets_run_as_written(tmp_path):
    snippets = blocks("python")
    assert len(snippets) >= 3
    quick_start = snippets[0]
    assert "load_latest" in quick_start
    first = run_python(quick_start, tmp_path, "README quick start")
    assert "starting at step 0" in first
    assert "latest committed step: 1000" in first
    # Run twice verbatim: the second run is the resume the Quick start promises.
    second = run_python(quick_start, tmp_path, "README quick start")
    assert "starting at step 1000" in second, second
    for code in snippets[1:]:
        # A block for an optional integration names it on its first line ("# requires: pkg")
        # and is run, with its output checked, by that integration's own test module
        # (test_hf_trainer, test_lightning, test_stats), which skips where pkg is missing.
        if code.startswith("# requires:"):
            continue
        run_python(code, tmp_path, "README snippet")

    # The command-line block, on the root the Quick start wrote.
    (cli,) = [b for b in blocks("bash") if "python -m asyncckpt" in b]
    for line in cli.splitlines():
        cmd = line.split("#", 1)[0].strip()
        if not cmd:
            continue
        argv = shlex.split(cmd)
        assert argv[:3] == ["python", "-m", "asyncckpt"], cmd
        r = subprocess.run(
            [sys.executable, *argv[1:]], cwd=tmp_path, env=env(), capture_output=True,
            text=True, timeout=120,
        )  # fmt: skip
        assert r.returncode == 0, f"{cmd}\n{r.stdout}\n{r.stderr}"
    left = sorted(p.name for p in (tmp_path / "ckpts").glob("global_step_*"))
    assert "global_step_1000" in left and len(left) <= 2, left
