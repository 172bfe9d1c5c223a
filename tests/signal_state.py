"""Children a test stops with a signal: started with the stop signals at their defaults, and, should one not
stop, what it was doing (its signal masks and every thread's stack)."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path


def stuck(proc: subprocess.Popen[str]) -> str:
    """Its signal state (``/proc/PID/status`` and each thread's blocked set) now; then its threads' stacks, which
    batchbench prints to its output on ``kill -USR1`` (read from the output after this)."""
    status = Path(f"/proc/{proc.pid}/status")
    lines = [line for line in status.read_text().splitlines() if line.startswith(("Sig", "Shd"))] \
        if status.exists() else ["(no /proc status)"]
    for task in sorted(Path(f"/proc/{proc.pid}/task").glob("*")):
        try:
            blocked = next(line for line in (task / "status").read_text().splitlines() if line.startswith("SigBlk"))
            name = (task / "comm").read_text().strip()
        except (OSError, StopIteration):
            continue
        lines.append(f"thread {task.name} {name}: {blocked}")
    proc.send_signal(signal.SIGUSR1)
    time.sleep(3)
    return "\n".join(lines)


def stoppable() -> None:
    """``preexec_fn`` for a child a test stops with a signal: SIGINT, SIGTERM and SIGHUP at their defaults. Run
    from a background job (bash then ignores SIGINT and SIGQUIT) or under ``nohup`` (SIGHUP), the tests would hand
    the child an ignored signal, which batchbench keeps ignored as it should, and the child would not stop."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
