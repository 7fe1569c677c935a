"""Training data: the tokenized dataset of a run's files, and the eval prompts.

Each shard's records (`app/data/formats.py` reads and parses them) are tokenized, masked and
filtered here, counted per file (`DataSummary`: every record kept or dropped for one reason), and
put together into one flat `TokenizedDataset` in file and line order.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from app.data.formats import detect_format, iter_records, record_tokens, to_messages
from app.data.progress import progress_bar
from app.data.records import DataError, MalformedRecord
from app.data.shards import Shard, read_shard, whole_file
from app.config.schema import DataConfig

DROP_REASONS = ("too_few_loss_tokens", "overlong", "malformed", "out_of_vocab")


@dataclass
class FileSummary:
    """What happened to the records of one input file."""

    records: int = 0
    kept: int = 0
    dropped: dict[str, int] = field(default_factory=lambda: {r: 0 for r in DROP_REASONS})
    truncated: int = 0
    tokens: int = 0
    loss_tokens: int = 0

    def to_dict(self) -> dict:
        return {
            "records": self.records,
            "kept": self.kept,
            "dropped": dict(self.dropped),
            "truncated": self.truncated,
            "tokens": self.tokens,
            "loss_tokens": self.loss_tokens,
        }

    def add(self, other: "FileSummary") -> None:
        """Count `other`'s records in too (shards of one file, files of a total)."""
        self.records += other.records
        self.kept += other.kept
        self.truncated += other.truncated
        self.tokens += other.tokens
        self.loss_tokens += other.loss_tokens
        for reason, n in other.dropped.items():
            self.dropped[reason] = self.dropped.get(reason, 0) + n


