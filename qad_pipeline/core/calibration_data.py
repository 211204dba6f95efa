"""Calibration and held-out eval data: what the calibration stage (`tasks/calibration.py`) writes.

Reads the text source through `datasets` (a folder of .txt files, one document each; a .txt,
.json or .jsonl file; or any Hugging Face dataset id), splits the documents once, by a seeded
shuffle, into a calibration part and a held-out eval part that never share a document, and writes:

    <out>/calibration/     datasets folder: `num_samples` rows of `seq_len` token ids
    <out>/eval/ppl/        datasets folder: held-out token windows for perplexity and KL
    <out>/eval/<task>.jsonl  the project's lm-eval tasks, built from held-out text
    <out>/manifest.json    source, document split, counts and content fingerprints

A hub dataset is streamed at `calibration.revision` and read only until its documents hold
HUB_MARGIN times the tokens the calibration samples and the eval windows need, whatever the
dataset's size (`TokenBudget`); how many were read is the manifest's `documents`, which QAD reads
again.

QAD reads its training documents with the same readers, PTQ and evaluation read the stage's
output back (`load_calibration`, `load_ppl_windows`). Everything is deterministic given the seed, so the fingerprints change only when the data does.
`prepare_calibration` does all of it but the writing; the preflight (`check_calibration`) runs it
on local sources before any stage starts, so a missing source, too few documents or samples, or
undecodable text is refused up front. Decoding policy: local text must be UTF-8; a file that is not
is refused with its name and the offset of the first bad byte (nothing is replaced or skipped).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np

from qad_pipeline.core.config import CalibrationParams, ConfigError, EvalParams, Params, looks_local, resolve

CONTEXT_WORDS = 40
HUB_MARGIN = 1.5  # a streamed hub dataset is read until it holds this many times the tokens asked for


def check_utf8(files: list[str], what: str = "calibration.source") -> None:
    """Every file decodes as UTF-8; the first that does not is named with the offset of its bad byte."""
    for name in files:
        data = Path(name).read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ConfigError(
                f"{what} file {name}: byte {err.start} (0x{data[err.start]:02x}) is not UTF-8 ({err.reason}); "
                "the text must be UTF-8 (convert it, e.g. iconv -f latin1 -t utf-8)"
            ) from None


class TokenBudget:
    """Says when the documents read so far hold, for each (need, fraction), HUB_MARGIN x `need`
    tokens (counted with `tokenizer`) in the share `fraction` of them that a seeded split gives the
    part that needs them, and are enough documents for that share to hold ten on average."""

    def __init__(self, tokenizer, needs: list[tuple[int, float]]):
        self.tokenizer, self.needs, self.tokens, self.docs = tokenizer, needs, 0, 0
        self.min_docs = max(2, math.ceil(10 / min(fraction for _, fraction in needs)))

    def __call__(self, doc: str) -> bool:
        self.tokens += len(self.tokenizer(doc, add_special_tokens=False)["input_ids"]) + 1
        self.docs += 1
        return self.docs >= self.min_docs and all(self.tokens * f >= need * HUB_MARGIN for need, f in self.needs)


def _streamed(params: CalibrationParams, field: str, enough: Callable[[str], bool] | None, limit: int | None
              ) -> list[str]:
    """A hub dataset's documents, streamed at `params.revision`, until `enough` or `limit` says stop."""
    stream = datasets.load_dataset(params.source, params.dataset_config, split=params.split,
                                   revision=params.revision, streaming=True)
    docs: list[str] = []
    for row in stream:
        if field not in row:
            raise ConfigError(f"calibration.text_field {field!r} is not a column of {params.source!r}: {list(row)}")
        text = (row[field] or "").strip()
        if not text:
            continue
        docs.append(text)
        if len(docs) == limit or (enough is not None and enough(text)):
            break
    return docs


