"""Every row of every data file the run reads, checked before Ray starts: a bad row at index 200 otherwise fails
when its batch is drawn, 25 steps in, or passes silently and trains on a damaged prompt.

Per row (data.prompt_key's messages, data.reward_fn_key's data source), each decided, not left at a default:
  null or empty prompt          refuse: the dataset fails on it when its batch is drawn;
  unknown role (`usr`)          refuse: chat templates drop or mis-render a role they do not know (Qwen's renders
                                nothing for it), so the model would see a prompt without that message;
  no message with content       refuse: the model is asked nothing;
  some message empty            warn once: an empty system message is common and verl renders it as is;
  longer than max_prompt_length refuse with data.truncation=error (the dataset raises when the row is drawn);
                                warn once with left (the start goes: the system prompt and the first user header)
                                and right (the end goes: the question's end and the assistant header); with
                                data.filter_overlong_prompts=true warn once with the count the dataset drops;
  longer than the model's       refuse: positions past config.json's max_position_embeddings were never trained
  max_position_embeddings       (rotary models extrapolate silently; learned positions fail in an index error);
  data_source without a scorer  refuse (reward/config_checks.py, with rows_by_data_source from here), unless
                                something else scores every sample, or the row's extra_info.rm_type names its scorer.
Each problem is one line: how many rows, and the first few by file and row index.

Lengths are measured as the dataset measures them (rl_dataset.chat_prompt and prompt_token_ids: chat template
with the generation prompt, then the tokenizer), in worker processes when a file is large, and cached under
`{cache_dir}/row_lengths/` by the file's content hash, the tokenizer (its whole definition), the chat template and
its arguments, so a rerun on the same data reads them back. What it costs, measured 2026-12-06 on a synthetic
parquet of 1M two-message rows (127 tokens each with the tiny test model's byte-level tokenizer):
  first time   about 180 CPU-seconds (173 in the workers; per 20k rows: 0.9 s rendering the template, 2.7 s
               tokenising, 1 s to Python lists), spread over one worker per core: 244 s of wall time on the shared
               2-core machine with other tests running (about 90 s on 2 idle cores, about 12 s on 16, by CPU time);
  cached       0.8 s of wall time (hashing the 13 MB file, the structure checks, reading the lengths).
The check runs twice at start (preflight, then the warnings), the second time from the cache.
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from hybridrl.config.schema import PPOConfig

KNOWN_ROLES = ("system", "user", "assistant", "tool")
SHOWN = 3  # offending rows named in one line
CHUNK_ROWS = 20_000  # rows one worker renders and tokenises at a time
RENDER_FAILED = -2  # a row's length when the chat template raised on it
_FORMAT = 1  # bump when what the cached lengths mean changes


@dataclass
class RowReport:
    """Problems (refuse) and warnings (warn once) of the rows of the files the run reads."""
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def check_rows(config: PPOConfig, files: list[tuple[str, str]], tokenizer,
               max_position_embeddings: int | None) -> RowReport:
    """Check every row of `files` ((key[index], path), readable parquet with the dataset's columns). `tokenizer` is
    the run's policy tokenizer (None: lengths are not measured, a problem with it is reported elsewhere)."""
    report = RowReport()
    for where, path in files:
        prompts = pq.read_table(path, columns=[config.data.prompt_key])[config.data.prompt_key]
        _check_messages(where, path, prompts, report)
        if tokenizer is not None:
            lengths, error = prompt_lengths(path, config, tokenizer)
            failed = np.flatnonzero(lengths == RENDER_FAILED)
            if len(failed):
                report.problems.append(f"{where}: expected prompts the chat template renders, got an error in "
                                       f"{rows_named(path, failed)} ({error})")
            _check_lengths(where, path, lengths, config, max_position_embeddings, report)
    return report


def rows_named(path: str, rows: np.ndarray) -> str:
    """`N rows, first: file rows 3, 17, 40`"""
    first = ", ".join(str(row) for row in rows[:SHOWN])
    return f"{len(rows)} row(s) of {path!r}, first rows {first}"


def _check_messages(where: str, path: str, prompts: pa.ChunkedArray, report: RowReport) -> None:
    """Structure of each row's messages, vectorised over the column (a 1M-row file in well under a second)."""
    prompts = prompts.combine_chunks()
    missing = np.flatnonzero(pc.fill_null(pc.list_value_length(prompts), 0).to_numpy(zero_copy_only=False) == 0)
    if len(missing):
        report.problems.append(f"{where}: expected a non-empty list of messages in every row, got a null or empty "
                               f"prompt in {rows_named(path, missing)}")
    messages, owner = pc.list_flatten(prompts), pc.list_parent_indices(prompts).to_numpy(zero_copy_only=False)
    roles = messages.field("role")
    unknown = ~pc.fill_null(pc.is_in(roles, pa.array(KNOWN_ROLES)), False).to_numpy(zero_copy_only=False)
    if unknown.any():
        seen = sorted(set(roles.filter(pa.array(unknown)).to_pylist()), key=str)
        report.problems.append(f"{where}: expected message roles among {list(KNOWN_ROLES)}, got {seen} in "
                               f"{rows_named(path, np.unique(owner[unknown]))}")
    content = messages.field("content")
    if not pa.types.is_string(content.type) and not pa.types.is_large_string(content.type):
        return  # structured (multimodal) content: the chat template decides
    empty = pc.fill_null(pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(content)), 0), True)
    empty = empty.to_numpy(zero_copy_only=False)
    rows_with_empty = np.unique(owner[empty])
    said = np.bincount(owner[~empty], minlength=len(prompts))
    silent = np.setdiff1d(rows_with_empty[said[rows_with_empty] == 0], missing)
    if len(silent):
        report.problems.append(f"{where}: expected at least one message with content in every row, got only empty "
                               f"messages in {rows_named(path, silent)}")
    partly = rows_with_empty[said[rows_with_empty] > 0]
    if len(partly):
        report.warnings.append(f"{where}: {rows_named(path, partly)} have an empty message besides others (kept: "
                               f"the chat template renders it as an empty turn, as verl does)")