@dataclass
class DataSummary:
    """Per-file and total counts; every record read is either kept or dropped for one reason."""

    files: dict[str, FileSummary] = field(default_factory=dict)

    def total(self) -> FileSummary:
        tot = FileSummary()
        for fs in self.files.values():
            tot.add(fs)
        return tot

    def to_dict(self) -> dict:
        return {"total": self.total().to_dict(), "files": {k: v.to_dict() for k, v in self.files.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> "DataSummary":
        """The inverse of to_dict (the total is recomputed)."""
        return cls(files={path: FileSummary(**{**fs, "dropped": dict(fs["dropped"])}) for path, fs in d["files"].items()})


@dataclass
class TokenizedDataset:
    """Kept sequences as flat arrays: sequence i is tokens[offsets[i]:offsets[i+1]]."""

    tokens: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]
    offsets: np.ndarray  # int64 [N+1]
    summary: DataSummary

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def sequence(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = self.offsets[i], self.offsets[i + 1]
        return self.tokens[lo:hi], self.loss_mask[lo:hi]

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


@dataclass
class ShardResult:
    """One shard tokenized: its counts, its kept sequences back to back, and (under on_error=raise)
    the first malformed record's one-line error, where tokenizing stopped."""

    path: str
    summary: FileSummary
    tokens: np.ndarray  # int32, kept sequences concatenated
    loss_mask: np.ndarray  # uint8
    lengths: np.ndarray  # int64, one per kept sequence
    error: str = ""


def tokenize_shard(shard: Shard, data: DataConfig, block_size: int, tokenizer, tick=None, vocab_size: int = 0
                   ) -> ShardResult:
    """Tokenize, mask and filter the records of one shard. `tick(n)` is told of records as they go;
    `vocab_size` (the target's, 0 = unchecked) bounds pre-tokenized ids."""
    min_loss = 2 * block_size
    fs = FileSummary()
    tok_parts, mask_parts, lengths = [], [], []
    error, pending = "", 0
    for line_no, rec in read_shard(shard):
        fs.records += 1
        pending += 1
        if tick is not None and pending >= 256:
            tick(pending)
            pending = 0
        try:
            if isinstance(rec, MalformedRecord):
                raise rec
            ids, mask = record_tokens(rec, data.format, tokenizer, data.enable_thinking, vocab_size)
        except MalformedRecord as e:
            if data.on_error == "raise":
                error = f"{shard.path}:{line_no}: malformed record: {e}. Fix the record or set data.on_error=skip"
                break
            fs.dropped[e.reason] += 1
            continue
        if len(ids) > data.max_length:
            if data.overlong == "drop":
                fs.dropped["overlong"] += 1
                continue
            ids, mask = ids[: data.max_length], mask[: data.max_length]
            fs.truncated += 1
        n_loss = int(sum(mask))
        if n_loss < min_loss:
            fs.dropped["too_few_loss_tokens"] += 1
            continue
        fs.kept += 1
        fs.tokens += len(ids)
        fs.loss_tokens += n_loss
        tok_parts.append(np.asarray(ids, dtype=np.int32))
        mask_parts.append(np.asarray(mask, dtype=np.uint8))
        lengths.append(len(ids))
    if tick is not None and pending:
        tick(pending)
    return ShardResult(
        path=shard.path, summary=fs, error=error,
        tokens=np.concatenate(tok_parts) if tok_parts else np.zeros(0, np.int32),
        loss_mask=np.concatenate(mask_parts) if mask_parts else np.zeros(0, np.uint8),
        lengths=np.asarray(lengths, dtype=np.int64),
    )


def assemble(files: list[str], results: list[ShardResult]) -> TokenizedDataset:
    """One dataset from the shards' results in file and line order; the first error is raised."""
    summary = DataSummary(files={str(f): FileSummary() for f in files})
    for r in results:
        if r.error:
            raise DataError(r.error)
        summary.files[r.path].add(r.summary)
    lengths = np.concatenate([r.lengths for r in results]) if results else np.zeros(0, np.int64)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.concatenate([r.tokens for r in results]) if results else np.zeros(0, np.int32)
    loss_mask = np.concatenate([r.loss_mask for r in results]) if results else np.zeros(0, np.uint8)
    return TokenizedDataset(tokens=tokens, loss_mask=loss_mask, offsets=offsets, summary=summary)


def load_dataset(data: DataConfig, block_size: int, tokenizer, files: list[str], progress: bool = False,
                 vocab_size: int = 0) -> TokenizedDataset:
    """Tokenize, mask and filter every record of `files` (in order) into one flat dataset, in this
    process: the reference for the parallel path (`app/data/pipeline.py`) and the path for small inputs."""
    if not files:
        raise DataError("no training files; set data.train_files (or use model.target=tiny)")
    shards = [s for f in files for s in whole_file(str(f))]
    results = []
    with progress_bar(sum(s.records for s in shards), "tokenize", enabled=progress) as bar:
        for shard in shards:
            results.append(tokenize_shard(shard, data, block_size, tokenizer, tick=bar.update, vocab_size=vocab_size))
            if results[-1].error:
                break  # the first malformed record stops the run: nothing after it matters
    return assemble(files, results)


def load_eval_prompts(path: str, tokenizer, enable_thinking: bool = False) -> list[list[int]]:
    """Prompt ids of a held-out file, chat template applied with add_generation_prompt=True.

    Lines are `{"messages": [...]}` (trailing assistant turns are dropped: the prompt ends where the
    response would start), `{"conversations": [...]}` (ShareGPT) or `{"prompt": "text"}` (one user turn).
    """
    from app.data.chat_mask import refuse_special_text, render

    prompts = []
    for line_no, rec in iter_records(path):
        if isinstance(rec, MalformedRecord):
            raise DataError(f"{path}:{line_no}: {rec}; fix the eval prompts file")
        try:
            if isinstance(rec.get("prompt"), str):
                messages = [{"role": "user", "content": rec["prompt"]}]
            else:
                messages = to_messages(rec, detect_format(rec, "auto"))
        except MalformedRecord as e:
            raise DataError(f"{path}:{line_no}: {e}; eval prompts need messages or prompt") from None
        while messages and messages[-1]["role"] == "assistant":
            messages.pop()
        if not messages:
            raise DataError(f"{path}:{line_no}: no prompt turns left after dropping assistant turns")
        try:
            refuse_special_text(tokenizer, messages)
        except MalformedRecord as e:
            raise DataError(f"{path}:{line_no}: {e}") from None
        text = render(tokenizer, messages, add_generation_prompt=True, enable_thinking=enable_thinking)
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return prompts
