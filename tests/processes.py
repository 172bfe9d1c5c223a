"""Whether a process is still running, for the tests that check nothing batchbench started is left behind."""

from __future__ import annotations

from pathlib import Path


def alive(pid: int) -> bool:
    """Running, not merely a zombie waiting for whichever process adopted it to reap it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