def rows_by_data_source(path: str, source_key: str, wanted) -> dict[str, np.ndarray]:
    """The rows of each data source (data.reward_fn_key) for which `wanted(source)` holds, among the rows whose
    scorer is chosen by their source: rows whose extra_info.rm_type names a reward-hub scorer are left out. For the
    reward's check that every source has a scorer (reward/config_checks.py)."""
    names = pq.read_schema(path).names
    table = pq.read_table(path, columns=[name for name in (source_key, "extra_info") if name in names])
    by_source = table[source_key].combine_chunks()
    needs = np.ones(len(by_source), dtype=bool)
    extra = table["extra_info"].type if "extra_info" in table.column_names else None
    if extra is not None and pa.types.is_struct(extra) and "rm_type" in {field.name for field in extra}:
        rm_type = pc.struct_field(table["extra_info"].combine_chunks(), "rm_type")
        needs = pc.is_null(rm_type).to_numpy(zero_copy_only=False)
    positions = np.flatnonzero(needs)
    chosen = by_source.filter(pa.array(needs))
    return {source: positions[pc.equal(chosen, source).to_numpy(zero_copy_only=False)]
            for source in pc.unique(chosen).to_pylist() if wanted(source)}


def _check_lengths(where: str, path: str, lengths: np.ndarray, config: PPOConfig,
                   max_position_embeddings: int | None, report: RowReport) -> None:
    data = config.data
    limit = data.max_prompt_length
    over = np.flatnonzero(lengths > limit)
    if len(over):
        longest = f"longest {int(lengths.max())} tokens"
        if data.filter_overlong_prompts:
            report.warnings.append(f"{where}: data.filter_overlong_prompts=true drops {rows_named(path, over)} "
                                   f"({longest}), longer than data.max_prompt_length={limit}")
        elif data.truncation == "error":
            report.problems.append(f"{where}: expected prompts of at most data.max_prompt_length={limit} tokens "
                                   f"(chat template applied) with data.truncation='error', got "
                                   f"{rows_named(path, over)} ({longest}); raise data.max_prompt_length, or set "
                                   f"data.truncation=left|right or data.filter_overlong_prompts=true")
        else:
            lost = ("their start: the system prompt and the first user header" if data.truncation == "left"
                    else "their end: the end of the question and the assistant header the answer follows")
            report.warnings.append(f"{where}: data.truncation={data.truncation!r} cuts {rows_named(path, over)} "
                                   f"({longest}) to data.max_prompt_length={limit} tokens, dropping {lost}")
    if max_position_embeddings is None:
        return
    kept = lengths if data.truncation == "error" or data.filter_overlong_prompts else np.minimum(lengths, limit)
    beyond = np.flatnonzero(kept > max_position_embeddings)
    if len(beyond):
        report.problems.append(f"{where}: expected prompts within the model's max_position_embeddings="
                               f"{max_position_embeddings} (actor_rollout_ref.model.path's config.json), got "
                               f"{rows_named(path, beyond)} ({int(kept.max())} tokens as fed); lower "
                               f"data.max_prompt_length to at most {max_position_embeddings}")


# ---- lengths: rendered and tokenised as the dataset does, in parallel, cached ----

