"""The dictionary's file.

Persistence
-----------
With ``path``, the file is read at construction (a missing file is an empty
dictionary; one that is not this format is a ValueError naming it) and
written whenever a key finishes tuning, by the rank that :meth:`bind` named
the writer, as a temporary file renamed over the old one. It is JSON::

    {"format": "moe_runtime.tuner", "version": 2,
     "tables": {"<table name>": {"<key>": {"r": 2, "d": 4, "algo": "linear",
                                          "flow": "expert", "seconds": 0.0123,
                                          "trials": 14}}}}

A table name is the canonical JSON (sorted keys, no spaces) of the layer's
signature, the window and the search space (valid r, degrees, allowed
algorithms, and the other flows when there are any): tables of other layers,
shapes or machines stay in the file and are not used. Version 1 files (no
"flow": every entry is the expert flow's) still load. Saving merges with what the file holds by then, so layers with
their own dictionaries can share one file.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Mapping
from typing import Any

from .config import ALGOS, Config, Entry

__all__ = ["dump", "parse", "read_file", "save"]

FILE_FORMAT = "moe_runtime.tuner"
FILE_VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: no "flow" (every entry the expert flow's)


def save(path: str, changed: Mapping[str, Mapping[int, Entry]], loaded: Mapping[str, Mapping[int, Entry]]) -> None:
    """Write tables into `path`, as a temporary file renamed over it: the
    `changed` ones (tuned here) over what the file holds now, the file's over
    the others `loaded` here, so that layers with their own dictionaries can
    share one file."""
    tables = dict(loaded)
    if os.path.exists(path):
        tables.update(read_file(path))
    tables.update(changed)
    folder = os.path.dirname(os.path.abspath(path))
    handle, temporary = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(dump(tables))
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def dump(tables: Mapping[str, Mapping[int, Entry]]) -> str:
    return json.dumps({"format": FILE_FORMAT, "version": FILE_VERSION, "tables": {
        name: {str(key): {"r": e.config.r, "d": e.config.d, "algo": e.config.algo, "flow": e.config.flow,
                          "seconds": e.seconds, "trials": e.trials} for key, e in sorted(entries.items())}
        for name, entries in sorted(tables.items())}}, indent=1) + "\n"


def read_file(path: str) -> dict[str, dict[int, Entry]]:
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not a {FILE_FORMAT} file (not UTF-8 text: {error})") from None
    return parse(text, path)


def parse(text: str, origin: str) -> dict[str, dict[int, Entry]]:
    """The tables of a document in the file format; ValueError naming `origin` otherwise."""
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{origin}: not a {FILE_FORMAT} file (not JSON: {error})") from None
    if not isinstance(document, dict) or document.get("format") != FILE_FORMAT:
        found = document.get("format") if isinstance(document, dict) else type(document).__name__
        raise ValueError(f"{origin}: not a {FILE_FORMAT} file (format {found!r})")
    if document.get("version") not in READABLE_VERSIONS:
        raise ValueError(f"{origin}: {FILE_FORMAT} version {document.get('version')!r}; "
                         f"this reader knows versions {READABLE_VERSIONS}")
    tables = document.get("tables")
    if not isinstance(tables, dict):
        raise ValueError(f"{origin}: 'tables' must be an object")  # noqa: TRY004 (a malformed file)
    parsed: dict[str, dict[int, Entry]] = {}
    for name, entries in tables.items():
        if not isinstance(entries, dict):
            raise ValueError(f"{origin}: table {name} must be an object")  # noqa: TRY004 (a malformed file)
        parsed[name] = {}
        for key, fields in entries.items():
            try:
                number = _parse_key(key)
                parsed[name][number] = _parse_entry(fields)
            except ValueError as error:
                raise ValueError(f"{origin}: entry {key!r} of table {name}: {error}") from None
    return parsed


def _parse_key(key: str) -> int:
    if not key.isdigit():
        raise ValueError("a key is a non-negative integer")
    return int(key)


def _parse_entry(fields: Any) -> Entry:
    names = {"r", "d", "algo", "seconds", "trials"}
    if not isinstance(fields, dict) or set(fields) - {"flow"} != names:
        raise ValueError('expected an object with "r", "d", "algo", "seconds", "trials" (and "flow")')
    r, d, algo, seconds, trials = (fields[name] for name in ("r", "d", "algo", "seconds", "trials"))
    flow = fields.get("flow", "expert")  # absent in version 1
    ints = (r, d, trials)
    if any(isinstance(n, bool) or not isinstance(n, int) for n in ints) or r < 0 or d < 1 or trials < 0:
        raise ValueError(f"r >= 0, d >= 1 and trials >= 0 must be ints, got {r!r}, {d!r}, {trials!r}")
    if algo not in ALGOS:
        raise ValueError(f"unknown algorithm {algo!r}")
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < math.inf:
        raise ValueError(f"seconds must be a finite number >= 0, got {seconds!r}")
    return Entry(Config(r, d, algo, flow), float(seconds), trials)
