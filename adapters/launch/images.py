"""The container specs: which image, port and settings each containerised engine runs with.

``images.toml`` (package data of :mod:`batchbench.adapters`; ``$BATCHBENCH_IMAGES``
names another file) is the one place image tags are pinned; each of its tables
is one engine's :class:`ContainerSpec`. A spec without an explicit tag, or
pinned to ``latest``, is refused.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any

from batchbench.adapters.launch.secrets import redact_env

DEFAULT_SPECS = Path(str(files("batchbench.adapters").joinpath("images.toml")))


@dataclass(frozen=True)
class ContainerSpec:
    """How one engine's image is run; one table of ``images.toml``."""

    engine: str
    image: str
    port: int
    #: The engine's CPU build, run on a host without a GPU in place of :attr:`image` (None: there is none).
    cpu_image: str | None = None
    #: Put in front of the engine's own arguments (the image's ENTRYPOINT stays).
    program: tuple[str, ...] = ()
    shm_size: str | None = None
    ipc_mode: str | None = None
    ulimits: Mapping[str, int] = field(default_factory=dict)
    hf_home: str = "/root/.cache/huggingface"
    env: Mapping[str, str] = field(default_factory=dict)

    @property
    def port_key(self) -> str:
        return f"{self.port}/tcp"

    def to_dict(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "image": self.image,
            "cpu_image": self.cpu_image,
            "port": self.port,
            "program": list(self.program),
            "shm_size": self.shm_size,
            "ipc_mode": self.ipc_mode,
            "ulimits": dict(self.ulimits),
            "hf_home": self.hf_home,
            "env": redact_env(self.env),
        }


_SPEC_KEYS = {
    "image", "cpu_image", "port", "program", "shm_size", "ipc_mode", "ulimits", "hf_home", "env",
}


def image_problem(image: object) -> str | None:
    """What is wrong with an image reference (None: nothing): it must be a non-empty string with an explicit tag
    (or a digest) that is not ``latest``, so a result always says which build ran."""
    if not isinstance(image, str) or not image:
        return "image must be a non-empty string"
    tail = image.rsplit("/", 1)[-1]
    if ":" not in tail and "@" not in image:
        return f"image {image!r} must carry an explicit tag"
    if tail.endswith(":latest"):
        return f"image {image!r}: pin a version, not 'latest'"
    return None


def _spec_from_table(engine: str, table: Mapping[str, Any], source: Path) -> ContainerSpec:
    where = f"{source} [{engine}]"
    unknown = set(table) - _SPEC_KEYS
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)} (known: {sorted(_SPEC_KEYS)})")
    for key in ("image", "port"):
        if key not in table:
            raise ValueError(f"{where}: missing {key!r}")
    image = table["image"]
    if (problem := image_problem(image)) is not None:
        raise ValueError(f"{where}: {problem}")
    cpu_image = table.get("cpu_image")
    if cpu_image is not None and (problem := image_problem(cpu_image)) is not None:
        raise ValueError(f"{where}: cpu_{problem}")
    port = table["port"]
    if not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"{where}: port must be an integer in 1..65535, not {port!r}")
    program = table.get("program", [])
    if not isinstance(program, list) or not all(isinstance(p, str) for p in program):
        raise ValueError(f"{where}: program must be a list of strings")
    ulimits = table.get("ulimits", {})
    if not isinstance(ulimits, dict) or not all(isinstance(v, int) for v in ulimits.values()):
        raise ValueError(f"{where}: ulimits must be a table of integers")
    env = table.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
        raise ValueError(f"{where}: env must be a table of strings")
    return ContainerSpec(
        engine=engine,
        image=image,
        cpu_image=cpu_image,
        port=port,
        program=tuple(program),
        shm_size=table.get("shm_size") or None,
        ipc_mode=table.get("ipc_mode") or None,
        ulimits=dict(ulimits),
        hf_home=str(table.get("hf_home", "/root/.cache/huggingface")),
        env=dict(env),
    )


def specs_path() -> Path:
    """``$BATCHBENCH_IMAGES``, else the ``images.toml`` shipped with :mod:`batchbench.adapters`."""
    override = os.environ.get("BATCHBENCH_IMAGES")
    return Path(override) if override else DEFAULT_SPECS


def load_specs(path: str | os.PathLike[str] | None = None) -> dict[str, ContainerSpec]:
    """Read the per-engine container specs (:func:`specs_path` by default)."""
    source = Path(path) if path is not None else specs_path()
    with open(source, "rb") as fh:
        doc = tomllib.load(fh)
    specs = {}
    for engine, table in doc.items():
        if not isinstance(table, dict):
            raise TypeError(f"{source}: top-level {engine!r} must be a table")
        specs[engine] = _spec_from_table(engine, table, source)
    return specs
