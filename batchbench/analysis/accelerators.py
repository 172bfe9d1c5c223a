"""Accelerators as data: a GPU's memory, bandwidth, dense throughput and link, read from the shipped table.

The figures live in ``fixtures/accelerators.toml`` (:func:`batchbench.fixtures.accelerators_file`), each with the
datasheet it comes from, so a bound can always be traced to the vendor's own number; this module only reads and
checks them. A measured run finds its row by the device name NVML reports (:func:`accelerator_for_device_name`),
a user by a loose name (:func:`find_accelerator`: ``H100`` is the H100 SXM).
"""

from __future__ import annotations

import functools
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchbench.analysis.theory import dtype_bytes
from batchbench.fixtures import accelerators_file

__all__ = ["FIGURES", "Accelerator", "Source", "UnknownAccelerator", "accelerator_for_device_name",
           "accelerators", "find_accelerator", "load_accelerators"]

GiB = 1 << 30
#: The figures every row gives (fp8_tflops may be absent: no fp8 tensor cores), each needing a source.
FIGURES = ("memory_gb", "memory_tb_s", "bf16_tflops", "fp8_tflops", "link_gb_s")
_REQUIRED = ("memory_gb", "memory_tb_s", "bf16_tflops", "link_gb_s")


class UnknownAccelerator(ValueError):
    """A name no row answers to; the message lists the rows, so a usage error can name them."""


@dataclass(frozen=True)
class Source:
    """Where one figure comes from: the document's name, its address, and the figure as the document gives it."""

    document: str
    url: str
    figure: str


@dataclass(frozen=True)
class Accelerator:
    """One row of the table, in the datasheets' units (see the table's header for how each is read)."""

    name: str
    aliases: tuple[str, ...]
    nvml_names: tuple[str, ...]
    memory_gb: float
    memory_tb_s: float
    bf16_tflops: float
    fp8_tflops: float | None
    link_gb_s: float
    link: str
    note: str | None
    sources: Mapping[str, Source]

    @property
    def memory_bytes(self) -> int:
        """The memory as engines size it: vendors' GB of HBM are binary in practice (80 GB is 5 stacks of 16 GiB)."""
        return round(self.memory_gb * GiB)

    @property
    def bandwidth(self) -> float:
        """Peak memory bandwidth in bytes per second."""
        return self.memory_tb_s * 1e12

    @property
    def link_bandwidth(self) -> float:
        """GPU-to-GPU bandwidth per direction in bytes per second."""
        return self.link_gb_s * 1e9

    def peak_flops(self, dtype: str) -> float:
        """Dense peak FLOP/s of matrix work in ``dtype``: the fp8 peak for 1-byte dtypes where the GPU has fp8 tensor
        cores, else the bf16 peak (also for fp32, which no engine serves in, so the bound stays a bound)."""
        fp8 = dtype_bytes(dtype) == 1 and self.fp8_tflops is not None
        return (self.fp8_tflops if fp8 and self.fp8_tflops is not None else self.bf16_tflops) * 1e12

    def to_dict(self) -> dict[str, Any]:
        """The row as JSON, with the byte and FLOP figures the bounds use beside the datasheet's."""
        return {"name": self.name, "nvml_names": list(self.nvml_names), "memory_gb": self.memory_gb,
                "memory_bytes": self.memory_bytes, "memory_tb_s": self.memory_tb_s, "bf16_tflops": self.bf16_tflops,
                "fp8_tflops": self.fp8_tflops, "link_gb_s": self.link_gb_s, "link": self.link, "note": self.note,
                "sources": {k: vars(v) for k, v in self.sources.items()}}


def _key(name: str) -> str:
    """Names compared without case, spaces or punctuation: ``h100-sxm`` is ``H100 SXM``."""
    return re.sub(r"[^0-9a-z]", "", name.casefold())


def _row(raw: Mapping[str, Any], where: str) -> Accelerator:
    for field in ("name", *_REQUIRED):
        if field not in raw:
            raise ValueError(f"{where}: no {field!r}")
    for field in FIGURES:
        value = raw.get(field)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ValueError(f"{where}: {field} must be a number above 0, not {value!r}")
        source = raw.get("sources", {}).get(field)
        if not isinstance(source, Mapping) or not all(source.get(k) for k in ("document", "url", "figure")):
            raise ValueError(f"{where}: {field} has no source with its document, url and figure")
    sources = {k: Source(v["document"], v["url"], v["figure"]) for k, v in raw["sources"].items() if k in FIGURES}
    return Accelerator(
        name=raw["name"], aliases=tuple(raw.get("aliases", ())), nvml_names=tuple(raw.get("nvml_names", ())),
        memory_gb=raw["memory_gb"], memory_tb_s=raw["memory_tb_s"], bf16_tflops=raw["bf16_tflops"],
        fp8_tflops=raw.get("fp8_tflops"), link_gb_s=raw["link_gb_s"], link=raw.get("link", ""),
        note=raw.get("note"), sources=sources)


def load_accelerators(path: Path) -> tuple[Accelerator, ...]:
    """Every row of a table like the shipped one; a ValueError naming the row and the field a row gets wrong, or a
    name two rows answer to."""
    with path.open("rb") as fh:
        rows = tuple(_row(raw, f"{path.name} row {i + 1}") for i, raw in enumerate(tomllib.load(fh)["accelerator"]))
    seen: dict[str, str] = {}
    for row in rows:
        for name in {_key(n) for n in (row.name, *row.aliases, *row.nvml_names)}:
            if seen.setdefault(name, row.name) != row.name:
                raise ValueError(f"{path.name}: {name!r} names both {seen[name]} and {row.name}")
    return rows


@functools.cache
def accelerators() -> tuple[Accelerator, ...]:
    """The shipped table (read once)."""
    return load_accelerators(accelerators_file())


def find_accelerator(name: str) -> Accelerator:
    """The row a user means by ``name``: its name, an alias or an NVML name, ignoring case, spaces and hyphens
    (``H100`` is the H100 SXM); an :class:`UnknownAccelerator` listing the rows otherwise."""
    wanted = _key(name)
    for row in accelerators():
        if wanted in {_key(n) for n in (row.name, *row.aliases, *row.nvml_names)}:
            return row
    raise UnknownAccelerator(f"no GPU named {name!r}: one of {', '.join(r.name for r in accelerators())}")


def accelerator_for_device_name(name: str) -> Accelerator | None:
    """The row of a device NVML (or amd-smi) names, e.g. ``NVIDIA H100 80GB HBM3``; None for a device not in the
    table. Only the names a row lists match, so an H200 NVL is never taken for an H200 SXM."""
    wanted = " ".join(name.split()).casefold()
    for row in accelerators():
        if wanted in {n.casefold() for n in row.nvml_names}:
            return row
    return None
