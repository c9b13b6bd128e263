"""Compile deterministic mode's kernels for a Hopper GPU (sm_90) on this machine, without one:
`python -m tests.compile_hopper` (Triton's interpreter must be off; `test_kernels_compile` runs it
in a process of its own). Prints one line per kernel variant; exits 3 where this Triton cannot
compile ahead of time (no such API, or no ptxas), 1 on a compile error."""
from __future__ import annotations

import inspect
import sys
import traceback

from drafttree.kernels import gemm_kernel, invariant_attn, norm_kernel
from drafttree.kernels.triton_jit import cdiv, jit_kernel

ATTN = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "pre_ptr": "*i32", "tail_ptr": "*i32",
        "cnt_ptr": "*i32", "kvs_ptr": "*i32", "o_ptr": "*bf16", "acc_ptr": "*fp32", "ml_ptr": "*fp32", "scale": "fp32"}
H100_SHARED = 232448   # sm_90's largest shared memory per block (227 KiB)
TILE_DATA = ("x_ptr", "d_ptr", "g_ptr", "w_ptr", "b_ptr", "sc_ptr", "xo_ptr", "y_ptr")   # in the model's dtype


def tiles(dtype: str) -> dict[str, str]:
    return {p: f"*{dtype}" for p in TILE_DATA} | {"ws_ptr": "*fp32", "ss_ptr": "*fp32", "eps": "fp32"}


def variants():
    """(name, kernel, unspecialized ints, argument types, constexprs, options) of every variant."""
    for inline in (0, 1):
        for paged in (0, 1):
            yield (f"attention inline={inline} paged={paged}", invariant_attn._attn_kernel, ("W", "L", "NS"), ATTN,
                   dict(G=4, HKV=8, HD=128, GP=16, BN=invariant_attn.BLOCK_N, CB=invariant_attn.CHUNK_BLOCKS,
                        PREC="tf32", INLINE=inline, PAGED=paged, PDL=1), {"enable_fp_fusion": False})
    yield ("fold", invariant_attn._fold_kernel, ("NS",),
           {"cnt_ptr": "*i32", "o_ptr": "*bf16", "acc_ptr": "*fp32", "ml_ptr": "*fp32"},
           dict(G=3, HKV=3, HD=64, GP=16, CHUNK=invariant_attn.CHUNK, PDL=1), {"enable_fp_fusion": False})
    yield ("norm", norm_kernel._add_rms_norm_kernel, (),
           {p: "*bf16" for p in ("x_ptr", "d_ptr", "g_ptr", "xo_ptr", "y_ptr")} | {"eps": "fp32"},
           dict(D=4096, BD=norm_kernel.BLOCK, HAS_D=1, PDL=1), {})
    # bf16 at each row tile; fp32 (its inputs twice as wide) at the one it keeps
    shapes = [(N, K, bm, "bf16") for (N, K), bm in zip(((960, 576), (6144, 4096), (6144, 4096)), gemm_kernel.INVARIANT_ROWS)]
    shapes.append((6144, 4096, gemm_kernel.INVARIANT_ROWS[0], "fp32"))
    for kind in ("norm", "plain", "glu"):
        for N, K, bm, dt in shapes:
            bn, bk, warps, stages = gemm_kernel.INVARIANT_BLOCKS[kind]
            ks = cdiv(cdiv(K, gemm_kernel.invariant_split(kind, N, K)), bk) * bk
            normed = int(kind != "plain")
            yield (f"tiles {kind} {N}x{K} rows {bm} {dt}", gemm_kernel._gemm_kernel, ("M", "N"), tiles(dt),
                   dict(K=K, HAS_D=normed, HAS_B=0, NORM=normed, GLU=int(kind == "glu"), W8=0, BM=bm, BN=bn, BK=bk,
                        KS=ks, SPLIT=cdiv(K, ks), STAGES=stages, PRE=0, PDL=1),
                   {"num_warps": warps, "num_stages": stages})


def main() -> int:
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as e:
        print(f"cannot compile ahead of time: {e}")
        return 3
    failed = 0
    for name, fn, unspecialized, types, const, options in variants():
        sig = {p: "constexpr" if p in const else types.get(p, "i32") for p in inspect.signature(fn).parameters}
        try:
            k = triton.compile(ASTSource(jit_kernel(fn, False, unspecialized), sig, const),
                               target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, **options})
            if k.metadata.shared > H100_SHARED:
                raise RuntimeError(f"{k.metadata.shared} bytes of shared memory, over sm_90's {H100_SHARED}")
            print(f"ok {name} ({k.metadata.shared} bytes shared)")
        except Exception as e:   # noqa: BLE001  (every failure is reported, then the exit code says)
            if "ptxas" in str(e) and "not found" in str(e).lower():
                print(f"cannot compile ahead of time: {e}")
                return 3
            failed += 1
            print(f"FAILED {name}: {type(e).__name__}: {e}")
            traceback.print_exc()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
