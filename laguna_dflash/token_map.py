"""``laguna-dflash token-map``: count a corpus with the target's tokenizer and write the token
map of its most frequent tokens (models/draft_vocab.py; SGLang's ``--speculative-token-map``).

The drafter then drafts among those ids only; the output stays the target's (the verify reads
the whole vocabulary). The share of the corpus's tokens that the map holds, its *coverage*, is
the best guide to how much acceptance the smaller draft vocabulary costs on text like it.

Corpus paths (``--data``): a directory is every file under it matching ``--glob``, sorted; a
``.jsonl`` file is one record per line and a ``.json`` file one record or a list of them, each a
string or an object with ``"text"``, ``"prompt"`` / ``"completion"`` or ``"messages"``; any other
file is UTF-8 text (a file that does not decode is skipped with a warning).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from tqdm import tqdm

from .models.config_utils import eos_ids, with_generation_eos_ids
from .models.draft_vocab import most_frequent_tokens, save_token_map

logger = logging.getLogger(__name__)

__all__ = ["TOKEN_MAP_SUFFIXES", "CorpusStats", "TokenMapSummary", "build_token_map",
           "corpus_files", "count_tokens", "counting_tokenizer", "file_texts", "iter_texts", "model_vocab",
           "record_text", "token_coverage"]

#: the token map file formats ``save_token_map`` writes (SGLang's .pt, a JSON list)
TOKEN_MAP_SUFFIXES = (".pt", ".json")
#: files whose records are JSON (one a line for .jsonl; one or a list of them for .json)
JSON_SUFFIXES = (".jsonl", ".json")
#: token ids buffered before one ``bincount`` (a bincount allocates a vocabulary-sized tensor:
#: once per text would dominate a corpus of many short records)
_COUNT_CHUNK = 1 << 20


class Tokenizer(Protocol):
    """What :func:`count_tokens` needs of a tokenizer (a transformers tokenizer has it)."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


@dataclasses.dataclass
class CorpusStats:
    """What :func:`iter_texts` read, filled in as it goes."""

    num_files: int = 0  # files whose text was read (in whole or, at --max-bytes, in part)
    num_skipped_files: int = 0  # files that were not UTF-8
    num_chars: int = 0  # characters of text yielded


@dataclasses.dataclass(frozen=True)
class TokenMapSummary:
    """The result of :func:`build_token_map`."""

    num_files: int  # corpus files read
    num_skipped_files: int  # corpus files skipped (not UTF-8)
    num_corpus_tokens: int  # tokens counted in the corpus
    num_distinct_tokens: int  # distinct token ids among them
    num_tokens: int  # token ids in the map
    vocab_size: int  # the target's vocabulary
    coverage: float  # share of the corpus's tokens whose id is in the map, 0..1
    output: str  # the token map file written

    def as_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict (``token-map --json``)."""
        return dataclasses.asdict(self)

    def format(self) -> str:
        """A short human-readable summary (``token-map`` without ``--json``)."""
        skipped = f", {self.num_skipped_files} skipped (not UTF-8)" if self.num_skipped_files else ""
        return (f"read {self.num_files} file{'' if self.num_files == 1 else 's'}{skipped}: "
                f"{_human(self.num_corpus_tokens)} tokens, {self.num_distinct_tokens} distinct\n"
                f"{self.num_tokens} of {self.vocab_size} tokens cover {100 * self.coverage:.1f}% "
                f"of the {_human(self.num_corpus_tokens)} tokens counted\n"
                f"wrote {self.output}")


def _human(n: int) -> str:
    """1234 -> '1234', 1_234_567 -> '1.2M'."""
    for scale, suffix in ((10**9, "G"), (10**6, "M"), (10**4, "k")):
        if n >= scale:
            return f"{n / scale:.1f}{suffix}"
    return str(n)


def model_vocab(model: str | Path) -> tuple[int, tuple[int, ...]]:
    """(vocab_size, end-of-sequence ids) of the checkpoint ``model``: ``config.json``'s
    ``vocab_size`` and ``eos_token_id`` plus ``generation_config.json``'s ``eos_token_id``."""
    path = Path(model) / "config.json"
    if not Path(model).is_dir():
        raise ValueError(f"--model {model}: no such directory; pass the target checkpoint directory "
                         "(config.json and a tokenizer)")
    if not path.is_file():
        raise ValueError(f"--model {model}: no config.json there; pass the target checkpoint directory")
    try:
        cfg = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--model {model}: config.json is not valid JSON ({e})") from None
    vocab_size = cfg.get("vocab_size") if isinstance(cfg, dict) else None
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= 0:
        raise ValueError(f"--model {model}: config.json has no vocab_size (a positive integer, got "
                         f"{vocab_size!r}); the token map's ids are checked against it")
    return vocab_size, with_generation_eos_ids(model, eos_ids(cfg, str(path)))


