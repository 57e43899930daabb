"""Running documented snippets as a user would: a fresh Python process in a scratch directory,
importing this checkout (tests/test_readme.py and tests/test_docs.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def env() -> dict[str, str]:
    """The environment a snippet runs in: this checkout importable, no fault armed."""
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e.pop("ASYNCCKPT_FAULTS", None)
    return e


def run_python(code: str, cwd: Path, where: str) -> str:
    """Run ``code`` as a script in ``cwd``; its stdout. Fails the test, naming ``where`` the
    snippet came from, when it exits non-zero."""
    script = cwd / "snippet.py"
    script.write_text(code)
    r = subprocess.run(
        [sys.executable, str(script)], cwd=cwd, env=env(), capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, f"{where} failed:\n{code}\n--- stderr:\n{r.stderr[-4000:]}"
    return r.stdout
