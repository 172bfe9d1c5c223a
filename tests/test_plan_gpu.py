"""``batchbench plan --gpu``: the curve on paper, recomputed by hand, its regimes, and its usage errors."""

from __future__ import annotations

import json
from typing import Any

import pytest

from batchbench import cli

GiB = 1 << 30
DONE_WHEN = ["--model", "Llama-3-70B", "--gpu", "H100", "--tp", "2", "--weight-dtype", "fp8", "--prompt-len", "5000",
             "--output-len", "500", "--concurrency", "1,25,100"]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = cli.main(["plan", *argv])
    out, err = capsys.readouterr()
    return status, out, err


def by_hand(batch: int) -> dict[str, float]:
    """The issue's row, from Llama-3-70B's config.json and the H100 SXM datasheet, without batchbench's helpers.

    Matmul parameters a token runs through: 80 layers x (attention 2 x 8192 x 64 x 128 + 2 x 8192 x 8 x 128, MLP
    3 x 8192 x 28672) + the output projection 128256 x 8192. fp8 weights (1 B) over TP 2; bf16 KV, 4 of the 8 KV
    heads per GPU; mean context 5000 + 500 / 2. H100 SXM: 3.35 TB/s, 1,979 TFLOPS fp8 and 989.5 bf16 dense (the
    datasheet's sparsity figures halved), NVLink 450 GB/s per direction."""
    layers, hidden, heads, kv_heads, head_dim, mlp, vocab = 80, 8192, 64, 8, 128, 28672, 128256
    matmul = layers * (2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * mlp)
    matmul += vocab * hidden
    tp, bandwidth, fp8, bf16, link = 2, 3.35e12, 1979e12, 989.5e12, 450e9
    weights = matmul * 1 / tp
    kv_token = 2 * layers * (kv_heads // tp) * head_dim * 2
    context = 5000 + 500 / 2
    memory_s = (weights + batch * context * kv_token) / bandwidth
    compute_s = 2 * matmul * batch / tp / fp8 + batch * context * layers * 2 * heads * 2 * head_dim / tp / bf16
    allreduce_s = 2 * layers * 2 * (tp - 1) / tp * batch * hidden * 2 / link
    tpot = max(memory_s, compute_s) + allreduce_s
    prompt = 5000
    prefill_flops = 2 * ((matmul - vocab * hidden) * prompt + vocab * hidden) / tp / fp8
    prefill_flops += 2 * heads * 2 * head_dim * layers * prompt * (prompt + 1) / 2 / tp / bf16
    prefill_bytes = (weights + prompt * kv_token) / bandwidth
    ttft = max(prefill_flops, prefill_bytes) + 2 * layers * 2 * (tp - 1) / tp * prompt * hidden * 2 / link
    return {"memory_s": memory_s, "compute_s": compute_s, "allreduce_s": allreduce_s, "tpot_s": tpot,
            "output_tok_s": batch / tpot, "ttft_s": ttft}


def test_the_issues_command_recomputed_by_hand(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(capsys, *DONE_WHEN, "--json")
    assert status == 0, err
    doc = json.loads(out)
    assert [row["concurrency"] for row in doc["curve"]] == [1, 25, 100]
    for row in doc["curve"]:
        assert {"concurrency", "tpot_s", "output_tok_s", "ttft_s", "bound"} <= set(row)
    one, mid, over = doc["curve"]
    hand = by_hand(25)
    assert mid["tpot_s"] == pytest.approx(hand["tpot_s"], rel=1e-12)
    assert mid["output_tok_s"] == pytest.approx(hand["output_tok_s"], rel=1e-12)
    assert mid["ttft_s"] == pytest.approx(hand["ttft_s"], rel=1e-12)
    assert mid["bound"] == "bandwidth" and hand["memory_s"] > hand["compute_s"]
    assert (round(mid["tpot_s"] * 1e3, 3), round(mid["output_tok_s"])) == (16.938, 1476)
    assert one["tpot_s"] == pytest.approx(by_hand(1)["tpot_s"], rel=1e-12) and one["bound"] == "bandwidth"
    # KV: 80 GiB x 0.9 - 70,553,706,496 B / 2 of weights = 42,032,558,080 B / 163,840 B = 16,034 blocks of 16;
    # 5000 + 499 tokens take 344 blocks: 46 fit, memory-bound from 47; on average a sequence holds 5,250 tokens,
    # so at most 256,544 // 5,250 = 48 decode at once, and batch 100's bound is batch 48's.
    assert (doc["workload_fit"], doc["memory_bound_from"], doc["resident_sequences"]) == (46, 47, 48)
    assert over["bound"] == "kv" and over["running"] == 48 and not over["fits"]
    assert over["tpot_s"] == pytest.approx(by_hand(48)["tpot_s"], rel=1e-12)
    assert doc["ridge_concurrency"] is None  # 5,250 tokens of KV per sequence outlast its FLOPs
    assert doc["memory_bytes"] == 80 * GiB and doc["gpu"]["name"] == "H100 SXM"
    assert doc["gpu"]["sources"]["bf16_tflops"]["url"].startswith("https://")
    assert {k: doc[k] for k in ("tp", "weight_dtype", "kv_dtype", "prompt_len", "output_len")} == {
        "tp": 2, "weight_dtype": "fp8", "kv_dtype": "bf16", "prompt_len": 5000, "output_len": 500}


def test_the_text_shows_the_arithmetic_of_a_row(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, *DONE_WHEN)
    assert status == 0
    hand = by_hand(25)
    worked = next(line for line in out.splitlines() if line.startswith("batch 25 worked:"))
    assert (f"TPOT >= max({hand['memory_s'] * 1e3:,.3f} ms, {hand['compute_s'] * 1e3:,.3f} ms) + "
            f"{hand['allreduce_s'] * 1e3:,.3f} ms all-reduce = {hand['tpot_s'] * 1e3:,.3f} ms") in worked
    assert "bytes 34,750,857,216 + 25 x 860,160,000 = 56,254,857,216 B" in worked
    assert f"tokens/s <= 25 / {hand['tpot_s'] * 1e3:,.3f} ms = {hand['output_tok_s']:,.1f}" in worked
    assert "memory-bandwidth-bound at every batch" in out and "memory-bound (KV) from 47" in out
    assert "KV reads pass the weight reads from batch 41 (below it batching is nearly free)" in out
    assert "does not fit: 48 decode at once" in out and "must never beat" in out
    # The memory plan comes first, as without --gpu, on the GPU's memory.
    assert "80.00 GiB x 0.9 = 72.00 GiB" in out and "memory-bound from 47 concurrent sequences" in out


def test_a_short_context_has_a_ridge_and_says_where(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "--model", "Llama-3-8B", "--gpu", "H100", "--prompt-len", "100", "--output-len",
                         "100", "--concurrency", "1,1024", "--json")
    doc = json.loads(out)
    ridge = doc["ridge_concurrency"]
    assert status == 0 and ridge is not None and 1 < ridge < 1024
    assert [row["bound"] for row in doc["curve"]] == ["bandwidth", "compute"]
    _, text, _ = run(capsys, "--model", "Llama-3-8B", "--gpu", "H100", "--prompt-len", "100", "--output-len", "100")
    assert f"compute-bound from {ridge:,} (the ridge)" in text


def test_the_gpu_sets_the_memory_unless_it_is_given(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--model", "Llama-3-8B", "--prompt-len", "1000", "--output-len", "100", "--json"]
    _, out, _ = run(capsys, *base, "--gpu", "h200")
    assert json.loads(out)["memory_bytes"] == 141 * GiB
    _, out, _ = run(capsys, *base, "--gpu", "h200", "--memory", "139GiB")
    assert json.loads(out)["memory_bytes"] == 139 * GiB
    _, out, _ = run(capsys, *base)
    plain = json.loads(out)
    assert plain["memory_bytes"] == 80 * GiB and "curve" not in plain and "gpu" not in plain


def test_a_balance_past_the_kv_onset_is_said_to_be_out_of_reach(capsys: pytest.CaptureFixture[str]) -> None:
    """TP 2 in bf16 at 3500+500: 10 sequences fit, so the KV reads never reach the weights' 69.5 GB (at 114)."""
    _, out, _ = run(capsys, "--model", "Llama-3-70B", "--gpu", "H100", "--tp", "2", "--prompt-len", "3500",
                    "--output-len", "500", "--concurrency", "1,16")
    assert "KV reads pass the weight reads from batch 114 (the KV cache runs out first)" in out
    assert "memory-bound (KV) from 11: 10 fit at full length" in out


def test_default_concurrencies(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run(capsys, "--model", "Llama-3-8B", "--gpu", "L40S", "--prompt-len", "1000", "--output-len", "100",
                    "--json")
    assert [row["concurrency"] for row in json.loads(out)["curve"]] == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]


def test_a_mixture_of_experts_says_which_experts_it_reads(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "--model", "DeepSeek-V3", "--gpu", "H200", "--tp", "8", "--weight-dtype", "fp8",
                         "--prompt-len", "1000", "--output-len", "1000", "--concurrency", "1,64")
    assert status == 0 and "8 of 256 a token, uniform routing" in out and "batch 64 worked" in out


def test_nothing_fits_prints_no_figures(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "--model", "Llama-3-70B", "--gpu", "H100", "--prompt-len", "100", "--output-len",
                         "100", "--concurrency", "1")
    assert status == 0 and "nothing is left for the KV cache" in out
    assert "does not fit: 0 decode at once" in out and "worked" not in out


@pytest.mark.parametrize(("argv", "message"), [
    (["--concurrency", "1,2"], "need a --gpu"),
    (["--gpu", "H100"], "--gpu needs --prompt-len and --output-len"),
    (["--gpu", "H100", "--prompt-len", "10", "--output-len", "1"], "at least 2 tokens"),
])
def test_usage_errors_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(capsys, "--model", "Llama-3-8B", *argv)
    assert status == 2 and out == "" and message in err


def test_an_unknown_gpu_lists_the_known_ones(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["plan", "--model", "Llama-3-8B", "--gpu", "V100"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "no GPU named 'V100': one of H100 SXM, H100 PCIe, H200, B200" in err


def test_the_json_is_plain_json(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run(capsys, *DONE_WHEN, "--json")
    doc: dict[str, Any] = json.loads(out)
    assert json.loads(json.dumps(doc)) == doc