def read_documents(params: CalibrationParams, enough: Callable[[str], bool] | None = None,
                   limit: int | None = None) -> list[str]:
    """The source's documents, in a stable order, empty ones dropped. A hub dataset is streamed and
    read only until `enough` (told each document in turn) says so, or `limit` documents."""
    local = resolve(params.source)
    if local.is_dir():
        files = sorted(str(p) for p in local.rglob("*.txt"))
        if not files:
            raise ConfigError(f"calibration.source {params.source!r} holds no .txt files")
        check_utf8(files)
        ds = datasets.load_dataset("text", data_files=files, sample_by="document", split="train")
        field = "text"
    elif local.is_file():
        check_utf8([str(local)])
        if local.suffix in (".json", ".jsonl"):
            ds, field = datasets.load_dataset("json", data_files=str(local), split="train"), params.text_field
        else:
            ds = datasets.load_dataset("text", data_files=str(local), sample_by="paragraph", split="train")
            field = "text"
    elif looks_local(params.source):
        raise ConfigError(f"calibration.source {params.source!r} does not exist (a local path or a hub dataset id)")
    else:
        ds, field = None, params.text_field
    if ds is None:
        docs = _streamed(params, field, enough, limit)
    elif field not in ds.column_names:
        raise ConfigError(f"calibration.text_field {field!r} is not a column of {params.source!r}: {ds.column_names}")
    else:
        docs = [t.strip() for t in ds[field] if t and t.strip()][:limit]
    if len(docs) < 2:
        raise ConfigError(
            f"calibration.source {params.source!r} has {len(docs)} non-empty document(s); "
            "at least 2 are needed to hold one out for eval"
        )
    return docs


def split_documents(n_docs: int, eval_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Indices of the calibration and eval documents: disjoint, both non-empty, seeded."""
    order = list(range(n_docs))
    random.Random(seed).shuffle(order)
    n_eval = min(max(1, round(n_docs * eval_fraction)), n_docs - 1)
    return sorted(order[n_eval:]), sorted(order[:n_eval])


def leading_special_tokens(tokenizer) -> list[int]:
    """The tokens the tokenizer puts before any text (Llama 3's, Gemma's and Mistral's BOS; none for
    GPT-2-style tokenizers): what the model saw first in every sequence it was trained on."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a")["input_ids"]
    start = next((i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain), 0)
    return list(full[:start])


def token_windows(docs: list[str], tokenizer, seq_len: int) -> np.ndarray:
    """Concatenate the documents (EOS between them) and cut non-overlapping windows of seq_len, each
    starting with the tokenizer's leading special tokens (a Gemma model without its BOS at position 0
    is far off its trained distribution, and its calibration, KL and QAD would measure that)."""
    ids: list[int] = []
    for doc in docs:
        ids.extend(tokenizer(doc, add_special_tokens=False)["input_ids"])
        if tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
    lead = leading_special_tokens(tokenizer)
    body = seq_len - len(lead)
    n = len(ids) // body
    windows = np.asarray(ids[: n * body], dtype=np.int64).reshape(n, body)
    return np.concatenate([np.tile(np.asarray(lead, dtype=np.int64), (n, 1)), windows], axis=1)


def sample_windows(windows: np.ndarray, count: int, seed: int, what: str) -> np.ndarray:
    if len(windows) < count:
        raise ConfigError(
            f"{what}: the text yields {len(windows)} samples of {windows.shape[1] if windows.ndim == 2 else '?'} "
            f"tokens, fewer than the {count} asked; lower the count or the sequence length, or add text"
        )
    pick = np.sort(np.random.default_rng(seed).choice(len(windows), size=count, replace=False))
    return windows[pick]


def cloze_items(docs: list[str], count: int, seed: int) -> list[dict]:
    """Next-word cloze: after a passage of CONTEXT_WORDS words, predict the word that follows."""
    items = []
    for d, doc in enumerate(docs):
        words = " ".join(doc.split()).split(" ")
        for i in range(CONTEXT_WORDS, len(words)):
            if words[i].isalpha():
                items.append({"doc": d, "context": " ".join(words[i - CONTEXT_WORDS : i]), "target": words[i]})
    return _take(items, count, seed, "cloze")


