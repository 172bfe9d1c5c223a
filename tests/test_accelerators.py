"""The accelerators table: every figure sourced, dense not sparse, NVML names and loose names to rows."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from batchbench.analysis.accelerators import (
    FIGURES,
    Accelerator,
    UnknownAccelerator,
    accelerator_for_device_name,
    accelerators,
    find_accelerator,
    load_accelerators,
)
from batchbench.fixtures import accelerators_file

GiB = 1 << 30


def test_the_table_has_the_gpus_the_issue_names() -> None:
    assert {a.name for a in accelerators()} >= {"H100 SXM", "H100 PCIe", "H200", "B200", "A100 80GB SXM", "L40S",
                                                  "MI300X"}


@pytest.mark.parametrize("row", accelerators(), ids=lambda a: a.name)
def test_every_figure_names_its_datasheet(row: Accelerator) -> None:
    given = {f for f in FIGURES if getattr(row, f) is not None}
    assert set(row.sources) == given
    for source in row.sources.values():
        assert source.url.startswith("https://") and source.document and source.figure


@pytest.mark.parametrize("row", accelerators(), ids=lambda a: a.name)
def test_a_sparsity_figure_is_halved_and_says_so(row: Accelerator) -> None:
    """A throughput the datasheet gives only 'with sparsity' is half that figure here (per GPU: HGX tables are for 8),
    and its source says it was halved; one given dense too is taken as the dense figure."""
    for field in ("bf16_tflops", "fp8_tflops"):
        source, value = row.sources.get(field), getattr(row, field)
        if source is None or "sparsity" not in source.figure:
            continue
        if "halved to dense" not in source.figure:
            assert "dense" in source.figure, (row.name, field)
            continue
        printed = [float(n.replace(",", "")) for n in re.findall(r"\d[\d,]*(?:\.\d+)?", source.figure)]
        per_gpu = [n * 1000 / 8 if "PFLOPS" in source.figure else n for n in printed]
        assert any(n == pytest.approx(2 * value) for n in per_gpu), (row.name, field, printed)


def test_dense_peaks_are_the_known_dense_figures() -> None:
    """Cross-checks against the dense figures NVIDIA's Hopper whitepaper and AMD's footnote MI300-17 print."""
    h100 = find_accelerator("H100")
    assert h100.bf16_tflops == pytest.approx(989.4, abs=0.2) and h100.fp8_tflops == pytest.approx(1978.9, abs=0.2)
    assert find_accelerator("MI300X").bf16_tflops == 1307.4
    assert find_accelerator("A100").fp8_tflops is None


@pytest.mark.parametrize(("nvml", "row"), [
    ("NVIDIA H100 80GB HBM3", "H100 SXM"), ("NVIDIA H100 PCIe", "H100 PCIe"), ("NVIDIA H200", "H200"),
    ("NVIDIA B200", "B200"), ("NVIDIA A100-SXM4-80GB", "A100 80GB SXM"), ("NVIDIA L40S", "L40S"),
    ("AMD Instinct MI300X", "MI300X"), ("  nvidia   h200 ", "H200"),
])
def test_nvml_names_map_to_their_row(nvml: str, row: str) -> None:
    found = accelerator_for_device_name(nvml)
    assert found is not None and found.name == row


@pytest.mark.parametrize("nvml", ["NVIDIA H200 NVL", "NVIDIA H100 NVL", "NVIDIA A100-SXM4-40GB", "Tesla V100", ""])
def test_a_device_not_in_the_table_has_no_row(nvml: str) -> None:
    assert accelerator_for_device_name(nvml) is None


@pytest.mark.parametrize(("loose", "row"), [("H100", "H100 SXM"), ("h100-sxm", "H100 SXM"), ("H100 PCIe", "H100 PCIe"),
                                             ("a100", "A100 80GB SXM"), ("mi300x", "MI300X"), ("l40s", "L40S")])
def test_loose_names_find_their_row(loose: str, row: str) -> None:
    assert find_accelerator(loose).name == row


def test_an_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(UnknownAccelerator, match="no GPU named 'V100': one of H100 SXM, H100 PCIe, H200"):
        find_accelerator("V100")


def test_units_the_bounds_use() -> None:
    h100 = find_accelerator("H100")
    assert h100.memory_bytes == 80 * GiB  # batchbench plan's long-standing default for one H100
    assert h100.bandwidth == 3.35e12 and h100.link_bandwidth == 450e9
    assert h100.peak_flops("fp8") == 1979e12 and h100.peak_flops("bf16") == h100.peak_flops("fp32") == 989.5e12
    a100 = find_accelerator("A100")
    assert a100.peak_flops("fp8_e4m3") == a100.peak_flops("bf16") == 312e12  # no fp8 tensor cores


def test_the_shipped_file_is_the_one_found() -> None:
    assert load_accelerators(accelerators_file()) == accelerators()


@pytest.mark.parametrize(("change", "message"), [
    ('memory_tb_s = 3.35', "row 1: no 'memory_tb_s'"),
    ('bf16_tflops = 989.5', "bf16_tflops must be a number above 0"),
    ('memory_gb = { document', "memory_gb has no source"),
])
def test_a_bad_row_is_refused_by_name(tmp_path: Path, change: str, message: str) -> None:
    text = accelerators_file().read_text()
    broken = {"memory_tb_s = 3.35": ("memory_tb_s = 3.35\n", ""),
              "bf16_tflops = 989.5": ("bf16_tflops = 989.5\n", "bf16_tflops = -1\n"),
              "memory_gb = { document": ("memory_gb = { document", "unsourced = { document")}[change]
    path = tmp_path / "accelerators.toml"
    path.write_text(text.replace(*broken, 1))
    with pytest.raises(ValueError, match=message):
        load_accelerators(path)


def test_a_name_two_rows_answer_to_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "accelerators.toml"
    path.write_text(accelerators_file().read_text().replace('aliases = ["H200 SXM"]', 'aliases = ["H100"]'))
    with pytest.raises(ValueError, match="'h100' names both H100 SXM and H200"):
        load_accelerators(path)
