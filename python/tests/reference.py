"""The workload of the tests and an independent reference of what xccl promises, in numpy and
ml_dtypes (no xccl, no torch): the expert function, the exact combine order, and the data each
rank sends."""

from __future__ import annotations

import ml_dtypes
import numpy as np

DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}
BITS = {"f32": np.uint32, "f16": np.uint16, "bf16": np.uint16}


def expert_scale(e: int) -> np.float32:
    """Expert ``e`` multiplies its input by this (in f32) and rounds to the dtype."""
    return np.float32((e % 5 + 1) * 0.375)


def expert_fn(x, e: int, dtype: str):
    """What expert ``e`` outputs for rows ``x`` (of the dtype): dtype(f32(x) * s_e)."""
    return (x.astype(np.float32) * expert_scale(e)).astype(DTYPES[dtype])


def workload(seed: int, rnd: int, a_index: int, tokens: int, hidden: int, topk: int, E: int, dtype):
    """Attention index ``a_index``'s tokens of round ``rnd``: x ``[T, hidden]`` of the dtype,
    ``topk_idx`` ``[T, topk]`` int64 (distinct experts, some slots -1, at least one expert per
    token), weights ``[T, topk]`` float32."""
    rng = np.random.default_rng([seed, rnd, a_index])
    x = rng.standard_normal((tokens, hidden), dtype=np.float32).astype(DTYPES[dtype])
    idx = np.full((tokens, topk), -1, dtype=np.int64)
    for t in range(tokens):
        k = int(rng.integers(1, topk + 1))
        idx[t, :k] = rng.choice(E, size=k, replace=False)
        rng.shuffle(idx[t])
    w = rng.uniform(0.1, 1.0, size=(tokens, topk)).astype(np.float32)
    return x, idx, w


def combine(x, idx, w, rank_of_expert, dtype: str):
    """The exact E2A result: on each expert rank ``acc = 0; acc += w_e * f32(y_e)`` over its
    experts in ascending id, rounded once to the dtype; on the attention rank a single
    contribution as is, several summed in f32 in ascending expert-rank order and rounded once."""
    dt = DTYPES[dtype]
    out = np.zeros(x.shape, dtype=dt)
    for t in range(x.shape[0]):
        per_rank: dict[int, list] = {}
        for e, wt in zip(idx[t], w[t]):
            if e >= 0:
                per_rank.setdefault(rank_of_expert[int(e)], []).append((int(e), wt))
        contributions = []
        for r in sorted(per_rank):
            acc = np.zeros(x.shape[1], dtype=np.float32)
            for e, wt in sorted(per_rank[r]):
                y = expert_fn(x[t : t + 1], e, dtype)[0]
                acc = acc + np.float32(wt) * y.astype(np.float32)
            contributions.append(acc.astype(dt))
        if len(contributions) == 1:
            out[t] = contributions[0]
        elif contributions:
            s = np.zeros(x.shape[1], dtype=np.float32)
            for c in contributions:
                s = s + c.astype(np.float32)
            out[t] = s.astype(dt)
    return out


def first_difference(got, want, dtype: str):
    """``None`` if ``got`` and ``want`` are bit-identical, else (index, got bits, want bits)."""
    g = np.ascontiguousarray(got).view(BITS[dtype])
    w = np.ascontiguousarray(want).view(BITS[dtype])
    if g.shape != w.shape:
        return ("shape", list(g.shape), list(w.shape))
    diff = np.argwhere(g != w)
    if len(diff) == 0:
        return None
    i = tuple(int(v) for v in diff[0])
    return (list(i), int(g[i]), int(w[i]))
