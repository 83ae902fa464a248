"""Dataset files as users have them: rows of a .jsonl, .json or .parquet file, or of a directory of parquet files.

Why a layer of its own: a dataset is checked once at load time and its rows are read again, one at a time, when
a batch uses them (``dataset.py`` keeps a few numbers per row, never the rows). Each format has its own way to
get row ``i`` back cheaply, and its own way to name a row in an error:

- ``.jsonl``: one JSON object per line; a row is re-read by its byte offset and checked against the CRC of the
  line read at load time (a file edited under a running job is named, not silently used). Rows are named
  ``file:line``.
- ``.json``: a JSON array of objects (Video-R1's ``Video-R1-260k.json``) or an object holding one such array
  (``{"train": [...]}``: give the file as ``path@train``). The file must be parsed whole; each row is kept as
  its compact JSON bytes (about the file's size in memory). Rows are named ``file:row N`` (0-based).
- ``.parquet`` (verl, EasyR1, HF ``datasets`` exports) or a directory of them (one split, files in name order):
  rows are read back by row group, the last group read kept, so a batch of nearby rows reads one group. Nested
  columns (``reward_model.ground_truth``) and image bytes come back as Python objects. Rows are named
  ``file:row N`` (0-based within the file).

A malformed JSON line, a row that is not an object, or a file pyarrow cannot read is a ``DataError`` naming
the file (and row) and what to do.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterator

import numpy as np


class DataError(ValueError):
    """A dataset file or row is unusable; the message names the file (and row) and the fix."""


FORMATS = (".jsonl", ".json", ".parquet")


def read_json_row(where: str, line: bytes) -> dict:
    """The JSON object of one line; ``DataError`` naming ``where`` for bad JSON or a non-object."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not isinstance(row, dict):
        raise DataError(f"{where}: a row must be a JSON object "
                        f'({{"prompt": ..., "answer": ..., "images": [...]}}), got {type(row).__name__}')
    return row


