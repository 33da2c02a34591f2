"""What the benchmarks measure from outside: a child process's peak memory, and this machine's roofline
(float32 matmul peak and memory bandwidth), measured here rather than taken from a datasheet."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import numpy as np
import psutil


def peak_rss(cmd: list[str], cwd: Path, env: dict | None = None, stdout=None) -> int:
    """Run cmd to completion and return the peak resident set size in bytes of it and the processes it started (a
    peer's server), summed (sampled every 50 ms, anonymous and file-backed pages); raises SystemExit if it fails."""
    child = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=stdout)
    proc, peak = psutil.Process(child.pid), 0
    while child.poll() is None:
        try:
            tree = [proc, *proc.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
        except psutil.NoSuchProcess:
            pass
        time.sleep(0.05)
    if child.returncode:
        raise SystemExit(f"{' '.join(map(str, cmd))} failed with exit status {child.returncode}")
    return peak


def _best_of(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def matmul_flops(n: int = 2048, repeats: int = 5) -> float:
    """float32 FLOP/s of an n x n x n matrix product through JAX (XLA:CPU, all cores)."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    return 2 * n**3 / _best_of(lambda: f(a).block_until_ready(), repeats)


def memory_bandwidth(mb: int = 512, repeats: int = 5) -> float:
    """Bytes/s of a streaming copy (read + write counted) of an array much larger than the caches."""
    src = np.ones(mb * 2**20 // 4, np.float32)
    dst = np.empty_like(src)
    return 2 * src.nbytes / _best_of(lambda: np.copyto(dst, src), repeats)
