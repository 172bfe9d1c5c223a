"""Prompt datasets a user brings (``batchbench bench --dataset FILE``), read into a workload.

Two layouts are read:

- **JSONL**, one request a line: ``{"prompt": "text"}`` or ``{"prompt_token_ids": [1, 2, ...]}``,
  optionally with ``"output_len": N``. Blank lines are skipped; any other key is an error, so a typo
  (``"output_length"``) is not silently ignored.
- **ShareGPT JSON**: a list of ``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt",
  "value": ...}, ...]}``. The first human turn is the prompt and the reply that follows it sets the
  output length (its token count). Conversations without a human turn followed by a reply are
  skipped and counted, as ShareGPT dumps hold such entries. On a chat endpoint (``chat``) a
  conversation is sent as its turns instead: every turn up to its last human turn that has a reply, as
  system, user and assistant messages, the output length that reply's token count.

Pure: reading a file and building requests, nothing started. Text becomes token ids through the
``tokenize`` callable the caller gives (the served model's tokenizer), because the workload is token
ids (exact prompt lengths, identical for every engine). Every error names the file and the line (or
the ShareGPT item) it is about.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchbench.workload.requests import FIRST_ORDINARY_TOKEN, Arrival, Lengths, Request, Workload, WorkloadSpec

Tokenize = Callable[[str], Sequence[int]]

_JSONL_KEYS = ("prompt", "prompt_token_ids", "output_len")
_HUMAN = ("human", "user")
_REPLY = ("gpt", "assistant", "chatgpt")
_SYSTEM = ("system",)


class DatasetError(ValueError):
    """A dataset that cannot be used, with the file and line (or item) named."""


@dataclass(frozen=True)
class Entry:
    """One prompt as the file gives it: token ids or text, and an output length or the reply's text."""

    #: Where it is: ``FILE:LINE`` (JSONL) or ``FILE item N`` (ShareGPT), for error messages.
    where: str
    prompt_token_ids: tuple[int, ...] | None = None
    prompt_text: str | None = None
    output_len: int | None = None
    output_text: str | None = None
    #: ShareGPT: the conversation up to its last human turn that has a reply, as (role, text) chat messages, and
    #: that reply: what a chat endpoint is sent (None for JSONL lines).
    turns: tuple[tuple[str, str], ...] | None = None
    last_reply: str | None = None

    @property
    def needs_tokenizer(self) -> bool:
        return self.prompt_text is not None or (self.output_len is None and self.output_text is not None)


@dataclass(frozen=True)
class Dataset:
    """The usable entries of a file, in file order, and how many conversations were skipped."""

    path: Path
    entries: tuple[Entry, ...]
    skipped: int = 0

    @property
    def needs_tokenizer(self) -> bool:
        """Whether any entry is text (then the served model's tokenizer is needed)."""
        return any(e.needs_tokenizer for e in self.entries)


def load(path: Path) -> Dataset:
    """Read ``path`` (JSONL or ShareGPT JSON, told apart by a leading ``[``). Raises DatasetError."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"dataset {path}: cannot read it: {exc}") from None
    dataset = _sharegpt(path, text) if text.lstrip().startswith("[") else _jsonl(path, text)
    if not dataset.entries:
        skipped = f" ({dataset.skipped} conversation(s) without a human turn and a reply)" if dataset.skipped else ""
        raise DatasetError(f"dataset {path}: no prompts in it{skipped}")
    return dataset


def jsonl_objects(path: Path, text: str, *, noun: str, error: type[ValueError],
                  hint: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Each non-blank line of a JSONL file as (``FILE:LINE``, its object); ``error`` naming the line (``noun`` says
    what the file is, ``hint`` what a line should be) for a line that is not a JSON object."""
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise error(f"{noun} {where}: not JSON ({exc.msg}){hint}") from None
        if not isinstance(item, dict):
            raise error(f"{noun} {where}: expected a JSON object, not {type(item).__name__}")
        yield where, item