def jsonl_lines(path: str) -> Iterator[tuple[int, int, bytes]]:
    """Yields ``(line_number, byte_offset, line)`` for each non-blank line of a JSONL file."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise DataError(f"dataset file {path!r} does not exist") from None
    except OSError as e:
        raise DataError(f"dataset file {path!r} cannot be read: {e}") from None
    with f:
        offset = 0
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                yield lineno, offset, line
            offset += len(line)


class JsonlSource:
    """Rows of a JSONL file, re-read by byte offset (see the module docstring)."""

    def __init__(self, path: str):
        self.path = path
        offsets, linenos, crcs = [], [], []
        for lineno, offset, line in jsonl_lines(path):
            offsets.append(offset)
            linenos.append(lineno)
            crcs.append(zlib.crc32(line))
        self._offset = np.asarray(offsets, np.int64)
        self._lineno = np.asarray(linenos, np.int64)
        self._crc = np.asarray(crcs, np.int64)

    def __len__(self) -> int:
        return len(self._offset)

    def where(self, i: int) -> str:
        return f"{self.path}:{int(self._lineno[i])}"

    def rows(self) -> Iterator[dict]:
        """Every row in file order (one pass over the file)."""
        for i, (_, _, line) in enumerate(jsonl_lines(self.path)):
            if zlib.crc32(line) != int(self._crc[i]):
                raise DataError(f"{self.where(i)}: the dataset file changed while it was being loaded; load it again")
            yield read_json_row(self.where(i), line)

    def row(self, i: int) -> dict:
        where = self.where(i)
        try:
            with open(self.path, "rb") as f:
                f.seek(int(self._offset[i]))
                line = f.readline()
        except OSError as e:
            raise DataError(f"{where}: the dataset file cannot be read any more: {e}") from None
        if zlib.crc32(line) != int(self._crc[i]):
            raise DataError(f"{where}: the dataset file changed since it was loaded (this line is not the one that "
                            "was checked); restart the run on the file as it is now")
        return read_json_row(where, line)


class JsonSource:
    """Rows of a JSON file holding an array of objects (or ``path@key``: the array under ``key``)."""

    def __init__(self, path: str, key: str | None):
        self.path = path
        try:
            with open(path, "rb") as f:
                data = json.load(f)
        except FileNotFoundError:
            raise DataError(f"dataset file {path!r} does not exist") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DataError(f"dataset file {path!r} is not valid JSON: {e}") from None
        if isinstance(data, dict):
            arrays = [k for k, v in data.items() if isinstance(v, list)]
            if key is None:
                raise DataError(f"dataset file {path!r} holds an object, not an array of rows: give the split as "
                                f"{path}@KEY (keys holding arrays: {arrays})")
            if key not in arrays:
                raise DataError(f"dataset file {path!r} has no array {key!r} (keys holding arrays: {arrays})")
            data = data[key]
        elif key is not None:
            raise DataError(f"dataset file {path!r} is an array, not an object: drop '@{key}'")
        if not isinstance(data, list):
            raise DataError(f"dataset file {path!r} must hold a JSON array of row objects, got {type(data).__name__}")
        self._rows = []
        for i, row in enumerate(data):
            if not isinstance(row, dict):
                raise DataError(f"{path}:row {i}: a row must be a JSON object, got {type(row).__name__}")
            self._rows.append(json.dumps(row, separators=(",", ":")).encode())

    def __len__(self) -> int:
        return len(self._rows)

    def where(self, i: int) -> str:
        return f"{self.path}:row {i}"

    def rows(self) -> Iterator[dict]:
        for i in range(len(self)):
            yield self.row(i)

    def row(self, i: int) -> dict:
        return json.loads(self._rows[i])


class ParquetSource:
    """Rows of one parquet file or of a directory of them, read back by row group."""

    def __init__(self, path: str):
        import pyarrow.parquet as pq

        self.path = path
        files = [path]
        if os.path.isdir(path):
            files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".parquet"))
            if not files:
                raise DataError(f"dataset directory {path!r} holds no .parquet file")
        elif not os.path.exists(path):
            raise DataError(f"dataset file {path!r} does not exist")
        self._names = files
        self._files, self._groups = [], []  # per file: ParquetFile; per global group: (file, group, first row)
        starts, first = [], 0
        for file in files:
            try:
                pf = pq.ParquetFile(file)
            except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ...
                raise DataError(f"dataset file {file!r} is not a readable parquet file: {e}") from None
            self._files.append(pf)
            local = 0
            for g in range(pf.metadata.num_row_groups):
                n = pf.metadata.row_group(g).num_rows
                self._groups.append((len(self._files) - 1, g, local))
                starts.append(first)
                first += n
                local += n
        self._starts = np.asarray(starts + [first], np.int64)
        self._cached: tuple[int, list[dict]] | None = None

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _locate(self, i: int) -> tuple[int, int]:
        g = int(np.searchsorted(self._starts, i, side="right")) - 1
        return g, i - int(self._starts[g])

    def where(self, i: int) -> str:
        g, j = self._locate(i)
        f, _, local = self._groups[g]
        return f"{self._names[f]}:row {local + j}"

    def _group_rows(self, g: int) -> list[dict]:
        if self._cached is None or self._cached[0] != g:
            f, group, _ = self._groups[g]
            try:
                table = self._files[f].read_row_group(group)
            except Exception as e:
                raise DataError(f"dataset file {self._names[f]!r}: row group {group} cannot be read: {e}") from None
            self._cached = (g, table.to_pylist())
        return self._cached[1]

    def rows(self) -> Iterator[dict]:
        for g in range(len(self._groups)):
            yield from self._group_rows(g)

    def row(self, i: int) -> dict:
        g, j = self._locate(i)
        return self._group_rows(g)[j]


def open_source(spec: str) -> JsonlSource | JsonSource | ParquetSource:
    """The rows of ``spec``: a .jsonl / .json (``path@key`` for an array inside an object) / .parquet file, or a
    directory of .parquet files (one split)."""
    path, key = spec, None
    if "@" in spec and not os.path.exists(spec):
        path, key = spec.rsplit("@", 1)
    ext = "" if os.path.isdir(path) else os.path.splitext(path)[1].lower()
    if key is not None and ext != ".json":
        raise DataError(f"dataset {spec!r}: '@{key}' selects an array inside a .json file only; a .jsonl or .parquet "
                        "file (or a directory of parquet files) is one split")
    if os.path.isdir(path) or ext == ".parquet":
        return ParquetSource(path)
    if ext == ".jsonl":
        return JsonlSource(path)
    if ext == ".json":
        return JsonSource(path, key)
    raise DataError(f"dataset {spec!r}: unknown format {ext or '(no extension)'!r}; give a .jsonl, .json or "
                    ".parquet file, or a directory of .parquet files")
