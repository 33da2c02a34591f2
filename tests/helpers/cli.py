"""The `jaxllama` command as the CLI tests run it: in a subprocess sharing the session's caches, or in this process."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout

import pytest

from tests.multiprocess import REPO


def jaxllama(*args, env=None, timeout=600, wrapper=(), **kwargs):
    """The `jaxllama` command in a subprocess, sharing the test session's caches; its output captured. `wrapper`: a
    command that runs it (its arguments follow)."""
    env = {**os.environ, "JAXLLAMA_CACHE": os.environ.get("JAXLLAMA_TEST_CACHE", ""), **(env or {})}
    env = {k: v for k, v in env.items() if v != ""}
    return subprocess.run(
        [*map(str, wrapper), sys.executable, "-m", "jaxllama.cli", *map(str, args)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        **kwargs,
    )


def jaxllama_here(*args) -> subprocess.CompletedProcess:
    """The `jaxllama` command run in this process by the CLI's entry point (`main`), for a command line or flag value
    it refuses before anything loads: its exit status and output as `jaxllama` (`program`) gives them, without
    starting a process that imports jax to print one line. What the command leaves in this process is put back: an
    output lock it took is released, as its process's end would, and jaxllama's logger (which it sends to stderr
    alone) is restored."""
    from jaxllama.batch.lock import OutputLock
    from jaxllama.cli import main

    argv = [str(a) for a in args]
    logger = logging.getLogger("jaxllama")
    kept = logger.level, logger.propagate, list(logger.handlers)
    taken = []
    acquire = OutputLock.acquire

    def acquire_and_keep(lock):
        taken.append(lock)
        return acquire(lock)

    out, err = io.StringIO(), io.StringIO()
    status = 0
    try:
        with pytest.MonkeyPatch.context() as patch, redirect_stdout(out), redirect_stderr(err):
            patch.setattr(OutputLock, "acquire", acquire_and_keep)
            main(argv)
    except SystemExit as e:  # the exit status as `program` makes it
        if isinstance(e.code, str):
            print(e.code, file=err)
        status = e.code if isinstance(e.code, int) else int(e.code is not None)
    finally:
        for lock in taken:
            lock.release()
        logger.level, logger.propagate, logger.handlers[:] = kept
    return subprocess.CompletedProcess(["jaxllama", *argv], status, out.getvalue(), err.getvalue())