def corpus_files(paths: Sequence[str | Path], glob: str = "*", exclude: Sequence[str | Path] = ()) -> list[Path]:
    """The files of ``paths`` in order: a file as it is, a directory as every file under it
    (recursively) whose name matches ``glob``, sorted, but for the files ``exclude`` names (the
    map being written, when ``--output`` lies under a ``--data`` directory). A missing path is
    a ``ValueError``."""
    skipped = {Path(f).resolve() for f in exclude}
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(f for f in p.rglob(glob) if f.is_file() and f.resolve() not in skipped)
            if not found:
                logger.warning("--data %s: no file under it matches --glob %r", p, glob)
            files.extend(found)
        elif p.is_file():
            files.append(p)
        else:
            raise ValueError(f"--data {p}: no such file or directory; pass text, .jsonl or .json "
                             "files, or directories of them")
    return files


def record_text(record: object, where: str) -> str:
    """The text of one JSON record: a string; or an object's ``"text"``, else its ``"prompt"``
    and ``"completion"`` joined, else its ``"messages"``' ``"content"`` strings joined by
    newlines. ``where`` (file and line) names the record in a ``ValueError``."""
    if isinstance(record, str):
        return record
    if isinstance(record, dict):
        if "text" in record:
            return _expect_str(record["text"], "text", where)
        if "prompt" in record or "completion" in record:
            return "".join(_expect_str(record[k], k, where) for k in ("prompt", "completion")
                           if record.get(k) is not None)
        if "messages" in record:
            messages = record["messages"]
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                raise ValueError(f"--data {where}: \"messages\" must be a list of objects with "
                                 "\"content\"")
            return "\n".join(c for c in (_message_content(m.get("content"), where) for m in messages) if c)
    raise ValueError(f"--data {where}: a record must be a string or an object with \"text\", "
                     "\"prompt\"/\"completion\" or \"messages\"; got "
                     + (f"keys {sorted(record)}" if isinstance(record, dict) else type(record).__name__))


def _expect_str(value: object, key: str, where: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"--data {where}: \"{key}\" must be a string, got {type(value).__name__}")
    return value