def _jsonl(path: Path, text: str) -> Dataset:
    entries = []
    hint = '; expected one object a line, e.g. {"prompt": "text"} or {"prompt_token_ids": [1, 2, 3]}'
    for where, item in jsonl_objects(path, text, noun="dataset", error=DatasetError, hint=hint):
        if unknown := sorted(set(item) - set(_JSONL_KEYS)):
            raise DatasetError(f"dataset {where}: unknown key(s) {', '.join(unknown)}; "
                               f"a line has {', '.join(_JSONL_KEYS)}")
        if ("prompt" in item) == ("prompt_token_ids" in item):
            raise DatasetError(f"dataset {where}: give exactly one of prompt (text) and prompt_token_ids")
        entries.append(Entry(
            where,
            prompt_token_ids=_token_ids(where, item["prompt_token_ids"]) if "prompt_token_ids" in item else None,
            prompt_text=_text(where, "prompt", item["prompt"]) if "prompt" in item else None,
            output_len=_positive(where, "output_len", item["output_len"]) if "output_len" in item else None,
        ))
    return Dataset(path, tuple(entries))


def _sharegpt(path: Path, text: str) -> Dataset:
    try:
        items = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DatasetError(f"dataset {path}:{exc.lineno}: not JSON ({exc.msg})") from None
    if not isinstance(items, list):
        raise DatasetError(f"dataset {path}: expected a list of conversations")
    entries, skipped = [], 0
    for index, item in enumerate(items, 1):
        where = f"{path} item {index}"
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
            raise DatasetError(f'dataset {where}: expected {{"conversations": [{{"from": ..., "value": ...}}, ...]}}')
        pair = _first_exchange(where, turns)
        if pair is None:
            skipped += 1
            continue
        turns_, last = _conversation(where, turns)
        entries.append(Entry(where, prompt_text=pair[0], output_text=pair[1], turns=turns_, last_reply=last))
    return Dataset(path, tuple(entries), skipped)


def _conversation(where: str, turns: list[dict[str, Any]]) -> tuple[tuple[tuple[str, str], ...], str]:
    """The turns up to the last human turn followed by a reply, as chat messages, and that reply (the caller made
    sure there is one)."""
    last = max(i for i, (turn, reply) in enumerate(itertools.pairwise(turns))
               if turn.get("from") in _HUMAN and reply.get("from") in _REPLY)
    messages = []
    for turn in turns[:last + 1]:
        speaker = turn.get("from")
        role = "user" if speaker in _HUMAN else "assistant" if speaker in _REPLY else \
            "system" if speaker in _SYSTEM else None
        if role is not None:
            messages.append((role, _text(where, "value", turn.get("value"))))
    return tuple(messages), _text(where, "value", turns[last + 1].get("value"))


def _first_exchange(where: str, turns: list[dict[str, Any]]) -> tuple[str, str] | None:
    """The first human turn and the reply right after it; None when the conversation has no such pair."""
    for turn, reply in itertools.pairwise(turns):
        if turn.get("from") in _HUMAN and reply.get("from") in _REPLY:
            return _text(where, "value", turn.get("value")), _text(where, "value", reply.get("value"))
    return None


