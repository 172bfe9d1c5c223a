"""A model as GGUF, the file llama.cpp serves: converted once by llama.cpp's own converter and cached.

The shipped tiny Llama gets the seeded random weights hf-static and hf-continuous serve
(:func:`batchbench.adapters.launch.weights.write_seeded`), written once as safetensors and converted to f32 GGUF
(bf16 widens to f32 exactly, so llama.cpp computes with the very same weights). A folder of the user's with a
config and safetensors is converted likewise; a ``.gguf`` file is served as it is.

The converter is the one in the sdist llama.cpp's server is built from
(:mod:`batchbench.adapters.launch.llamacpp_build`), run unchanged in a subprocess with one exception: it names a
BPE tokenizer's pre-tokenizer by hashing the ids of a test string, and refuses a hash it does not know.
batchbench's tiny tokenizer is a plain byte-level BPE (tokenizers' ``ByteLevel``, the GPT-2 split regex, no
prefix space), which llama.cpp calls ``gpt-2`` (``src/llama-vocab.cpp``, ``LLAMA_VOCAB_PRE_TYPE_GPT2``; its
``default`` splits digits and punctuation otherwise, and tokenized 7 of 17 test strings differently): where the
hash is unknown, that name is given. Its token ids then round-trip: the same ids as Hugging Face's tokenizer,
checked by ``tests/test_llamacpp.py``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

from batchbench.adapters.launch.llamacpp_build import (
    Say,
    cache_root,
    converter_dir,
    cuda_archs_from_env,
    ensure_server,
    to_stderr,
)
from batchbench.adapters.launch.weights import model_key, write_seeded

#: The pre-tokenizer name given where the converter does not recognise the tokenizer (module docstring).
PRE_TOKENIZER = "gpt-2"


class ConversionError(RuntimeError):
    """The model could not be made into GGUF; the message says why in one line."""


def ensure_gguf(model: Path, *, seeded: bool, say: Say = to_stderr) -> Path:
    """``model`` as GGUF: a ``.gguf`` file as it is; a config folder with ``seeded`` random weights (the shipped
    models) or with its own safetensors, converted once and cached under ``CACHE/models/``."""
    if model.suffix == ".gguf":
        return model
    out = cache_root() / "models" / f"{model.name}-{model_key(model, seeded)}.gguf"
    if out.is_file():
        return out
    if not (converter_dir() / "convert_hf_to_gguf.py").is_file():
        ensure_server(cuda_archs=cuda_archs_from_env(), say=say)  # the converter comes with the build
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gguf-", dir=out.parent) as tmp:
        source = write_seeded(model, Path(tmp) / "hf") if seeded else model
        say(f"batchbench: converting {model.name} to GGUF (once) with llama.cpp's converter")
        done = subprocess.run([sys.executable, "-m", "batchbench.adapters.launch.gguf", str(converter_dir()),
                               str(source), str(Path(tmp) / "model.gguf")], capture_output=True, text=True,
                              check=False)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise ConversionError(f"llama.cpp's converter could not convert {model}: {last}")
        os.replace(Path(tmp) / "model.gguf", out)
    return out


def _convert(converter: Path, source: Path, out: Path) -> None:
    """Run llama.cpp's ``convert_hf_to_gguf.py`` (in this process: the subprocess :func:`ensure_gguf` starts),
    naming the pre-tokenizer it cannot recognise (module docstring)."""
    sys.path[:0] = [str(converter / "gguf-py"), str(converter)]
    from conversion import base  # type: ignore[import-not-found]  # llama.cpp's converter package

    recognise = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self: object, tokenizer: object) -> str:
        try:
            return str(recognise(self, tokenizer))
        except NotImplementedError:
            logging.getLogger("batchbench").warning("unrecognised BPE pre-tokenizer: %r", PRE_TOKENIZER)
            return PRE_TOKENIZER

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    sys.argv = [str(converter / "convert_hf_to_gguf.py"), str(source), "--outfile", str(out), "--outtype", "f32"]
    runpy.run_path(sys.argv[0], run_name="__main__")


def describe(path: Path) -> dict[str, object]:
    """What a results document records of the GGUF served: its file name, size and SHA-256 prefix."""
    digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
    return {"gguf": path.name, "bytes": path.stat().st_size if path.is_file() else None,
            "sha256": digest[:16] if digest else None}


if __name__ == "__main__":
    _convert(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