def _message_content(content: object, where: str) -> str:
    """A chat message's ``content``: a string, None (a tool call), or OpenAI's list of parts
    (their ``"text"`` joined)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    raise ValueError(f"--data {where}: a message's \"content\" must be a string or a list of parts, "
                     f"got {type(content).__name__}")


def file_texts(path: Path, max_chars: int | None = None) -> list[str]:
    """The texts of one corpus file: a ``.jsonl`` file's records (one a line, blank lines
    skipped), a ``.json`` file's record or list of records, else the file's text (at most
    ``max_chars`` characters of it are read). ``UnicodeDecodeError`` if it is not UTF-8."""
    if path.suffix not in JSON_SUFFIXES:
        with path.open(encoding="utf-8") as f:
            return [f.read() if max_chars is None else f.read(max_chars)]
    text = path.read_bytes().decode("utf-8")
    if path.suffix == ".jsonl":
        texts = []
        for i, line in enumerate(text.splitlines(), 1):
            if line.strip():
                texts.append(record_text(_parse_json(line, f"{path}:{i}"), f"{path}:{i}"))
        return texts
    data = _parse_json(text, str(path))
    records = data if isinstance(data, list) else [data]
    return [record_text(r, f"{path} record {i}") for i, r in enumerate(records)]


def _parse_json(text: str, where: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--data {where}: not valid JSON ({e}); .jsonl holds one JSON record a "
                         "line, .json one record or a list; rename other text files") from None


def iter_texts(paths: Sequence[str | Path], glob: str = "*", max_bytes: int | None = None,
               stats: CorpusStats | None = None, exclude: Sequence[str | Path] = ()) -> Iterator[str]:
    """The texts of the corpus ``paths`` (:func:`corpus_files`, :func:`file_texts`), in order,
    with a progress bar over the files; at most ``max_bytes`` characters in all (the last text
    cut short). A file that is not UTF-8 is skipped with a warning. ``stats`` is filled in."""
    if max_bytes is not None and max_bytes < 1:
        raise ValueError(f"--max-bytes must be at least 1 (characters of text), got {max_bytes}; "
                         "leave it unset to read the whole corpus")
    stats = stats if stats is not None else CorpusStats()
    files = corpus_files(paths, glob, exclude)
    with tqdm(files, desc="counting tokens", unit="file", disable=None) as bar:
        for path in bar:
            left = None if max_bytes is None else max_bytes - stats.num_chars
            try:
                texts = file_texts(path, left)
            except UnicodeDecodeError as e:
                logger.warning("skipping %s: not UTF-8 text (%s)", path, e)
                stats.num_skipped_files += 1
                continue
            stats.num_files += 1
            for text in texts:
                if left is not None:
                    text = text[:left]
                    left -= len(text)
                stats.num_chars += len(text)
                if text:
                    yield text
                if left == 0:
                    logger.info("--max-bytes %d reached in %s; the rest of the corpus is not read",
                                max_bytes, path)
                    return


def count_tokens(texts: Iterable[str], tokenizer: Tokenizer, vocab_size: int) -> torch.Tensor:
    """How often each token id occurs in ``texts`` (each encoded without special tokens) ->
    ``[vocab_size]`` int64. An id outside the vocabulary is a ``ValueError`` (the tokenizer is
    not the model's)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    buffer: list[int] = []

    def flush() -> None:
        if not buffer:
            return
        ids = torch.tensor(buffer, dtype=torch.int64)
        buffer.clear()
        high = int(ids.max())
        if high >= vocab_size or int(ids.min()) < 0:
            raise ValueError(f"--model: the tokenizer produced token id {high}, outside config.json's "
                             f"vocab_size {vocab_size}; the tokenizer does not match the model")
        counts.add_(torch.bincount(ids, minlength=vocab_size))

    for text in texts:
        buffer.extend(tokenizer.encode(text, add_special_tokens=False))
        if len(buffer) >= _COUNT_CHUNK:
            flush()
    flush()
    return counts


def token_coverage(counts: torch.Tensor, token_ids: torch.Tensor) -> float:
    """The share of the counted tokens (``counts [V]``) whose id is in ``token_ids``, 0..1
    (0.0 when nothing was counted)."""
    total = int(counts.sum())
    return int(counts[token_ids].sum()) / total if total else 0.0


def counting_tokenizer(model: str | Path) -> Tokenizer:
    """``model``'s tokenizer, set up to count whole files (they are never fed to the model, so no
    "longer than the maximum" warning); a ``ValueError`` naming ``--model`` where it has none."""
    from .llm import load_tokenizer

    tokenizer = load_tokenizer(model)
    if tokenizer is None:
        raise ValueError(f"--model {model}: no tokenizer there (tokenizer.json or "
                         "tokenizer_config.json), or transformers is not installed; the corpus is "
                         "counted with the target's tokenizer")
    if hasattr(tokenizer, "model_max_length"):
        tokenizer.model_max_length = int(1e30)
    return tokenizer


def build_token_map(model: str | Path, data: Sequence[str | Path], num_tokens: int,
                    output: str | Path, glob: str = "*", max_bytes: int | None = None) -> TokenMapSummary:
    """Count the corpus ``data`` with ``model``'s tokenizer, keep the ``num_tokens`` most frequent
    ids plus the model's end-of-sequence ids (:func:`most_frequent_tokens`) and write them to
    ``output`` (.pt or .json) -> the summary. Errors are ``ValueError`` naming the flag."""
    output = Path(output)
    if output.suffix not in TOKEN_MAP_SUFFIXES:
        raise ValueError(f"--output {output}: a token map is a .pt file (torch.save of the ids, "
                         "SGLang's format) or a .json list; name it with one of those suffixes")
    if output.is_dir():
        raise ValueError(f"--output {output}: is a directory; pass a file path ending in .pt or .json")
    # its folder is made if missing: one of the folders above it that is a file fails now, not
    # after the corpus is counted
    parent = next((p for p in output.absolute().parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise ValueError(f"--output {output}: {parent} is a file, so the map cannot be written "
                         "under it; pass a path in a directory")
    vocab_size, eos = model_vocab(model)
    # --num-tokens checked (and against the always-kept ids) before the corpus is counted
    most_frequent_tokens(torch.zeros(vocab_size, dtype=torch.int64), num_tokens, always=eos)
    tokenizer = counting_tokenizer(model)
    stats = CorpusStats()
    # a map written into a --data directory (by an earlier run) is not part of the corpus
    counts = count_tokens(iter_texts(data, glob, max_bytes, stats, exclude=(output,)), tokenizer, vocab_size)
    num_corpus_tokens = int(counts.sum())
    if num_corpus_tokens == 0:
        raise ValueError(f"--data: no text found in {', '.join(map(str, data))} (read "
                         f"{stats.num_files} files, skipped {stats.num_skipped_files} not UTF-8"
                         f"; --glob {glob!r}); pass files of text, .jsonl or .json records")
    token_ids = most_frequent_tokens(counts, num_tokens, always=eos)
    try:
        save_token_map(token_ids, output)
    except (OSError, RuntimeError) as e:  # torch.save: RuntimeError where the file can't open
        reason = getattr(e, "strerror", None) or str(e).strip().splitlines()[0]
        raise ValueError(f"--output {output}: cannot write the token map ({reason}); pass a "
                         "writable path") from e
    summary = TokenMapSummary(
        num_files=stats.num_files, num_skipped_files=stats.num_skipped_files,
        num_corpus_tokens=num_corpus_tokens, num_distinct_tokens=int((counts > 0).sum()),
        num_tokens=int(token_ids.numel()), vocab_size=vocab_size,
        coverage=token_coverage(counts, token_ids), output=str(output))
    logger.info("token map: %d of %d ids cover %.4f of %d corpus tokens; wrote %s", summary.num_tokens,
                vocab_size, summary.coverage, num_corpus_tokens, output)
    return summary
