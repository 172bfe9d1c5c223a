"""The wheel: one top-level import name, its data inside, usable from anywhere.

A wheel is built from this repository and installed into a new virtual environment outside it, next
to PyPI's ``fixtures`` package (which batchbench's ``fixtures/`` folder must not shadow). The new
environment borrows the heavy dependencies (torch, vLLM, transformers) from the one running the
tests through a ``.pth`` line instead of downloading 2 GB again; batchbench itself comes only from
the wheel (the running environment's editable install is not visible there: a ``.pth`` line adds a
folder, but the ``.pth`` files inside that folder, which install the editable finder, are not run).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def _run(args: list[str], *, cwd: Path, timeout: float = 300, env: dict[str, str] | None = None
         ) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    assert proc.returncode == 0, f"{args} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Built from a copy: setuptools writes build/ and *.egg-info/ into the tree it builds.
    src = tmp_path_factory.mktemp("src") / "batchbench"
    generated = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".hypothesis",
                                       ".pytest_cache", ".benchmarks")

    def ignore(folder: str, names: list[str]) -> set[str]:
        # results/ at the top is run output; batchbench/results/ is the package.
        return set(generated(folder, names)) | ({"results"} if Path(folder) == ROOT else set())

    shutil.copytree(ROOT, src, ignore=ignore)
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(out), str(src)],
         cwd=out, timeout=600)
    (built,) = out.glob("batchbench-*.whl")
    return built


@pytest.fixture(scope="module")
def fresh_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new environment outside the repository with the wheel and PyPI's ``fixtures`` installed."""
    home = tmp_path_factory.mktemp("venv")
    venv.create(home, with_pip=True)
    python = home / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     cwd=home).stdout.strip())
    borrowed = [p for p in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]} if p]
    (site / "borrowed-dependencies.pth").write_text("\n".join(borrowed) + "\n")
    _run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", str(wheel), "fixtures==4.3.2"],
         cwd=home, timeout=600)
    return home


def test_the_wheel_installs_one_top_level_name_with_its_data(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/", 1)[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"batchbench"}
    for data in ("batchbench/adapters/images.toml", "batchbench/fixtures/models/tiny-llama/config.json",
                 "batchbench/fixtures/models/tiny-llama/tokenizer.json",
                 "batchbench/fixtures/models/configs/Llama-3-70B.json", "batchbench/fixtures/accelerators.toml",
                 "batchbench/fixtures/wire/tgi/metrics.prom", "batchbench/reports/__init__.py"):
        assert data in names, f"{data} is not in the wheel"
    # Every package of the checkout is in the wheel (pyproject lists them by hand, one folder mapping each).
    mapped = {"batchbench": "batchbench", "adapters": "batchbench/adapters", "fixtures": "batchbench/fixtures",
              "reports": "batchbench/reports"}
    for folder, inside in mapped.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            packaged = f"{inside}/{init.relative_to(ROOT / folder).as_posix()}"
            assert packaged in names, f"package {init.parent.relative_to(ROOT)} is not in the wheel (pyproject.toml)"
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[pytest11]" in text and "batchbench.pytest_plugin" in text and "batchbench.cli:main" in text


def test_installed_beside_pypis_fixtures_both_import(fresh_venv: Path, tmp_path: Path) -> None:
    code = (
        "import fixtures, batchbench.fixtures, batchbench.adapters.registry as r\n"
        "assert hasattr(fixtures, 'Fixture'), fixtures.__file__  # testing-cabal's fixtures, not ours\n"
        "print(fixtures.__file__); print(batchbench.fixtures.__file__)\n"
        "assert batchbench.fixtures.tiny_model_dir().joinpath('config.json').is_file()\n"
        "from batchbench.adapters.launch.images import load_specs\n"
        "assert set(r.specs()) <= set(load_specs()) | {n for n, s in r.specs().items() if not s.container}\n"
    )
    out = _run([str(fresh_venv / "bin" / "python"), "-c", code], cwd=tmp_path).stdout.splitlines()
    assert all(line.startswith(str(fresh_venv)) for line in out), out


@pytest.mark.engine
def test_the_wheel_runs_the_main_job_from_an_empty_folder(fresh_venv: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # One run of each point and no precision repeats: what is tested is the wheel's main job from an empty
    # folder, not its precision. The time limit leaves room for a machine 4x slower (10 s here); a 15 s limit
    # was all spent on start-up at half speed (tools/slow-machine --share 0.5), leaving nothing measured.
    proc = _run([str(fresh_venv / "bin" / "batchbench"), "run", "--engine", "hf-static", "--repeats", "1",
                 "--max-repeats", "1", "--levels", "1,2", "--time-limit", "60"],
                cwd=tmp_path, env=env, timeout=600)
    assert "hf-static" in proc.stdout
    (run_dir,) = (tmp_path / "results").glob("run-*")
    assert (run_dir / "report" / "report.html").is_file()


def test_a_checkout_that_is_not_installed_says_how_to_fix_it() -> None:
    # -S: no site-packages, so no editable finder; the checkout's batchbench/ is found from the working directory.
    proc = subprocess.run([sys.executable, "-S", "-c", "import batchbench"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 1
    assert "not installed from it in editable mode" in proc.stderr and "./bootstrap.sh" in proc.stderr
