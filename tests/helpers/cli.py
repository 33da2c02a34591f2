"""The `jaxllama` command as the CLI tests run it: in a subprocess sharing the test session's caches."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.multiprocess import REPO


def jaxllama(*args, env=None, timeout=600, **kwargs):
    """The `jaxllama` command in a subprocess, sharing the test session's caches; its output captured."""
    env = {**os.environ, "JAXLLAMA_CACHE": os.environ.get("JAXLLAMA_TEST_CACHE", ""), **(env or {})}
    env = {k: v for k, v in env.items() if v != ""}
    return subprocess.run(
        [sys.executable, "-m", "jaxllama.cli", *map(str, args)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        **kwargs,
    )