def continuation_items(docs: list[str], count: int, seed: int, n_choices: int = 4, span: int = 6) -> list[dict]:
    """Multiple-choice continuation: after a passage, pick the true next `span` words among
    versions of them with two neighbouring words swapped (a minimal-pair test of word order)."""
    rng = random.Random(seed)
    items = []
    for d, doc in enumerate(docs):
        words = " ".join(doc.split()).split(" ")
        for i in range(CONTEXT_WORDS, len(words) - span, span):
            gold = words[i : i + span]
            swaps = [j for j in range(span - 1) if gold[j] != gold[j + 1]]
            if len(swaps) < n_choices - 1:
                continue
            distractors = []
            for j in rng.sample(swaps, n_choices - 1):
                swapped = gold[:j] + [gold[j + 1], gold[j]] + gold[j + 2 :]
                distractors.append(" ".join(swapped))
            label = rng.randrange(n_choices)
            choices = distractors[:label] + [" ".join(gold)] + distractors[label:]
            items.append({"doc": d, "context": " ".join(words[i - CONTEXT_WORDS : i]), "choices": choices, "label": label})
    return _take(items, count, seed, "continuation")


def _take(items: list[dict], count: int, seed: int, what: str) -> list[dict]:
    if not items:
        raise ConfigError(f"the held-out eval documents yield no {what} items; give more eval text")
    if len(items) > count:
        items = random.Random(seed).sample(items, count)
    return items


def write_jsonl(path: Path, rows: list[dict]) -> bytes:
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()
    path.write_bytes(data)
    return data


@dataclass(frozen=True)
class CalibrationData:
    """What the calibration stage writes, in memory."""

    documents: int
    calib_idx: list[int]
    eval_idx: list[int]
    calib: np.ndarray
    ppl: np.ndarray
    cloze: list[dict]
    cont: list[dict]


def prepare_calibration(params: Params, tokenizer) -> CalibrationData:
    """Documents -> calibration samples + held-out eval data, nothing written."""
    cal: CalibrationParams = params.calibration
    ev: EvalParams = params.eval
    enough = None
    if not looks_local(cal.source):  # a hub dataset: stream it until the calibration and eval parts have enough
        enough = TokenBudget(tokenizer, [(cal.num_samples * cal.seq_len, 1 - cal.eval_fraction),
                                         (ev.ppl_samples * ev.seq_len, cal.eval_fraction)])
    docs = read_documents(cal, enough)
    calib_idx, eval_idx = split_documents(len(docs), cal.eval_fraction, cal.seed)
    calib_docs = [docs[i] for i in calib_idx]
    eval_docs = [docs[i] for i in eval_idx]

    calib = sample_windows(
        token_windows(calib_docs, tokenizer, cal.seq_len), cal.num_samples, cal.seed,
        f"calibration set ({len(calib_docs)} documents)",
    )
    ppl_windows = token_windows(eval_docs, tokenizer, ev.seq_len)
    ppl = ppl_windows[: ev.ppl_samples]
    if len(ppl) == 0:
        raise ConfigError(f"the held-out eval documents are shorter than eval.seq_len = {ev.seq_len} tokens")
    cloze = cloze_items(eval_docs, ev.num_cloze, cal.seed)
    cont = continuation_items(eval_docs, ev.num_continuation, cal.seed)
    return CalibrationData(len(docs), calib_idx, eval_idx, calib, ppl, cloze, cont)


def check_calibration(params: Params, tokenizer) -> None:
    """Preflight: a local calibration source (and a local qad.source) yields what the stages need.

    Hub dataset ids are left to the calibration stage: checking them would mean downloading them.
    """
    if looks_local(params.calibration.source):
        prepare_calibration(params, tokenizer)
    if params.qad.source is not None and looks_local(params.qad.source):
        read_documents(params.calibration.model_copy(update={"source": params.qad.source}))


def load_calibration(data_dir: Path) -> np.ndarray:
    return np.asarray(datasets.load_from_disk(str(Path(data_dir) / "calibration"))["input_ids"], dtype=np.int64)


def load_ppl_windows(data_dir: Path) -> np.ndarray:
    return np.asarray(datasets.load_from_disk(str(Path(data_dir) / "eval" / "ppl"))["input_ids"], dtype=np.int64)


