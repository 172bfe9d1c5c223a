"""The progress display: plain lines in a log, live fields on a terminal, one line for Ctrl-C during a start."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from rich.console import Console

from batchbench.adapters.registry import EngineOptions
from batchbench.core.records import RequestRecord
from batchbench.experiment.engines import StartingEngines
from batchbench.experiment.progress import Progress, last_log_line

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _record(i: int, ok: bool, tokens: int) -> RequestRecord:
    return RequestRecord(request_id=f"r{i}", prompt_len=4, max_tokens=tokens, scheduled_s=0.0, ok=ok,
                         chunk_times=[0.1] * tokens, chunk_tokens=[1] * tokens)


def _drive(progress: Progress, log: Path) -> None:
    """An engine start, then one run of 4 requests (one failed) inside a sweep of 2 points."""
    with progress.engine_starting("vllm", 300, log):
        progress.refresh()
    progress.sweep(1, 2, "c=1")
    with progress.run(4, "vllm continuous #0") as bar:
        for i in range(3):
            bar.observe(_record(i, ok=i != 1, tokens=8))
        progress.refresh()
        bar.observe(_record(3, ok=True, tokens=8))


def test_a_log_gets_one_plain_line_per_step(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text("INFO loading weights\n")
    out = io.StringIO()  # not a terminal
    with Progress.for_terminal(out) as progress:
        assert not progress.live
        _drive(progress, log)
    text = out.getvalue()
    assert "\r" not in text and "\x1b" not in text
    lines = text.splitlines()
    assert len(lines) == 3
    assert re.fullmatch(r"batchbench: vllm ready \(started in \d+\.\ds\)", lines[0])
    assert lines[1] == "batchbench: point 1 of 2: c=1"
    assert re.fullmatch(r"vllm continuous #0: 4/4 requests, [\d.]+ out tok/s, 1 errors", lines[2])


def test_a_terminal_shows_the_live_fields(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text("INFO starting\nINFO Loading model weights took 0.01 GB\n\n")
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, color_system=None, width=160)
    with Progress(console) as progress:
        assert progress.live
        with progress.engine_starting("vllm", 300, log):
            progress.refresh()
            shown = _ANSI.sub("", out.getvalue())
            assert re.search(r"starting vllm: \d+\.\ds of 300s {2}log: INFO Loading model weights took 0\.01 GB",
                             shown), shown
        progress.sweep(3, 8, "c=4")
        with progress.run(4, "vllm continuous #0") as bar:
            bar.observe(_record(0, ok=True, tokens=8))
            bar.observe(_record(1, ok=False, tokens=0))
            progress.refresh()
            shown = _ANSI.sub("", out.getvalue())
            assert "sweep: point 3 of 8 (c=4)" in shown
            assert re.search(r"vllm continuous #0 █+░+ 2/4 requests, [\d.]+ out tok/s, 1 errors", shown), shown
            bar.finish("  continuous #0: 3/4 ok")
    final = _ANSI.sub("", out.getvalue())
    assert "vllm ready (started in" in final and "  continuous #0: 3/4 ok" in final


def test_ctrl_c_during_an_engine_start_is_one_line(tmp_path: Path) -> None:
    out = io.StringIO()
    progress = Progress.for_terminal(out)
    with pytest.raises(KeyboardInterrupt), progress, progress.engine_starting("vllm", 300, None):
        raise KeyboardInterrupt
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and re.fullmatch(r"batchbench: interrupted while starting vllm \(\d+\.\ds of 300s\)",
                                            lines[0])
    assert progress.interrupted and "Traceback" not in out.getvalue()


def test_a_failed_start_leaves_the_line_to_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    out = io.StringIO()
    with pytest.raises(RuntimeError), Progress.for_terminal(out) as progress, progress.engine_starting("tgi"):
        raise RuntimeError("no docker")
    assert out.getvalue() == "" and not progress.interrupted
    progress.print("batchbench: skipping tgi: no docker", err=True)  # in a log, what went wrong is on stderr
    assert out.getvalue() == "" and capsys.readouterr().err == "batchbench: skipping tgi: no docker\n"


def test_the_last_log_line_is_read_from_the_end_and_cleaned(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_bytes(b"x" * 10_000 + b"\nfirst\nprogress 10%\rprogress 90%\x1b\n  \n")
    assert last_log_line(log) == "progress 90%"
    assert last_log_line(tmp_path / "missing.log") == ""
    assert last_log_line(lambda: None) == ""


def test_a_start_says_what_it_waits_for_live_and_in_a_log() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, color_system=None, width=160)
    with Progress(console) as progress, progress.engine_starting("vllm", 20, None) as start:
        start.wait_for("its warm-up (16 requests, none silent for 10s)", None)
        progress.refresh()
        assert re.search(r"starting vllm: waiting for its warm-up \(16 requests, none silent for 10s\) "
                         r"\(\d+\.\ds; \d+\.\ds in all\)", _ANSI.sub("", out.getvalue()))
        start.wait_for("its health check at http://host:8000", 20)
        progress.refresh()
        assert re.search(r"waiting for its health check at http://host:8000 \(\d+\.\ds of 20s; ",
                         _ANSI.sub("", out.getvalue()))

    log = io.StringIO()  # not a terminal: the phase is a line of its own, since nothing is redrawn
    engines = StartingEngines(EngineOptions(), Progress.for_terminal(log))
    with engines.progress.engine_starting("vllm") as engines._start:
        engines.phase("its health check at http://host:8000", 20)
    assert log.getvalue().splitlines()[0] == "batchbench: vllm: waiting for its health check at http://host:8000 " \
                                             "(at most 20s)"


def test_the_total_is_the_plan_s_and_an_extra_repeat_says_so() -> None:
    out = io.StringIO()
    with Progress.for_terminal(out) as progress:
        progress.sweep(18, 36, "vllm continuous c=1 #1")
        progress.sweep(18, 36, "vllm continuous c=8 #2", extra=True)
        progress.sweep(19, 36, "hf-static continuous c=1 #0")
    assert out.getvalue().splitlines() == [
        "batchbench: point 18 of 36: vllm continuous c=1 #1",
        "batchbench: extra repeat after point 18 of 36: vllm continuous c=8 #2",
        "batchbench: point 19 of 36: hf-static continuous c=1 #0",
    ]
