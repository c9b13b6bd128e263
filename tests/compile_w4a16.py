"""Compile the W4A16 kernels (`kernels/int4_kernel.py`, `kernels/int4_moe_kernel.py`) for a Hopper
GPU (sm_90) on this machine, without one: `python -m tests.compile_w4a16` (Triton's interpreter
must be off; `test_w4a16` runs it in a process of its own). `tests.compile_hopper`'s loop over
these variants: one line per variant, exit 3 where this Triton cannot compile ahead of time, 1 on
a compile error."""
from __future__ import annotations

import sys

from drafttree.kernels import int4_kernel, int4_moe_kernel
from tests import compile_hopper

D, I, E, G = 7168, 2048, 48, 32   # Kimi K2's expert shapes, one rank's experts, its group size
MOE = {"x_ptr": "*bf16", "p_ptr": "*i32", "s_ptr": "*bf16", "pairs_ptr": "*i32", "tiles_ptr": "*i32",
       "h_ptr": "*bf16", "cw_ptr": "*fp32", "y_ptr": "*bf16"}


def linear_types(dt: str) -> dict[str, str]:
    return {"x_ptr": f"*{dt}", "p_ptr": "*i32", "s_ptr": "*bf16", "b_ptr": f"*{dt}", "y_ptr": f"*{dt}"}


def variants():
    """(name, kernel, unspecialized ints, argument types, constexprs, options) of each variant: the
    GEMV, the tiles at decode and prefill rows (bf16, and fp16 inputs with bf16 scales), and both
    grouped GEMMs at decode and prefill tiles."""
    g = int4_kernel.GEMV
    yield ("gemv", int4_kernel._gemv_kernel, ("N", "nib"), linear_types("bf16"),
           dict(K=D, G=G, HAS_B=1, BN=g.bn, BKW=int4_kernel.step_words(g.bkw, G), STAGES=g.stages, PDL=1),
           {"num_warps": g.warps, "num_stages": g.stages})
    for rows, dt in ((16, "bf16"), (2048, "bf16"), (16, "fp16")):
        b = int4_kernel.blocks_for(rows)
        yield (f"tiles rows {rows} {dt}", int4_kernel._gemm_kernel, ("M", "N", "nib"), linear_types(dt),
               dict(K=D, G=G, HAS_B=1, SCALE_DT=int(dt == "bf16"), BM=b.bm, BN=b.bn, BKW=b.bkw, STAGES=b.stages,
                    PDL=1), {"num_warps": b.warps, "num_stages": b.stages})
    for pairs in (8, 2048 * 8, 8192 * 8):   # a decode's, and prefill chunks' (64 and 128 slots a tile)
        b = int4_moe_kernel.blocks_for(pairs * E // 384, E)
        common = dict(E=E, D=D, I=I, G=G, SCALE_DT=1, BM=b.bm, BKW=b.bkw, STAGES=b.stages, PDL=1)
        options = {"num_warps": b.warps, "num_stages": b.stages}
        yield (f"experts gate/up {b.bm} slots", int4_moe_kernel._gate_up_kernel, ("P", "nib"), MOE,
               dict(common, TOPK=8, BN=b.bn_up), options)
        yield (f"experts down {b.bm} slots", int4_moe_kernel._down_kernel, ("P", "nib"), MOE,
               dict(common, BN=b.bn_down), options)
    g = int4_moe_kernel.GEMV
    common = dict(E=E, D=D, I=I, G=G, BN=g.bn, BKW=int4_kernel.step_words(g.bkw, G), STAGES=g.stages, PDL=1)
    options = {"num_warps": g.warps, "num_stages": g.stages}
    ids = {"ids_ptr": "*i64"}
    yield ("experts gate/up GEMV", int4_moe_kernel._gate_up_gemv_kernel, ("nib",), {**MOE, **ids},
           dict(common, TOPK=8), options)
    yield ("experts down GEMV", int4_moe_kernel._down_gemv_kernel, ("nib",), {**MOE, **ids}, common, options)


if __name__ == "__main__":
    compile_hopper.variants = variants   # the same loop, over these kernels
    sys.exit(compile_hopper.main())