def prompt_lengths(path: str, config: PPOConfig, tokenizer) -> tuple[np.ndarray, str | None]:
    """Token count of each row's prompt as the dataset renders it (-1: no messages; RENDER_FAILED: the chat
    template raised, and the first such error). Cached only when every row rendered."""
    cache_path = os.path.join(config.cache_dir, "row_lengths", _cache_key(path, config, tokenizer) + ".npy")
    if os.path.isfile(cache_path):
        return np.load(cache_path), None
    lengths, error = _measure(path, config.data.prompt_key, dict(config.data.apply_chat_template_kwargs), tokenizer)
    if error is not None:
        return lengths, error
    os.makedirs(os.path.dirname(cache_path), exist_ok=True)
    partial = f"{cache_path}.{os.getpid()}.tmp.npy"
    np.save(partial, lengths)
    os.replace(partial, cache_path)
    return lengths, None


def _cache_key(path: str, config: PPOConfig, tokenizer) -> str:
    """What the lengths depend on: the file's bytes, the tokenizer, its chat template and arguments."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    settings = {"format": _FORMAT, "prompt_key": config.data.prompt_key,
                "kwargs": config.data.apply_chat_template_kwargs, "template": tokenizer.chat_template,
                "tokenizer": type(tokenizer).__name__, "vocab": len(tokenizer),
                "backend": _backend_fingerprint(tokenizer)}
    digest.update(json.dumps(settings, sort_keys=True, default=str).encode())
    return digest.hexdigest()[:32]


def _backend_fingerprint(tokenizer) -> str:
    """The fast tokenizer's whole definition (vocabulary, merges, normaliser), hashed; a slow one's vocabulary."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _measure(path: str, prompt_key: str, template_kwargs: dict, tokenizer) -> tuple[np.ndarray, str | None]:
    """One chunk of CHUNK_ROWS rows at a time: here for a small file, else in one spawned worker per core (this
    process has imported torch, whose thread pools do not survive a fork). A worker receives its chunk as a compact
    Arrow array (a 20,000-row chunk of two-message rows pickles to 2.6 MB), so none holds the whole file."""
    prompts = pq.read_table(path, columns=[prompt_key])[prompt_key].combine_chunks()
    chunks = [(start, pa.concat_arrays([prompts.slice(start, CHUNK_ROWS)]))
              for start in range(0, len(prompts), CHUNK_ROWS)]
    if len(chunks) <= 1:
        _worker_setup(tokenizer, template_kwargs)
        return _joined([_measure_chunk(chunk) for chunk in chunks], len(prompts))
    with ProcessPoolExecutor(max_workers=min(len(chunks), os.cpu_count() or 1),
                             mp_context=multiprocessing.get_context("spawn"), initializer=_worker_setup,
                             initargs=(tokenizer, template_kwargs)) as pool:
        return _joined(list(pool.map(_measure_chunk, chunks)), len(prompts))


def _joined(measured: list[tuple[np.ndarray, str | None]], rows: int) -> tuple[np.ndarray, str | None]:
    errors = [error for _, error in measured if error is not None]
    lengths = np.concatenate([lengths for lengths, _ in measured]) if measured else np.zeros(rows, np.int32)
    return lengths, (errors[0] if errors else None)


_WORKER: dict = {}


def _worker_setup(tokenizer, template_kwargs: dict) -> None:
    _WORKER.update(tokenizer=tokenizer, kwargs=template_kwargs)


def _measure_chunk(chunk: tuple[int, pa.Array]) -> tuple[np.ndarray, str | None]:
    """Lengths of the rows of chunk (its first row's index, its prompts) (-1: no messages, RENDER_FAILED: the chat
    template raised) and the first template error, as `row N: <error>`."""
    from hybridrl.data.rl_dataset import chat_prompt, prompt_token_ids

    tokenizer, kwargs = _WORKER["tokenizer"], _WORKER["kwargs"]
    first_row, prompts = chunk
    conversations = prompts.to_pylist()
    lengths = np.full(len(conversations), -1, dtype=np.int32)
    rendered, texts, first_error = [], [], None
    for position, messages in enumerate(conversations):
        if not messages:
            continue
        try:
            texts.append(chat_prompt(tokenizer, messages, kwargs))
            rendered.append(position)
        except Exception as err:  # a template may raise anything (jinja's raise_exception, a missing key)
            lengths[position] = RENDER_FAILED
            first_error = first_error or f"row {first_row + position}: {type(err).__name__}: {err}"
    if texts:
        lengths[rendered] = [len(ids) for ids in prompt_token_ids(tokenizer, texts)]
    return lengths, first_error
