"""Block-shape tables of the fused projections, and a sweep's file over them (`settings.blocks`,
DRAFTTREE_BLOCKS=path.json).

A table maps a kernel ("norm", "plain", "glu") to classes (least weight elements, blocks), largest
first: a weight takes the first class it reaches (`lookup`).

`benchmarks/gemv_bench.py --out` writes one row per matrix: [kernel, weight elements, blocks,
µs, torch ops' µs]. A one-row sweep's blocks (4 fields) go to the GEMVs' table; a few-row sweep's
(8 fields; 7 from sweeps older than the steps loaded before the PDL wait, which then load none)
go to the tiles' table where they beat the torch ops, and None (the torch ops) where they did
not. A row may also be just [kernel, weight elements, blocks], blocks null for the torch ops.
Each row gets a class of its own, from the power of two at or below its weight elements, so a
file tunes the code's tables for another GPU or model without editing them.
"""
from __future__ import annotations

import json
from typing import Any

from drafttree.settings import current, env_name

Table = dict[str, list[tuple[int, Any]]]
ONE_ROW, FEW_ROWS = 4, 8   # fields of gemv_kernel.Blocks, gemm_kernel.Blocks
_APPLIED: dict[tuple[str, bool], Table] = {}   # by sweep file: engines with different files get each their own


def lookup(table: Table, kind: str, numel: int) -> Any:
    """The blocks of the first class (largest first) that `numel` weight elements reach."""
    return next(blocks for least, blocks in table[kind] if numel >= least)


def assign(table: Table, kind: str, numel: int, blocks: Any, split: bool = False) -> None:
    """Give weights of `numel` elements `blocks`: in the class they fall in, or (`split`) in a new
    class from the power of two at or below `numel` (from a sweep per matrix)."""
    classes = table[kind]
    at = next(i for i, (least, _) in enumerate(classes) if numel >= least)
    least = 1 << (numel.bit_length() - 1) if split else classes[at][0]
    blocks = None if blocks is None else tuple(blocks)
    if least == classes[at][0]:
        classes[at] = (least, blocks)
    else:
        classes.insert(at, (least, blocks))


def in_force(table: Table, one_row: bool) -> Table:
    """`table` (the GEMVs' if `one_row`, else the tiles'), or a copy of it with the settings'
    sweep file applied, made at its first use."""
    path = current().blocks
    if path is None:
        return table
    key = (path, one_row)
    if key not in _APPLIED:
        copy = {kind: list(classes) for kind, classes in table.items()}
        load(path, *((copy, None) if one_row else (None, copy)))
        _APPLIED[key] = copy
    return _APPLIED[key]


def load(path: str, one_row: Table | None, few_rows: Table | None) -> None:
    """Apply the sweep file at `path` to the GEMVs' table `one_row` and the tiles' `few_rows`
    (either may be None: that table's rows are checked, not applied)."""
    var = env_name("blocks")
    try:
        with open(path) as f:
            rows = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{var}={path}: cannot read a sweep file ({e})") from e
    kinds = (one_row or few_rows or {}).keys()
    for row in rows if isinstance(rows, list) else [rows]:
        kind, numel, blocks, times = _parse(var, path, row, kinds)
        if blocks is not None and len(blocks) == ONE_ROW:
            if one_row is not None:
                assign(one_row, kind, numel, blocks, split=True)
            continue
        if blocks is not None and times and times[0] >= times[1]:
            blocks = None   # the tiles lost to the torch ops on that matrix
        if blocks is not None and len(blocks) == FEW_ROWS - 1:
            blocks = [*blocks, 0]
        if few_rows is not None:
            assign(few_rows, kind, numel, blocks, split=True)


def _parse(var: str, path: str, row: Any, kinds: Any) -> tuple[str, int, list[int] | None, list[float]]:
    blocks = row[2] if isinstance(row, list) and len(row) > 2 else None
    fields_ok = blocks is None or (isinstance(blocks, list) and len(blocks) in (ONE_ROW, FEW_ROWS - 1, FEW_ROWS)
                                   and all(isinstance(v, int) and (v > 0 or v == 0 and i == FEW_ROWS - 1)
                                           for i, v in enumerate(blocks)))   # only the steps before the wait may be 0
    ok = (isinstance(row, list) and len(row) in (3, 5) and row[0] in kinds and isinstance(row[1], int)
          and row[1] > 0 and fields_ok)
    if not ok:
        raise ValueError(f"{var}={path}: row {row!r} is not [kernel ({', '.join(kinds)}), weight "
                         f"elements, blocks ({ONE_ROW}, {FEW_ROWS - 1} or {FEW_ROWS} positive ints, the steps "
                         "before the wait may be 0; or null)(, µs, torch ops' µs)]")
    return row[0], row[1], row[2], [float(t) for t in row[3:]]
