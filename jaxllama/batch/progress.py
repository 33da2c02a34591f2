"""Progress on stderr: a tqdm bar on a terminal, a plain line every few seconds otherwise, nothing when quiet."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

PLAIN_EVERY_S = 10.0


class Progress:
    def __init__(self, total: int, quiet: bool = False, initial_skipped: int = 0, retried: int = 0, file=None):
        self.file = file or sys.stderr
        self.total, self.quiet = total, quiet
        self.done = self.errors = self.tokens = 0
        self.start = self.last_plain = time.perf_counter()
        self.tty = hasattr(self.file, "isatty") and self.file.isatty()
        self.bar = None
        if (initial_skipped or retried) and not quiet:
            again = f"; retrying {retried} that failed" if retried else ""
            print(f"resuming: {initial_skipped} requests already done{again}", file=self.file, flush=True)
        if not quiet and self.tty:
            self.bar = tqdm(total=total, unit="req", file=self.file, dynamic_ncols=True, desc="jaxllama run")

    def update(self, ok: bool, tokens: int) -> None:
        self.done += 1
        self.errors += not ok
        self.tokens += tokens
        if self.quiet:
            return
        rate = self.tokens / max(time.perf_counter() - self.start, 1e-9)
        if self.bar is not None:
            self.bar.set_postfix(tok_s=f"{rate:.1f}", errors=self.errors, refresh=False)
            self.bar.update()
        elif time.perf_counter() - self.last_plain >= PLAIN_EVERY_S or self.done == self.total:
            self.last_plain = time.perf_counter()
            print(
                f"{self.done}/{self.total} requests, {rate:.1f} output tok/s, {self.errors} errors",
                file=self.file,
                flush=True,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
