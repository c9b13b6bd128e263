"""Block shapes for the fused projections from a sweep's file (`DRAFTTREE_BLOCKS=path.json`).

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

from drafttree.kernels import gemm_kernel

Table = dict[str, list[tuple[int, Any]]]
ONE_ROW, FEW_ROWS = 4, 8   # fields of gemv_kernel.Blocks, gemm_kernel.Blocks


def load(path: str, one_row: Table, few_rows: Table) -> None:
    """Apply the sweep file at `path` to the GEMVs' table `one_row` and the tiles' `few_rows`."""
    try:
        with open(path) as f:
            rows = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"DRAFTTREE_BLOCKS={path}: cannot read a sweep file ({e})") from e
    for row in rows if isinstance(rows, list) else [rows]:
        kind, numel, blocks, times = _parse(path, row, one_row)
        if blocks is not None and len(blocks) == ONE_ROW:
            gemm_kernel.set_blocks(kind, numel, blocks, split=True, table=one_row)
            continue
        if blocks is not None and times and times[0] >= times[1]:
            blocks = None   # the tiles lost to the torch ops on that matrix
        if blocks is not None and len(blocks) == FEW_ROWS - 1:
            blocks = [*blocks, 0]
        gemm_kernel.set_blocks(kind, numel, blocks, split=True, table=few_rows)


def _parse(path: str, row: Any, one_row: Table) -> tuple[str, int, list[int] | None, list[float]]:
    blocks = row[2] if isinstance(row, list) and len(row) > 2 else None
    fields_ok = blocks is None or (isinstance(blocks, list) and len(blocks) in (ONE_ROW, FEW_ROWS - 1, FEW_ROWS)
                                   and all(isinstance(v, int) and (v > 0 or v == 0 and i == FEW_ROWS - 1)
                                           for i, v in enumerate(blocks)))   # only the steps before the wait may be 0
    ok = (isinstance(row, list) and len(row) in (3, 5) and row[0] in one_row and isinstance(row[1], int)
          and row[1] > 0 and fields_ok)
    if not ok:
        raise ValueError(f"DRAFTTREE_BLOCKS={path}: row {row!r} is not [kernel ({', '.join(one_row)}), weight "
                         f"elements, blocks ({ONE_ROW}, {FEW_ROWS - 1} or {FEW_ROWS} positive ints, the steps "
                         "before the wait may be 0; or null)(, µs, torch ops' µs)]")
    return row[0], row[1], row[2], [float(t) for t in row[3:]]
