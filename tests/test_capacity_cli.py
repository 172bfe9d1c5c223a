"""``batchbench capacity`` end to end on an engine whose TTFT is a known function of concurrency.

The fake engine stamps its chunks on a virtual clock: the first token comes ``A + B * n`` seconds after
the request starts, ``n`` being the streams open at that moment, so a closed loop at concurrency ``c``
sees a TTFT of exactly ``A + B * c`` (plus the microseconds the client takes) whatever the machine's load.
With ``ttft_p99 <= L`` the capacity is ``floor((L - A) / B)``; the limits are chosen away from a whole
number so the client's microseconds cannot move the answer.
"""

from __future__ import annotations

import asyncio
import gc
import json
import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from batchbench import options
from batchbench.adapters import registry
from batchbench.adapters.base import Chunk, Engine, Usage
from batchbench.adapters.spec import EngineSpec
from batchbench.cli import main
from batchbench.core.clock import now
from batchbench.core.config import Capabilities
from batchbench.core.exits import EXIT_OK
from batchbench.experiment import engines
from batchbench.workload.requests import Request

A, B = 0.010, 0.020  # TTFT = 10 ms + 20 ms per request in flight (virtual: nothing sleeps)
TPOT = 0.001


class ClosedForm(Engine):
    """TTFT = A + B * (streams open), then one token every TPOT; all on a virtual clock, nothing waits."""

    name: ClassVar[str] = "closed-form"
    capabilities: ClassVar[Capabilities] = Capabilities(server_metrics=False)

    def __init__(self, batching: Any = None, *, model: Any = None, startup_timeout: float = 1.0) -> None:
        super().__init__(batching, startup_timeout=startup_timeout)
        self.open = 0

    async def start(self) -> None:
        pass

    async def wait_healthy(self, timeout: float) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def stream(self, request: Request) -> AsyncIterator[Chunk]:
        self.open += 1
        try:
            await asyncio.sleep(0)  # every worker of a closed loop opens its stream before any is answered
            first = now() + A + B * self.open
            for i in range(request.max_tokens):
                yield Chunk(first + i * TPOT, 1)
            yield Chunk(first + request.max_tokens * TPOT, 0, Usage(request.prompt_len, request.max_tokens), "length")
        finally:
            self.open -= 1


SPEC = EngineSpec(name="closed-form", engine_class=ClosedForm, summary="TTFT grows linearly with concurrency",
                  container=False)


@pytest.fixture
def closed_form(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fake engine in the registry for this test only, made as it is (it has no server to launch or reach)."""
    known = dict(registry.specs())
    monkeypatch.setattr(registry, "specs", lambda: {**known, SPEC.name: SPEC})
    for module in (options, engines):
        made = module.make_engine
        monkeypatch.setattr(module, "make_engine", lambda name, batching, opts, made=made:
                            ClosedForm(batching) if name == SPEC.name else made(name, batching, opts))


@pytest.mark.parametrize("limit_ms", [780.0, 360.0, 80.0])
def test_capacity_finds_the_concurrency_the_closed_form_predicts(closed_form: None, tmp_path: Path, limit_ms: float,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    expected = math.floor((limit_ms / 1000 - A) / B)
    # Each limit lies halfway between two levels' TTFTs, 10 ms from either: the real time between a request's sent
    # stamp and its stream's start (a busy machine's scheduling, a collector pass: one of 67 ms was seen in this
    # process) is added to the virtual clock's TTFT.
    gc.disable()
    try:
        code = main(["capacity", "--engine", "closed-form", "--slo", f"ttft_p99={limit_ms}ms", "--input-len", "8",
                     "--output-len", "4", "--num-requests", "64", "--max", "64", "--results-dir", str(tmp_path),
                     "--no-report"])
    finally:
        gc.enable()
    out = capsys.readouterr().out
    assert code == EXIT_OK, out
    (run_dir,) = tmp_path.glob("capacity-*")
    doc = json.loads((run_dir / "capacity.json").read_text())
    found = doc["engines"]["closed-form"]
    assert found["capacity"] == expected and found["first_failing"] == expected + 1
    assert found["failed"][0].startswith("ttft_p99=") and found["failed"][0].endswith(f">{limit_ms:g}ms")
    assert len(found["points"]) <= 2 * math.ceil(math.log2(64)) + 3
    # Every measured level is a results document labelled with it; the answer is printed with its goodput.
    labels = sorted(json.loads(p.read_text())["labels"]["concurrency"] for p in run_dir.glob("closed-form_*.json"))
    assert labels == sorted(p["level"] for p in found["points"])
    assert f"capacity c={expected}, goodput" in out and f"first failing c={expected + 1}: ttft_p99=" in out


def test_capacity_reports_when_no_level_meets_the_slo(closed_form: None, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["capacity", "--engine", "closed-form", "--slo", "ttft_p99=12ms", "--input-len", "8",
                 "--output-len", "4", "--num-requests", "8", "--start", "4", "--results-dir", str(tmp_path),
                 "--no-report"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "no level met the SLO; first failing c=1: ttft_p99=" in out
