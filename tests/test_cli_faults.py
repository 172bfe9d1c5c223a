"""Faults a nightly job meets, through the CLI as a user's shell or a scheduler drives it: SIGTERM and SIGHUP
mid-run, a results folder that fills up, a runaway stream in the warm-up. Each must end within seconds with
one clear line, and leave what was measured on disk, readable by ``batchbench report``."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from batchbench.cli import main
from batchbench.core.exits import EXIT_ENGINE, EXIT_WRITE
from batchbench.results import journal
from batchbench.results.document import RunDocument
from batchbench.results.journal import ResultsWriteError
from tests.server_process import serving
from tests.signal_state import stoppable, stuck


@pytest.fixture(scope="module")
def slow_vllm_url() -> Iterator[str]:
    """A vLLM protocol server at 5 ms a token: a run of 20 requests of 32 tokens lasts seconds, not milliseconds."""
    with serving("batchbench.fixtures.protocol", "vllm", "--token-delay", "0.005", "--max-running", "64") as url:
        yield url


class Cli:
    """``python -m batchbench ARGS`` in a child process, its output read line by line as it comes."""

    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "batchbench", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True,
                                     env=os.environ | {"PYTHONUNBUFFERED": "1"}, preexec_fn=stoppable)
        self.lines: list[str] = []
        self._seen = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._seen:
                self.lines.append(line)
                self._seen.notify_all()

    def wait_for(self, text: str, timeout: float = 120) -> None:
        with self._seen:
            assert self._seen.wait_for(lambda: any(text in line for line in self.lines), timeout), self.output()

    def output(self) -> str:
        return "".join(self.lines)

    def stop(self, sig: signal.Signals) -> tuple[int, float]:
        """Send ``sig``; the exit status and the seconds until the process was gone."""
        t0 = time.monotonic()
        self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            state = stuck(self.proc)
            pytest.fail(f"no exit 30 s after {sig.name}:\n{state}\n{self.output()[-20000:]}")
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        elapsed = time.monotonic() - t0
        self._reader.join(timeout=10)
        return code, elapsed


def _documents(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(run_dir.glob("vllm_*.json"))]


@pytest.mark.parametrize(("command", "sig", "summary"), [
    (["bench", "--concurrency", "1,2"], signal.SIGTERM, "bench.json"),
    (["bench", "--concurrency", "1,2"], signal.SIGHUP, "bench.json"),
    (["capacity", "--slo", "ttft_p99=30s", "--start", "1", "--max", "2"], signal.SIGTERM, "capacity.json"),
    (["run", "--levels", "1,2", "--repeats", "1"], signal.SIGTERM, None),
])
def test_a_stop_signal_mid_run_finishes_as_ctrl_c_does(command: list[str], sig: signal.Signals, summary: str | None,
                                                       slow_vllm_url: str, tmp_path: Path) -> None:
    workload = [] if command[0] == "run" else ["--num-requests", "20", "--output-len", "32"]
    cli = Cli([*command, "--engine", "vllm", "--engine-url", f"vllm={slow_vllm_url}", *workload,
               "--results-dir", str(tmp_path)])
    # The second run is under way a moment after the first one's line (run: its second point's line).
    cli.wait_for("point 2 of" if command[0] == "run" else "vllm c=1 #0:")
    time.sleep(0.5)
    code, elapsed = cli.stop(sig)
    out = cli.output()
    assert code == 128 + sig, out  # as a shell reports a job the signal ended: 143, 129
    assert elapsed < 3, f"took {elapsed:.1f}s to stop"
    assert f"stopped by {sig.name}" in out
    (run_dir,) = tmp_path.glob(f"{command[0]}-*")
    assert not list(run_dir.glob("*.jsonl")) and not list(run_dir.glob("*.tmp")), sorted(run_dir.iterdir())
    statuses = sorted(doc["status"] for doc in _documents(run_dir))
    assert "complete" in statuses and "interrupted" in statuses, statuses  # the run cut short, folded
    if summary is not None:
        assert json.loads((run_dir / summary).read_text())["runs"], "the finished runs are in the summary"
    assert main(["report", str(run_dir), "--out", str(tmp_path / "report")]) == 0


def test_a_runaway_stream_in_the_warm_up_ends_the_start_at_once(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    with serving("batchbench.fixtures.protocol", "vllm", "--fault", "endless", "--fault-after", "3",
                 "--token-delay", "0.001") as url:
        t0 = time.monotonic()
        code = main(["bench", "--engine", "vllm", "--engine-url", f"vllm={url}", "--request-timeout", "10",
                     "--num-requests", "4", "--results-dir", str(tmp_path)])
        elapsed = time.monotonic() - t0
    err = capsys.readouterr().err
    assert code == EXIT_ENGINE and elapsed < 10, err
    assert "every warm-up request" in err and "more than max_tokens=16 tokens (17 so far); cut" in err


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs: a results folder that fills up after a few dozen records."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True,
                          text=True, check=False)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {made.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_results_folder_that_fills_up_ends_the_run_with_one_line(
        slow_vllm_url: str, small_tmpfs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    t0 = time.monotonic()
    code = main(["bench", "--engine", "vllm", "--engine-url", f"vllm={slow_vllm_url}", "--num-requests", "400",
                 "--output-len", "4", "--concurrency", "8", "--results-dir", str(small_tmpfs)])
    elapsed = time.monotonic() - t0
    err = capsys.readouterr().err
    assert code == EXIT_WRITE and elapsed < 30, err
    (line,) = [line for line in err.splitlines() if "No space left on device" in line]
    assert line.startswith("batchbench: cannot write ") and ".jsonl" in line
    assert "Traceback" not in err
    (run_dir,) = small_tmpfs.glob("bench-*")
    assert not [p for p in run_dir.iterdir() if p.suffix == ".tmp" or p.name.endswith(".json.tmp")]
    (journal,) = run_dir.glob("*.jsonl")
    partial = RunDocument.load(journal)
    assert partial.partial and partial.records, "what was flushed is readable"
    assert main(["report", str(run_dir), "--out", str(tmp_path / "report")]) == 0


class _FillsUp:
    """A journal file on a disk with ``room`` bytes left: writes are buffered, the flush past it fails."""

    def __init__(self, path: Path, room: int) -> None:
        self.real = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed by close(), as the writer does
        self.room, self.pending = room, ""

    def write(self, text: str) -> int:
        self.pending += text
        return len(text)

    def flush(self) -> None:
        if len(self.pending) > self.room:
            self.real.write(self.pending[:self.room])  # a torn last line, as a full disk leaves it
            self.real.flush()
            self.room, self.pending = 0, ""
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.real.write(self.pending)
        self.real.flush()
        self.room -= len(self.pending)
        self.pending = ""

    def close(self) -> None:
        self.real.close()


async def test_a_refused_write_stops_the_run_and_keeps_what_was_flushed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from batchbench.adapters.vllm import VLLMEngine
    from batchbench.core.config import LoadConfig, ModelRef
    from batchbench.fixtures.protocol import start_server
    from batchbench.load.runner import run
    from batchbench.workload.requests import Arrival, Lengths, WorkloadSpec

    monkeypatch.setattr(journal, "open", lambda path, mode, encoding: _FillsUp(Path(path), room=40_000),
                        raising=False)
    server = start_server("vllm", token_delay=0.001, max_running=64)
    workload = WorkloadSpec("fills", 2000, prompt=Lengths.fixed(8), output=Lengths.fixed(4),
                            arrival=Arrival("closed", concurrency=4), seed=0).build()
    try:
        async with VLLMEngine(model=ModelRef("batchbench/tiny-llama"), url=server.url) as engine:
            t0 = time.monotonic()
            with pytest.raises(ResultsWriteError, match="No space left on device") as info:
                await run(engine, workload, results_dir=tmp_path, load=LoadConfig(request_timeout_s=10))
            assert time.monotonic() - t0 < 10  # stopped at the failure, not after 2000 requests
    finally:
        server.stop()
        monkeypatch.undo()
    assert info.value.path.suffix == ".jsonl"
    partial = RunDocument.load(info.value.path)
    assert partial.partial and 0 < len(partial.records) < 2000
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".jsonl"]  # no document, no temporary file