def _text(where: str, key: str, value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise DatasetError(f"dataset {where}: {key} must be non-empty text")
    return value


def _positive(where: str, key: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise DatasetError(f"dataset {where}: {key} must be a whole number of at least 1, not {value!r}")
    return value


def _token_ids(where: str, value: object) -> tuple[int, ...]:
    if (not isinstance(value, list) or not value
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)):
        raise DatasetError(f"dataset {where}: prompt_token_ids must be a non-empty list of token ids (integers >= 0)")
    return tuple(value)


def build_workload(
    dataset: Dataset, *, num_requests: int, output: Lengths, override_output: bool = False,
    tokenize: Tokenize | None = None, max_model_len: int | None = None, vocab_size: int | None = None,
    arrival: Arrival | None = None, seed: int = 0, chat: bool = False,
) -> Workload:
    """``num_requests`` requests from the dataset's entries in file order (cycled if there are fewer).

    An entry's output length is its own (``output_len``, or the ShareGPT reply's token count); entries
    without one, or all of them with ``override_output``, draw it from ``output`` (seeded). Raises
    DatasetError naming the line when text needs a tokenizer that was not given, a token id is outside
    the vocabulary, or prompt + output exceeds ``max_model_len``. ``chat``: the requests carry their text as
    chat messages (a ShareGPT conversation as its turns); a line of token ids cannot be one.
    """
    rng = random.Random(f"{seed}:lengths")
    arrival = arrival or Arrival()
    prepared: dict[int, tuple[tuple[int, ...], int | None, tuple[tuple[str, str], ...] | None]] = {}
    requests = []
    stem = dataset.path.stem
    for i in range(num_requests):
        k = i % len(dataset.entries)
        entry = dataset.entries[k]
        if k not in prepared:
            prepared[k] = _prepare_chat(entry, tokenize) if chat else (*_prepare(entry, tokenize, vocab_size), None)
        prompt, own_output, messages = prepared[k]
        drawn = output.draw(rng, i)  # drawn for every request, so the lengths do not depend on the file's
        max_tokens = drawn if override_output or own_output is None else own_output
        if max_model_len is not None and len(prompt) + max_tokens > max_model_len:
            raise DatasetError(f"dataset {entry.where}: prompt ({len(prompt)} tokens) + output ({max_tokens}) "
                               f"exceeds the model's max length {max_model_len}")
        requests.append(Request(f"{stem}-{i:05d}", prompt, max_tokens, messages=messages))
    plens = [r.prompt_len for r in requests]
    olens = [r.max_tokens for r in requests]
    top_id = max(t for r in requests for t in r.prompt_token_ids)
    spec = WorkloadSpec(
        name=f"dataset-{stem}", num_requests=num_requests,
        # What the file's requests span: the spec describes the workload; the requests are the file's.
        prompt=Lengths.uniform(min(plens), max(plens)), output=Lengths.uniform(min(olens), max(olens)),
        arrival=arrival, seed=seed, vocab_size=max(vocab_size or 0, top_id + 1, FIRST_ORDINARY_TOKEN + 1),
    )
    times = arrival.schedule(random.Random(f"{seed}:arrivals"), num_requests)
    return Workload(spec, tuple(Request(r.request_id, r.prompt_token_ids, r.max_tokens, t, messages=r.messages)
                                for r, t in zip(requests, times)))


def _prepare_chat(entry: Entry, tokenize: Tokenize | None) -> tuple[tuple[int, ...], int | None,
                                                                     tuple[tuple[str, str], ...]]:
    """An entry as chat messages: their tokens (each message's text, in order), its own output length, the
    messages."""
    if entry.prompt_text is None:
        raise DatasetError(f"dataset {entry.where}: a chat endpoint takes text, not prompt_token_ids; give the "
                           "prompt as text, or use --endpoint completions")
    if tokenize is None:
        raise DatasetError(f"dataset {entry.where}: text needs the served model's tokenizer (--tokenizer)")
    messages = entry.turns if entry.turns is not None else (("user", entry.prompt_text),)
    prompt = tuple(t for _, text in messages for t in tokenize(text))
    if not prompt:
        raise DatasetError(f"dataset {entry.where}: the prompt tokenizes to no tokens")
    own = entry.output_len
    reply = entry.last_reply if entry.turns is not None else entry.output_text
    if own is None and reply is not None:
        own = max(1, len(tokenize(reply)))
    return prompt, own, messages


def _prepare(entry: Entry, tokenize: Tokenize | None, vocab_size: int | None) -> tuple[tuple[int, ...], int | None]:
    """An entry's prompt token ids and its own output length (None: it has none)."""
    if entry.needs_tokenizer and tokenize is None:
        raise DatasetError(f"dataset {entry.where}: text needs the served model's tokenizer (--tokenizer)")
    prompt = entry.prompt_token_ids
    if prompt is None:
        assert tokenize is not None and entry.prompt_text is not None
        prompt = tuple(tokenize(entry.prompt_text))
        if not prompt:
            raise DatasetError(f"dataset {entry.where}: the prompt tokenizes to no tokens")
    if vocab_size is not None and (bad := [t for t in prompt if t >= vocab_size]):
        raise DatasetError(f"dataset {entry.where}: token id {bad[0]} is outside the model's vocabulary "
                           f"(size {vocab_size})")
    own = entry.output_len
    if own is None and entry.output_text is not None:
        assert tokenize is not None
        own = max(1, len(tokenize(entry.output_text)))
    return prompt, own
