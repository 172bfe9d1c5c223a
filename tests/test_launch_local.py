"""LocalProcess: a server in its own process group, stopped whole, and never left running by a killed run.

The "server" is a small Python program that, like vLLM, forks a child of its
own: stopping only the leader would leave the child running.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from batchbench.adapters.launch.cleanup import CleanupRegistry
from batchbench.adapters.launch.local import LocalProcess
from batchbench.core.placement import MAX_CPU, EngineCpus, usable_cpus
from tests.signal_state import stoppable, stuck

#: Prints its options file (if any), starts a child in its group, names it, and sleeps.
SERVER = textwrap.dedent("""
    import os, subprocess, sys, time
    if os.path.exists("options.yaml"):
        print("options:", open("options.yaml").read(), flush=True)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print("child", child.pid, flush=True)
    time.sleep(600)
""")

#: The same, but it ignores SIGTERM (a server stuck shutting down).
STUBBORN = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('child 0', flush=True)\n" \
           "time.sleep(600)\n"


def argv_for(host: str, port: int) -> list[str]:
    return ["--host", host, "--port", str(port)]


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for a parent that is not us does not)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # pragma: no cover - no /proc
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def gone(*pids: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while any(alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def child_pid(log: Path, timeout: float = 20.0) -> int:
    """The server's own child, once the server has started it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines() if log.exists() else ():
            if line.startswith("child "):
                return int(line.split()[1])
        time.sleep(0.05)
    raise AssertionError(f"the server did not start its child: {log.read_text() if log.exists() else '(no log)'}")


async def test_stop_ends_the_whole_group_and_removes_the_working_directory(
    registry: CleanupRegistry, tmp_path: Path
) -> None:
    launch = LocalProcess([sys.executable, "-c", SERVER], log_dir=tmp_path, registry=registry)
    assert launch.dead() == "never started"
    url = await launch.start(argv_for, {}, files={"options.yaml": "max_num_seqs: 8"})
    assert url.startswith("http://127.0.0.1:") and launch.argv[-2:] == ["--port", url.rsplit(":", 1)[1]]
    workdir = launch.workdir
    assert workdir is not None and workdir.is_dir() and (workdir / "options.yaml").is_file()
    child = await asyncio.to_thread(child_pid, launch.log_path)
    assert launch.dead() is None and alive(launch.pid) and alive(child)
    assert len(registry) == 1

    await launch.stop()
    assert gone(launch.pid, child)
    assert launch.dead() == "killed by SIGTERM"
    assert not workdir.exists()
    assert len(registry) == 0
    assert "options: max_num_seqs: 8" in await launch.logs()  # the log outlives the server
    await launch.stop()  # twice is fine


async def test_the_working_directory_goes_when_the_server_exited_by_itself(
    registry: CleanupRegistry, tmp_path: Path
) -> None:
    launch = LocalProcess([sys.executable, "-c", "import sys; sys.exit(3)"], log_dir=tmp_path, registry=registry)
    await launch.start(argv_for, {})
    workdir = launch.workdir
    assert workdir is not None and workdir.is_dir()
    while launch.dead() is None:
        await asyncio.sleep(0.02)
    assert launch.dead() == "exit status 3"
    await launch.stop()
    assert not workdir.exists() and len(registry) == 0


async def test_restart_refuses_a_running_server_and_cleans_up_an_exited_one(
    registry: CleanupRegistry, tmp_path: Path
) -> None:
    launch = LocalProcess([sys.executable, "-c", "import sys; sys.exit(1)"], log_dir=tmp_path, registry=registry)
    await launch.start(argv_for, {})
    first = launch.workdir
    while launch.dead() is None:
        await asyncio.sleep(0.02)
    launch.program = [sys.executable, "-c", "import time; time.sleep(600)"]
    await launch.start(argv_for, {})  # the same launch runs the next batching config
    assert first is not None and not first.exists() and launch.workdir.is_dir()
    assert launch.dead() is None and len(registry) == 1
    with pytest.raises(RuntimeError, match="already running"):
        await launch.start(argv_for, {})
    await launch.stop()
    assert launch.dead() == "killed by SIGTERM" and len(registry) == 0


async def test_a_server_ignoring_sigterm_is_killed_after_the_grace_period(
    registry: CleanupRegistry, tmp_path: Path
) -> None:
    launch = LocalProcess([sys.executable, "-c", STUBBORN], log_dir=tmp_path, stop_timeout=0.5, registry=registry)
    await launch.start(argv_for, {})
    await asyncio.to_thread(child_pid, launch.log_path)  # SIGTERM is ignored from here on
    t0 = time.monotonic()
    await launch.stop()
    assert launch.dead() == "killed by SIGKILL" and time.monotonic() - t0 < 5


async def test_the_registry_teardown_stops_the_group(registry: CleanupRegistry, tmp_path: Path) -> None:
    launch = LocalProcess([sys.executable, "-c", SERVER], log_dir=tmp_path, registry=registry)
    await launch.start(argv_for, {})
    child = await asyncio.to_thread(child_pid, launch.log_path)
    workdir = launch.workdir
    (name,) = registry.teardown()  # what atexit and the signal handlers do
    assert str(launch.pid) in name
    assert gone(launch.pid, child) and not workdir.exists()
    await launch.stop()  # nothing left to do


