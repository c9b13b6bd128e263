"""Where the top-K chunk kernel's time goes, and cheaper filters (H200; draft logits [15, 151,936]
bf16, k = 32). Each variant's chunk kernel is timed alone and with the production merge; every
variant's output must equal top_log_probs_fused's.

MODE 0: load, max, sum of exp only (the floor of one read)
MODE 1: the production filter: int64 keys, strided group maxima, cumsum + scatter
MODE 2: float32 strided group maxima and threshold, cumsum + scatter of the int64 keys
MODE 3: float32 contiguous group maxima (in-thread reductions), cumsum + scatter
MODE 4: MODE 3 with a per-program atomic counter for the slots instead of the cumsum
MODE 5: MODE 3, but no tl.topk: the threshold is the smallest group maximum with fewer than K2
        larger ones (a [G, G] count), and each candidate's rank is a [CAP, CAP] count (keys are
        distinct), so it is stored at its rank
MODE 6: MODE 5 with the atomic slots of MODE 4
MODE 7: MODE 5's threshold, MODE 3's final tl.topk

    python topk_ablation.py        (CUDA)
"""
import torch
import triton
import triton.language as tl

from drafttree.bench.graph_timer import graphed_us
from drafttree.spec import topk_kernel
from drafttree.spec.topk_kernel import top_log_probs_fused
from drafttree.triton_jit import jit_kernel, next_pow2


@triton.jit
def chunk(x_ptr, key_ptr, m_ptr, s_ptr, scr_ptr, cnt_ptr, V, NC, CHUNK: tl.constexpr, K2: tl.constexpr,
          GROUPS: tl.constexpr, CAP: tl.constexpr, MODE: tl.constexpr):
    row, c = tl.program_id(0), tl.program_id(1)
    tok = c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row.to(tl.int64) * V + tok, mask=tok < V, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    s = tl.sum(tl.where(x == float("-inf"), 0.0, tl.exp(x - m)), axis=0)
    out = row * NC + c
    tl.store(m_ptr + out, m)
    tl.store(s_ptr + out, s)
    if MODE > 0:
        bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
        ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        key = (ordered.to(tl.int64) << 32) | (2147483647 - tok).to(tl.int64)
        key = tl.where(tok < V, key, -(2**63))
        if MODE == 1:
            gmax = tl.max(tl.reshape(key, [CHUNK // GROUPS, GROUPS]), 0)
            cand = (key >= tl.min(tl.topk(gmax, K2), 0)) & (tok < V)
        elif MODE == 2:
            gmax = tl.max(tl.reshape(x, [CHUNK // GROUPS, GROUPS]), 0)
            cand = (x >= tl.min(tl.topk(gmax, K2), 0)) & (tok < V)
        elif MODE == 3 or MODE == 4:
            gmax = tl.max(tl.reshape(x, [GROUPS, CHUNK // GROUPS]), 1)
            cand = (x >= tl.min(tl.topk(gmax, K2), 0)) & (tok < V)
        else:
            gmax = tl.max(tl.reshape(x, [GROUPS, CHUNK // GROUPS]), 1)
            above = tl.sum((gmax[None, :] > gmax[:, None]).to(tl.int32), 1)
            cand = (x >= tl.min(tl.where(above < K2, gmax, float("inf")), 0)) & (tok < V)
        if tl.sum(cand.to(tl.int32), 0) <= CAP:
            slot = tl.arange(0, CAP)
            buf = scr_ptr + out.to(tl.int64) * CAP
            tl.store(buf + slot, tl.full([CAP], -(2**63), tl.int64) + slot)   # distinct pads
            if MODE == 4 or MODE == 6:
                tl.store(cnt_ptr + out, 0)
            tl.debug_barrier()
            if MODE == 4 or MODE == 6:
                at = tl.atomic_add(cnt_ptr + out + tl.zeros_like(tok), 1, mask=cand, sem="relaxed")
            else:
                at = tl.cumsum(cand.to(tl.int32), 0) - 1
            tl.store(buf + at, key, mask=cand)
            tl.debug_barrier()
            b = tl.load(buf + slot)
            if MODE == 5 or MODE == 6:
                rank = tl.sum((b[None, :] > b[:, None]).to(tl.int32), 1)
                tl.store(key_ptr + out * K2 + rank, b, mask=rank < K2)
            else:
                tl.store(key_ptr + out * K2 + tl.arange(0, K2), tl.topk(b, K2))
        else:
            tl.store(key_ptr + out * K2 + tl.arange(0, K2), tl.topk(key, K2))


def run(x, k, mode, ch, warps, merge=True):
    R, L, V = x.shape
    rows, k2, nc = R * L, max(2, next_pow2(k)), -(-V // ch)
    groups, cap = topk_kernel.filter_plan(k2, ch)[:2]
    keys = torch.empty(rows, nc, k2, dtype=torch.int64, device=x.device)
    m = torch.empty(rows, nc, device=x.device)
    s = torch.empty_like(m)
    scr = torch.empty(rows * nc * cap, dtype=torch.int64, device=x.device)
    cnt = torch.empty(rows * nc, dtype=torch.int32, device=x.device)
    chunk[(rows, nc)](x, keys, m, s, scr, cnt, V, nc, CHUNK=ch, K2=k2, GROUPS=groups, CAP=cap, MODE=mode,
                      num_warps=warps)
    if not merge:
        return None
    lp = torch.empty(R, L, k, device=x.device)
    idx = torch.empty(R, L, k, dtype=torch.int64, device=x.device)
    jit_kernel(topk_kernel._merge_kernel, not x.is_cuda)[(rows,)](keys, m, s, lp, idx, nc, k, NC_PAD=next_pow2(nc), K2=k2,
                                                         PDL=False, num_warps=topk_kernel.MERGE_WARPS)
    return lp, idx


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", default="32,8")
    ap.add_argument("--modes", default="0,1,2,3,4,5,6,7")
    ap.add_argument("--chunks", default="4096,8192")
    ap.add_argument("--warps", default="4,8")
    a = ap.parse_args()
    torch.manual_seed(0)
    for k in (int(v) for v in a.k.split(",")):
        x = torch.randn(1, 15, 151936, device="cuda").mul_(4).to(torch.bfloat16)
        ref = top_log_probs_fused(x, k)
        print(f"k = {k}: production top-K {graphed_us(lambda: top_log_probs_fused(x, k)):.1f} us")
        print(f"{'mode':>4} {'chunk':>6} {'warps':>5} {'chunk kernel':>12} {'+ merge':>8}")
        for mode in (int(v) for v in a.modes.split(",")):
            for ch in (int(v) for v in a.chunks.split(",")):
                for w in (int(v) for v in a.warps.split(",")):
                    alone = graphed_us(lambda: run(x, k, mode, ch, w, merge=False))
                    both = float("nan")
                    if mode:
                        lp, idx = run(x, k, mode, ch, w)
                        ok = torch.equal(idx, ref[1]) and torch.allclose(lp, ref[0], atol=1e-5)
                        both = graphed_us(lambda: run(x, k, mode, ch, w)) if ok else float("nan")
                        if not ok:
                            print(f"  mode {mode} chunk {ch}: WRONG")
                    print(f"{mode:>4} {ch:>6} {w:>5} {alone:12.1f} {both:8.1f}", flush=True)
