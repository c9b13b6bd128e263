"""Compile the fp8 block kernels (`fp8_block_kernel`, `fp8_block_moe`) for a Hopper GPU (sm_90) on
this machine, without one, at the code's blocks and DeepSeek-V3's shapes: `python -m
tests.compile_fp8_blocks` (Triton's interpreter must be off; `test_fp8_blocks` runs it in a process
of its own). What the interpreter accepts but the GPU compiler would reject (layouts, e4m3
conversions into a dot's operand, shared memory past sm_90's) fails here. Pointers are compiled
16-byte aligned, as the launches specialize them. Prints one line per variant (shared memory,
and where Triton's cuobjdump is found, registers and local memory: spills); exits 3 where this
Triton cannot compile ahead of time, 1 on a compile error, shared memory past the limit or a
spill."""
from __future__ import annotations

import inspect
import re
import shutil
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

from drafttree.kernels import fp8_block_kernel, fp8_block_moe
from drafttree.kernels.gemm_kernel import FINISH_BLOCK, _finish_kernel
from drafttree.kernels.triton_jit import cdiv, jit_kernel
from tests.compile_hopper import H100_SHARED

Q = (128, 128)
D, I, E = 7168, 2048, 48   # DeepSeek-V3 / Kimi K2 experts, 48 on a rank
LINEAR = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "b_ptr": "*bf16", "y_ptr": "*bf16",
          "ws_ptr": "*fp32"}
EXPERTS = {"x_ptr": "*bf16", "h_ptr": "*bf16", "y_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32",
           "pairs_ptr": "*i32", "tiles_ptr": "*i32", "cw_ptr": "*fp32"}


def linear_variant(M: int, N: int, K: int, bias: bool):
    b = fp8_block_kernel.blocks_for(M)
    p = fp8_block_kernel.plan(M, N, K, Q, b)
    const = dict(N=N, K=K, QN=Q[0], QK=Q[1], SK=cdiv(K, Q[1]), HAS_B=int(bias and p.split == 1), BM=p.bm, BN=b.bn,
                 TILES_N=cdiv(N, b.bn), BK=p.bk, KS=p.ks, SPLIT=p.split, GROUP=b.group, STAGES=b.stages, PDL=1)
    return (f"linear {K}->{N} rows {M} split {p.split}", fp8_block_kernel._linear_kernel, ("M",), LINEAR, const,
            {"num_warps": b.warps, "num_stages": b.stages})


def variants():
    """(name, kernel, unspecialized ints, argument types, constexprs, options) of every variant:
    the linear at each row class (the dense MLP's 7168 -> 18432; kv_a's 576 outputs and an input
    edge block in splits, with a bias), the splits' finish, and the grouped experts at each tile
    class."""
    for most, _ in fp8_block_kernel.ROW_BLOCKS:
        yield linear_variant(min(most, 2048), 18432, 7168, bias=False)
    yield linear_variant(1, 576, 1536 + 64, bias=True)
    yield ("finish", _finish_kernel, ("M", "N"), {"ws_ptr": "*fp32", "ss_ptr": "*bf16", "b_ptr": "*bf16",
                                                  "y_ptr": "*bf16", "eps": "fp32"},
           dict(K=7168, HAS_B=1, NORM=0, GLU=0, SPLIT=28, BN=FINISH_BLOCK, PDL=1), {"num_warps": 4})
    for _, b in fp8_block_moe.TILE_BLOCKS:
        bk = fp8_block_kernel.step_inputs(b.bk, Q[1])
        common = dict(E=E, D=D, I=I, QN=Q[0], QK=Q[1], BM=b.bm, BK=bk, STAGES=b.stages, PDL=1)
        opts = {"num_warps": b.warps, "num_stages": b.stages}
        yield (f"experts gate/up {tuple(b)}", fp8_block_moe._gate_up_kernel, ("P",), EXPERTS,
               dict(common, TOPK=8, SN=cdiv(2 * I, Q[0]), SK=cdiv(D, Q[1]), BN=b.bn_up), opts)
        yield (f"experts down {tuple(b)}", fp8_block_moe._down_kernel, ("P",), EXPERTS,
               dict(common, SN=cdiv(D, Q[0]), SK=cdiv(I, Q[1]), BN=b.bn_down), opts)


def resources(cubin: bytes) -> dict[str, int] | None:
    """Registers and local memory per thread from Triton's cuobjdump (None where it is missing)."""
    import triton
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    tool_path = str(tool) if tool.exists() else shutil.which("cuobjdump")
    if tool_path is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool_path, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+).*LOCAL:(\d+)", out)
    return None if found is None else {"registers": int(found[1]), "local": int(found[2])}


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
        params = list(inspect.signature(fn).parameters)
        sig = {p: "constexpr" if p in const else types.get(p, "i32") for p in params}
        aligned = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params) if sig[p].startswith("*")}
        try:
            k = triton.compile(ASTSource(jit_kernel(fn, False, unspecialized), sig, const, aligned),
                               target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, **options})
            if k.metadata.shared > H100_SHARED:
                raise RuntimeError(f"{k.metadata.shared} bytes of shared memory, over sm_90's {H100_SHARED}")
            use = resources(k.asm["cubin"])
            if use is not None and use["local"] > 0:
                raise RuntimeError(f"{use['local']} bytes of local memory a thread: registers spilled")
            extra = "" if use is None else f", {use['registers']} registers"
            print(f"ok {name} ({k.metadata.shared} bytes shared{extra})")
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
