"""The progress display of a training run: a tqdm bar on a terminal, plain periodic lines in a redirected log.

A bar redraws itself with carriage returns, which a log file (``> run.log``, a cluster job's output) keeps as one
ever-growing line; :func:`progress` gives a bar only when its stream is a terminal, else a :class:`LineProgress`
with the same methods that prints one line every ``every`` steps and at the last one.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["LineProgress", "progress"]


class LineProgress:
    """tqdm's ``update`` / ``set_postfix`` / ``write`` / ``close`` as whole lines.

    Args:
        total (int): the last step.
        initial (int): the step it starts from (a resumed run).
        desc (str): the run's name, at the start of every line.
        every (int): a line every this many steps (and at ``total``).
        file (TextIO): the stream (default: stderr, where tqdm writes).
    """

    def __init__(self, *, total: int, initial: int = 0, desc: str = "", every: int = 1,
                 file: TextIO | None = None) -> None:  # fmt: skip
        if every < 1:
            raise ValueError(f"every must be >= 1 step, got {every}")
        self.total, self.n, self.desc, self.every = int(total), int(initial), desc, int(every)
        self.file = file if file is not None else sys.stderr
        self.postfix: dict[str, str] = {}
        self.t0, self.start = time.perf_counter(), int(initial)

    def update(self, n: int = 1) -> None:
        before, self.n = self.n, self.n + n
        if self.n // self.every > before // self.every or (self.n >= self.total > before):
            self._line()

    def set_postfix(self, **values) -> None:
        self.postfix = {k: str(v) for k, v in values.items()}

    def write(self, text: str) -> None:
        print(text, file=self.file, flush=True)

    def close(self) -> None:
        pass

    def _line(self) -> None:
        dt = time.perf_counter() - self.t0
        rate = (self.n - self.start) / dt if dt > 0 else 0.0
        extra = "".join(f", {k}={v}" for k, v in self.postfix.items())
        self.write(f"{self.desc}: step {self.n}/{self.total} ({100 * self.n / max(1, self.total):.0f}%), "
                   f"{rate:.2f} steps/s{extra}")  # fmt: skip


def progress(*, total: int, initial: int, desc: str, file: TextIO | None = None, lines: int = 20):
    """A tqdm bar when ``file`` (default stderr) is a terminal, else a :class:`LineProgress` printing about
    ``lines`` lines over the run."""
    file = file if file is not None else sys.stderr
    if getattr(file, "isatty", lambda: False)():
        from tqdm import tqdm

        return tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, file=file)
    return LineProgress(total=total, initial=initial, desc=desc, every=max(1, -(-total // lines)), file=file)
