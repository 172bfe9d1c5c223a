"""The shipped models' seeded random weights on disk, for servers that load a model folder themselves.

hf-static and hf-continuous build the weights in process (:func:`batchbench.adapters.hf_server.build_model`, seed
0, bf16); llama.cpp's converter and ``transformers serve`` read a folder instead. Here those same weights are written
once as safetensors beside the model's config and tokenizer, so every such server computes with identical weights.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from batchbench.adapters.launch.llamacpp_build import cache_root
from batchbench.fixtures import chat_template, has_chat_template

#: The seed and dtype of the weights the HF engines build (:class:`batchbench.adapters.hf_engine.HFEngine`).
SEED, DTYPE = 0, "bfloat16"


def model_key(model: Path, seeded: bool) -> str:
    """What a model made from ``model`` depends on: its config and tokenizer (and, for a seeded model, the seed and
    dtype; else the weights files' names, sizes and times)."""
    digest = hashlib.sha256()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        path = model / name
        digest.update(path.read_bytes() if path.is_file() else b"-")
    if seeded:
        digest.update(f"seed={SEED} dtype={DTYPE}".encode())
    else:
        for path in sorted(model.glob("*.safetensors")):
            stat = path.stat()
            digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:12]


def write_seeded(model: Path, into: Path) -> Path:
    """The model's config with the HF engines' seeded random weights, written as safetensors beside its tokenizer."""
    from batchbench.adapters.hf_server import build_model

    built, _ = build_model(model, seed=SEED, dtype=DTYPE, threads=None, device="cpu")
    built.save_pretrained(into, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (model / name).is_file():
            shutil.copy2(model / name, into / name)
    return into


def seeded_folder(model: Path) -> Path:
    """``model`` with its seeded weights and a chat template (batchbench's minimal one where its tokenizer has
    none), written once under ``CACHE/models/``: a folder any server loads as it would a downloaded model."""
    out = cache_root() / "models" / f"{model.name}-{model_key(model, seeded=True)}"
    if (out / "model.safetensors").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="weights-", dir=out.parent) as tmp:
        made = write_seeded(model, Path(tmp) / "model")
        if not has_chat_template(str(model)):
            shutil.copy2(chat_template(), made / "chat_template.jinja")
        shutil.rmtree(out, ignore_errors=True)
        os.replace(made, out)
    return out