# --------------------------------------------------- CPUs

needs_two_cpus = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(usable_cpus()) < 2,
                                    reason="needs CPU affinity and two usable CPUs")


def cpus_allowed(pid: int) -> str:
    """What the kernel lets ``pid`` run on, as /proc writes it (``1``, ``0-1``)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("Cpus_allowed_list:"):
                return line.split(":", 1)[1].strip()
    raise AssertionError(f"no Cpus_allowed_list for {pid}")


@needs_two_cpus
async def test_the_server_and_what_it_forks_run_on_the_engine_cpus(registry: CleanupRegistry, tmp_path: Path) -> None:
    engine = max(usable_cpus())
    launch = LocalProcess([sys.executable, "-c", SERVER], log_dir=tmp_path, cpus=frozenset({engine}),
                          registry=registry)
    await launch.start(argv_for, {})
    try:
        child = await asyncio.to_thread(child_pid, launch.log_path)
        assert cpus_allowed(launch.pid) == cpus_allowed(child) == str(engine)
        assert os.sched_getaffinity(launch.pid) == {engine}
        assert launch.placement() == EngineCpus("local process", frozenset({engine}))
        assert launch.describe()["cpus"] == str(engine)
    finally:
        await launch.stop()


@needs_two_cpus
async def test_without_cpus_a_server_gets_every_cpu_back_from_a_pinned_thread(registry: CleanupRegistry,
                                                                             tmp_path: Path) -> None:
    """The harness's loop thread is pinned to the client's CPU: a server it launches must not inherit that."""
    launch = LocalProcess([sys.executable, "-c", SERVER], log_dir=tmp_path, registry=registry)

    def start_pinned() -> None:
        os.sched_setaffinity(0, {min(usable_cpus())})  # this worker thread only
        asyncio.run(launch.start(argv_for, {}))

    await asyncio.to_thread(start_pinned)
    try:
        assert os.sched_getaffinity(launch.pid) == usable_cpus()
        assert launch.placement() == EngineCpus("local process", usable_cpus())
    finally:
        await launch.stop()


async def test_cpus_the_os_refuses_are_logged_and_read_back(registry: CleanupRegistry, tmp_path: Path) -> None:
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no CPU affinity on this OS")
    beyond = frozenset({MAX_CPU - 1})  # no machine has it: sched_setaffinity raises EINVAL in the child
    launch = LocalProcess([sys.executable, "-c", SERVER], log_dir=tmp_path, cpus=beyond, registry=registry)
    await launch.start(argv_for, {})
    try:
        await asyncio.to_thread(child_pid, launch.log_path)
        placed = launch.placement()
        assert placed.cpus == os.sched_getaffinity(launch.pid) and placed.refused is not None
        assert f"not {MAX_CPU - 1} as placed" in placed.refused
        assert "batchbench: the OS refused CPU affinity" in await launch.logs()
    finally:
        await launch.stop()


# --------------------------------------------------- a killed harness process

#: A harness in miniature: starts a server with LocalProcess (the process-wide registry), then waits.
HARNESS = textwrap.dedent("""
    import asyncio, faulthandler, signal, sys
    from pathlib import Path
    from batchbench.adapters.launch.local import LocalProcess
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # where it is stuck, should it not stop

    async def main():
        launch = LocalProcess([sys.executable, "-c", sys.argv[1]], log_dir=Path(sys.argv[2]))
        await launch.start(lambda host, port: ["--port", str(port)], {})
        print(launch.pid, launch.workdir, launch.log_path, flush=True)
        await asyncio.sleep(600)

    asyncio.run(main())
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=lambda s: s.name)
def test_a_signalled_parent_leaves_no_server_running(tmp_path: Path, sig: signal.Signals) -> None:
    parent = subprocess.Popen([sys.executable, "-c", HARNESS, SERVER, str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, preexec_fn=stoppable)
    server = child = None
    try:
        assert parent.stdout is not None
        line = parent.stdout.readline()
        assert line, parent.communicate(timeout=10)[1]
        pid, workdir, log = line.split()
        server = int(pid)
        child = child_pid(Path(log))
        assert alive(server) and alive(child) and Path(workdir).is_dir()

        parent.send_signal(sig)
        try:
            _, err = parent.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            state = stuck(parent)
            parent.kill()
            pytest.fail(f"no exit 20 s after {sig.name}:\n{state}\n{parent.communicate()[1]}")

        if sig == signal.SIGINT:
            # Python's own behaviour: KeyboardInterrupt, and a process that dies of SIGINT.
            assert "KeyboardInterrupt" in err
            assert parent.returncode in (-sig, 128 + sig, 1), err
        else:
            assert parent.returncode in (-sig, 128 + sig), err
        assert f"{sig.name}: stopped local server" in err
        assert gone(server, child), "the server's process group outlived the harness"
        assert not Path(workdir).exists()
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        for pid in (server, child):
            if pid is not None and alive(pid):
                os.kill(pid, signal.SIGKILL)
