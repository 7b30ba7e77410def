"""Progress of a long preprocessing run: bars on a terminal, plain timed lines in a log.

Bars redraw with carriage returns, which turn a log file into one endless line; with bars
off, a line is printed every `interval` seconds instead, so logs stay readable.
"""

from __future__ import annotations

import sys
import time

from tqdm import tqdm


class Progress:
    """Files done (of the total) and tokens per second."""

    def __init__(self, total_files: int, done_files: int, bars: bool, interval: float = 30.0):
        self.total_files, self.files, self.tokens = total_files, done_files, 0
        self.bars = bars
        self.interval = interval
        self.start = self._last = time.perf_counter()
        if bars:
            self._files = tqdm(
                total=total_files, initial=done_files, desc="files", unit=" file", dynamic_ncols=True, position=0
            )
            self._tokens = tqdm(desc="tokens", unit=" tok", unit_scale=True, dynamic_ncols=True, position=1)

    def update(self, files: int = 0, tokens: int = 0) -> None:
        self.files += files
        self.tokens += tokens
        if self.bars:
            self._files.update(files)
            self._tokens.update(tokens)
        elif time.perf_counter() - self._last >= self.interval:
            self._last = time.perf_counter()
            print(self.line(), file=sys.stderr, flush=True)

    def line(self) -> str:
        seconds = max(time.perf_counter() - self.start, 1e-9)
        return (
            f"progress: {self.files}/{self.total_files} files, {self.tokens:,} tokens, "
            f"{self.tokens / seconds:,.0f} tokens/s"
        )

    def write(self, message: str) -> None:
        """A message that must not be torn by a bar's redraw."""
        if self.bars:
            tqdm.write(message, file=sys.stderr)
        else:
            print(message, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bars:
            self._tokens.close()
            self._files.close()
