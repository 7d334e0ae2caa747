"""Where the text comes from: documents, in a fixed order, from files a user already has.

An input is a text file (one document), a directory (its files in sorted path order, hidden
files and directories skipped), a JSONL file (one document per line, from its text field), a Parquet file (one
document per row) or a directory written by `datasets`' ``save_to_disk`` (its Arrow files, in
the order its ``state.json`` lists them). JSONL, Parquet and Arrow are read with pyarrow, a batch
at a time, so a file larger than memory is fine; a text file is one document and is read whole.
The embedded default corpus is the Python standard library's own sources (about 11 MB of real
text on every machine that has Python, so nothing is downloaded).
"""

from __future__ import annotations

import json
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from diloco_p2p.errors import UserError

_SKIP_STDLIB_DIRS = {"site-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo"}
_BATCH_BYTES = 32 << 20  # pyarrow's JSON read block: also the longest JSONL line it accepts


def default_corpus_files() -> Iterator[Path]:
    """The standard library's sources in sorted path order, walked lazily: a corpus cut at
    `data.max_bytes` reads only the files it uses."""
    return _sorted_py_files(Path(sysconfig.get_paths()["stdlib"]))


def _sorted_py_files(directory: Path) -> Iterator[Path]:
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except OSError:
        return
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            if entry.name not in _SKIP_STDLIB_DIRS:
                yield from _sorted_py_files(Path(entry.path))
        elif entry.name.endswith(".py") and entry.is_file():
            yield Path(entry.path)


def is_saved_dataset(path: Path) -> bool:
    """A `datasets` ``save_to_disk`` directory (one Dataset or a DatasetDict)."""
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def input_files(inputs: list[str], what: str = "input") -> list[Path]:
    """Every file the inputs stand for, in reading order; one line naming a missing or empty input."""
    files: list[Path] = []
    for raw in inputs:
        p = Path(raw)
        if not p.exists():
            raise UserError(f"{what} {raw!r} does not exist; point it at a text, JSONL or Parquet file or a directory")
        if p.is_dir() and is_saved_dataset(p):
            found = _arrow_files(p)
        elif p.is_dir():
            found = [f for f in sorted(p.rglob("*")) if f.is_file()
                     and not any(part.startswith(".") for part in f.relative_to(p).parts)]
        else:
            found = [p]
        if not found or all(f.stat().st_size == 0 for f in found):
            raise UserError(f"{what} {raw!r} is empty; put text in it")
        files += found
    return files


def _arrow_files(directory: Path) -> list[Path]:
    if (directory / "dataset_dict.json").is_file():
        splits = json.loads((directory / "dataset_dict.json").read_text())["splits"]
        return [f for split in splits for f in _arrow_files(directory / split)]
    state = json.loads((directory / "state.json").read_text())
    return [directory / entry["filename"] for entry in state["_data_files"]]


def iter_documents(files: list[Path], text_field: str = "text", skip: int = 0) -> Iterator[bytes]:
    """The documents of `files` in order, as UTF-8 bytes, after passing over `skip` of them (a text
    file skipped is never read)."""
    for f in files:
        kind = f.suffix.lower()
        if kind in (".jsonl", ".json", ".ndjson"):
            rows = _jsonl_rows(f, text_field)
        elif kind == ".parquet":
            rows = _parquet_rows(f, text_field)
        elif kind == ".arrow":
            rows = _arrow_rows(f, text_field)
        else:
            if skip:
                skip -= 1
                continue
            yield f.read_bytes()
            continue
        for doc in rows:
            if skip:
                skip -= 1
                continue
            yield doc


def _column(batch, f: Path, text_field: str, first_row: int) -> Iterator[bytes]:
    import pyarrow as pa

    names = batch.schema.names
    if text_field not in names:
        raise UserError(f"{f}: no {text_field!r} field (it has {', '.join(names) or 'none'}); "
                        "name the text field with --text-field")
    column = batch.column(names.index(text_field))
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        column = column.cast(pa.large_string())
    for i, text in enumerate(column.to_pylist()):
        if text is None:
            raise UserError(f"{f}: row {first_row + i + 1} has no {text_field!r} field; "
                            "fix or drop that row, or name the text field with --text-field")
        yield text.encode()


def _jsonl_rows(f: Path, text_field: str) -> Iterator[bytes]:
    import pyarrow as pa
    import pyarrow.json as pj

    schema = pa.schema([(text_field, pa.large_string())])
    parse = pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
    row = 0
    try:
        reader = pj.open_json(f, read_options=pj.ReadOptions(block_size=_BATCH_BYTES), parse_options=parse)
        for batch in reader:
            yield from _column(batch, f, text_field, row)
            row += batch.num_rows
    except pa.ArrowInvalid as e:
        raise UserError(f"{f}: not JSON lines with a {text_field!r} string field after row {row} "
                        f"({' '.join(str(e).split())[:120]})") from None


def _parquet_rows(f: Path, text_field: str) -> Iterator[bytes]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(f)
    except (pa.ArrowInvalid, OSError) as e:
        raise UserError(f"{f}: not a readable Parquet file ({e})") from None
    if text_field not in pf.schema_arrow.names:
        raise UserError(f"{f}: no {text_field!r} column (it has {', '.join(pf.schema_arrow.names)}); "
                        "name the text column with --text-field")
    row = 0
    for batch in pf.iter_batches(batch_size=8192, columns=[text_field]):
        yield from _column(batch, f, text_field, row)
        row += batch.num_rows


def _arrow_rows(f: Path, text_field: str) -> Iterator[bytes]:
    import pyarrow as pa

    try:
        reader = pa.ipc.open_stream(pa.memory_map(str(f)))
    except (pa.ArrowInvalid, OSError) as e:
        raise UserError(f"{f}: not a readable Arrow file of a saved dataset ({e})") from None
    row = 0
    for batch in reader:
        yield from _column(batch, f, text_field, row)
        row += batch.num_rows
