"""numpy twins of every CUDA kernel, run by the fake driver (kernels/cuda/fake.py).

Each twin takes the kernel's arguments by name (kernels/cuda/kernels.py) and the launch grid,
checks what the real kernel requires of them (grid coverage, widths, alignment, workspace),
and computes the kernel's result with kernels/model.py's and kernels/sampling.py's rules. They
follow the kernels' contracts, not their arithmetic order: numerics are the GPU tests' job.
"""

from types import SimpleNamespace

import numpy as np

from .. import sampling as ref_sampling
from ..reference import dequantize_int4
from .kernels import MAX_TOP_LOGPROBS, MM_PROBES, MM_PRODUCTS
from .layout import TcShape, dequantize_tc, glu_row_order, pack_tc, rope_row_order, round_up


def _f32(d, ptr, rows, ld):
    return d.view(ptr, np.float32, rows * ld).reshape(rows, ld)


def _store(d, y, ldy, out: np.ndarray, accumulate):
    M, N = out.shape
    dst = _f32(d, y, M, ldy)[:, :N]
    dst[...] = (dst + out) if accumulate else out


def _int4_tc(d, grid, x, ldx, M, qw, sz, num_units, group_size, units_per_split, bias, y, ldy, N, accumulate,
             ws, counters, tokens, fp16):
    out = _int4_tc_product(d, grid, _f32(d, x, M, ldx)[:, :num_units * 128], M, qw, sz, num_units, group_size,
                           units_per_split, bias, N, ws, counters, tokens, fp16, ldx)
    _store(d, y, ldy, out, accumulate)


def _int4_tc_product(d, grid, xs, M, qw, sz, num_units, group_size, units_per_split, bias, N, ws, counters, tokens,
                     fp16, ldx) -> np.ndarray:
    """x W^T (+ bias) [M, N] in the weights' device row order, after the launch checks."""
    Np, Kp = round_up(N, 128), num_units * 128
    assert grid[0] * 128 == Np and grid[1] * tokens >= M, f"grid {grid} does not cover M={M} N={N}"
    assert grid[2] * units_per_split >= num_units > (grid[2] - 1) * units_per_split, f"K splits {grid}"
    assert ldx >= Kp and ldx % 4 == 0, f"activation width {ldx} vs padded K {Kp}"
    if grid[2] > 1:       # the partials and counters the kernel would use must exist and be re-armed
        d.view(ws, np.float32, grid[2] * grid[1] * tokens * Np)
        assert not d.view(counters, np.int32, grid[0] * grid[1]).any(), "K-split counters not re-armed"
    key = (qw, sz, N, num_units, group_size)
    w = d._weights_cache.get(key)
    if w is None:
        shape = TcShape(N, Kp, group_size, Np, Kp, Np // 16, Kp // 64, Kp // group_size, num_units)
        w = d._weights_cache[key] = dequantize_tc(d.view(qw, np.uint32, shape.qw_words),
                                                   d.view(sz, np.uint32, shape.sz_words), shape)
    if fp16:
        xs = xs.astype(np.float16).astype(np.float32)
    out = xs @ w.T
    if bias:
        out = out + d.view(bias, np.float32, N)
    return out.astype(np.float32)


def _int4_tc_fused(d, grid, x, ldx, M, qw, sz, num_units, group_size, units_per_split, bias, y, ldy, N, accumulate,
                   ws, counters, norm_w, norm_dim, eps, positions, slot_mapping, cos_sin, max_positions, q_out, ldq,
                   k_cache, v_cache, num_heads, num_kv_heads, head_dim, argmax_keys, argmax_counters, out_tokens,
                   tokens, fp16, epilogue, normed):
    """int4_matmul.cu's fused kernels: RMSNorm prologue (none when `normed`, the "_xn" kernels:
    rmsnorm ran first), then the epilogue on the device-order rows."""
    assert not accumulate, "the fused products never accumulate"
    Kp = num_units * 128
    src = _f32(d, x, M, ldx)[:, :norm_dim]
    xs = np.zeros((M, Kp), dtype=np.float32)
    xs[:, :norm_dim] = src if normed else src / _rms_denoms_of(src, eps) * d.view(norm_w, np.float32, norm_dim)
    out = _int4_tc_product(d, grid, xs, M, qw, sz, num_units, group_size, units_per_split, bias, N, ws, counters,
                           tokens, fp16, ldx)
    if epilogue == "argmax":
        assert not d.view(argmax_keys, np.uint64, M).any(), "argmax keys not re-armed"
        assert not d.view(argmax_counters, np.int32, grid[1]).any(), "argmax counters not re-armed"
        _store(d, y, ldy, out, False)
        d.view(out_tokens, np.int32, M)[:] = np.argmax(out, axis=1)
        return
    logical = np.empty_like(out)
    if epilogue in ("silu", "gelu"):
        I = N // 2
        logical[:, glu_row_order(I)] = out
        _f32(d, y, M, ldy)[:, :I] = _glu_act(logical[:, :I], epilogue == "gelu") * logical[:, I:2 * I]
        return
    logical[:, rope_row_order(N // head_dim, head_dim)] = out
    _rope_rows(d, logical, M, positions, slot_mapping, cos_sin, max_positions, q_out, ldq, k_cache, v_cache,
               num_heads, num_kv_heads, head_dim, np.float32 if epilogue == "rope_f32" else np.float16)


def _int4_repack_tc(d, grid, qweight, scales, zeros, N, Kb, num_src_groups, qw, sz, num_tiles, num_chunks, num_groups):
    q = d.view(qweight, np.uint8, N * Kb).reshape(N, Kb)
    s = d.view(scales, np.float16, N * num_src_groups).reshape(N, -1)
    z = d.view(zeros, np.float16, N * num_src_groups).reshape(N, -1)
    words, pairs, shape = pack_tc(q, s, z, 2 * Kb)
    assert (shape.num_tiles, shape.num_chunks, shape.num_groups) == (num_tiles, num_chunks, num_groups)
    assert grid[0] * 256 >= len(words) + len(pairs)
    d.view(qw, np.uint32, len(words))[:] = words
    d.view(sz, np.uint32, len(pairs))[:] = pairs


def _int4_mm_simt(d, grid, x, ldx, M, qweight, scales, zeros, words_per_row, group_size, bias, y, ldy, N, accumulate):
    Kp = words_per_row * 8
    q = d.view(qweight, np.uint8, N * Kp // 2).reshape(N, -1)
    G = Kp // group_size
    w = dequantize_int4(q, d.view(scales, np.float16, N * G).reshape(N, G), d.view(zeros, np.float16, N * G).reshape(N, G), Kp)
    out = _f32(d, x, M, ldx)[:, :Kp] @ w.T
    if bias:
        out = out + d.view(bias, np.float32, N)
    _store(d, y, ldy, out.astype(np.float32), accumulate)


def _dense(dtype):
    def run(d, grid, x, ldx, M, w, ldw, row_scales, bias, y, ldy, N, accumulate):
        assert grid[0] * 4 >= N and grid[1] * 8 >= M and ldx >= ldw and ldw % 8 == 0
        W = d.view(w, dtype, N * ldw).reshape(N, ldw).astype(np.float32)
        out = _f32(d, x, M, ldx)[:, :ldw] @ W.T
        if row_scales:
            out = out * d.view(row_scales, np.float16, N).astype(np.float32)
        if bias:
            out = out + d.view(bias, np.float32, N)
        _store(d, y, ldy, out.astype(np.float32), accumulate)
    return run


def _embed(kind):
    def run(d, grid, token_ids, table, scales, zeros, ldw, group_size, vocab_size, D, multiplier, out, ldo):
        T = grid[0]
        ids = d.view(token_ids, np.int32, T)
        ok = (ids >= 0) & (ids < vocab_size)
        safe = np.where(ok, ids, 0)
        if kind == "i4":
            q = d.view(table, np.uint8, vocab_size * ldw).reshape(vocab_size, ldw)[safe]
            G = ldw * 2 // group_size
            s = d.view(scales, np.float16, vocab_size * G).reshape(vocab_size, G)[safe]
            z = d.view(zeros, np.float16, vocab_size * G).reshape(vocab_size, G)[safe]
            rows = dequantize_int4(q, s, z, D)
        else:
            dt = {"f32": np.float32, "f16": np.float16, "i8": np.int8}[kind]
            rows = d.view(table, dt, vocab_size * ldw).reshape(vocab_size, ldw)[safe, :D].astype(np.float32)
            if kind == "i8":
                rows = rows * d.view(scales, np.float16, vocab_size).astype(np.float32)[safe, None]
        _f32(d, out, T, ldo)[:, :D] = np.where(ok[:, None], rows * np.float32(multiplier), 0.0)
    return run


def _rms_denoms_of(src, eps):
    return np.sqrt(np.mean(src * src, axis=-1, keepdims=True) + np.float32(eps))


def _rmsnorm(d, grid, x, ldx, rows, w, out, ldo, D, eps, accumulate):
    R = grid[0]
    idx = d.view(rows, np.int32, R) if rows else np.arange(R)
    src = _f32(d, x, int(idx.max()) + 1, ldx)[idx, :D]
    res = src / _rms_denoms_of(src, eps) * d.view(w, np.float32, D)
    dst = _f32(d, out, R, ldo)
    dst[:, :D] = dst[:, :D] + res if accumulate else res


def _head_rmsnorm(d, grid, qkv, ldqkv, q_norm, k_norm, num_heads, head_dim, eps):
    T, heads = grid[0], grid[1]
    rows = _f32(d, qkv, T, ldqkv)
    x = rows[:, :heads * head_dim].reshape(T, heads, head_dim)
    w = np.concatenate([np.broadcast_to(d.view(q_norm, np.float32, head_dim), (num_heads, head_dim)),
                        np.broadcast_to(d.view(k_norm, np.float32, head_dim), (heads - num_heads, head_dim))])
    normed = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps)) * w
    rows[:, :heads * head_dim] = normed.reshape(T, -1)


def _logit_softcap(d, grid, logits, ldl, vocab_size, cap):
    rows = _f32(d, logits, grid[0], ldl)
    rows[:, :vocab_size] = np.float32(cap) * np.tanh(rows[:, :vocab_size] / np.float32(cap))


def _glu_act(g, gelu):
    if gelu:                        # common.cuh's act_gelu_tanh: x / (1 + e^(-2u)), no 1 + tanh(u) to cancel
        u = np.float32(np.sqrt(2.0 / np.pi)) * (g + np.float32(0.044715) * g * g * g)
        with np.errstate(over="ignore"):
            return g / (np.float32(1.0) + np.exp(np.float32(-2.0) * u))
    return g / (1.0 + np.exp(-g))


def _glu(gelu):
    def run(d, grid, gate_up, ldg, out, ldo, I):
        T = grid[1]
        assert grid[0] * 256 >= I
        gu = _f32(d, gate_up, T, ldg)
        _f32(d, out, T, ldo)[:, :I] = _glu_act(gu[:, :I], gelu) * gu[:, I:2 * I]
    return run


def _rope_rows(d, rows, T, positions, slot_mapping, cos_sin, max_positions, q_out, ldq, k_cache, v_cache,
               num_heads, num_kv_heads, head_dim, cache_dtype):
    """RoPE of the Q and K heads of `rows` [T, >= (Hq + 2 Hkv) hd] into q_out and the K cache, V into its cache."""
    half = head_dim // 2
    pos = np.clip(d.view(positions, np.int32, T), 0, max_positions - 1)
    slots = d.view(slot_mapping, np.int32, T)
    cs = d.view(cos_sin, np.float32, max_positions * half * 2).reshape(max_positions, half, 2)[pos]
    c, s = cs[:, None, :, 0], cs[:, None, :, 1]
    qk = rows[:, :(num_heads + num_kv_heads) * head_dim].reshape(T, -1, head_dim)
    x1, x2 = qk[..., :half], qk[..., half:]
    rot = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    _f32(d, q_out, T, ldq)[:, :num_heads * head_dim] = rot[:, :num_heads].reshape(T, -1)
    per_slot = num_kv_heads * head_dim
    num_slots = int(slots.max()) + 1
    kc = d.view(k_cache, cache_dtype, num_slots * per_slot).reshape(num_slots, per_slot)
    vc = d.view(v_cache, cache_dtype, num_slots * per_slot).reshape(num_slots, per_slot)
    kc[slots] = rot[:, num_heads:].reshape(T, -1)
    vc[slots] = rows[:, (num_heads + num_kv_heads) * head_dim:(num_heads + 2 * num_kv_heads) * head_dim]


def _rope(cache_dtype):
    def run(d, grid, qkv, ldqkv, positions, slot_mapping, cos_sin, max_positions, q_out, ldq, k_cache, v_cache,
            num_heads, num_kv_heads, head_dim):
        T = grid[0]
        _rope_rows(d, _f32(d, qkv, T, ldqkv), T, positions, slot_mapping, cos_sin, max_positions, q_out, ldq,
                   k_cache, v_cache, num_heads, num_kv_heads, head_dim, cache_dtype)
    return run


def _attention(cache_dtype):
    def run(d, grid, q, ldq, k_cache, v_cache, block_tables, ld_bt, positions, items, out, ldo, ws_ml, ws_acc,
            max_splits, num_heads, num_kv_heads, head_dim, block_size, heads_per_block, sliding_window, scale,
            softcap, split_size):
        num_items, _, num_splits = grid
        group = num_heads // num_kv_heads
        assert grid[1] == num_kv_heads * (group // heads_per_block) and num_splits <= max_splits
        it = d.view(items, np.int32, 3 * num_items).reshape(-1, 3)
        for seq, t0, nq in it:
            assert 1 <= nq <= 16 // heads_per_block, f"work item of {nq} queries"
            pos = d.view(positions, np.int32, t0 + nq)[t0:t0 + nq]
            table = d.view(block_tables, np.int32, (seq + 1) * ld_bt)[seq * ld_bt:]
            lo = max(0, int(pos[0]) - sliding_window + 1) if sliding_window > 0 else 0
            keys = np.arange(lo, int(pos[-1]) + 1)
            slots = table[keys // block_size] * block_size + keys % block_size
            per_slot = num_kv_heads * head_dim
            kc = d.view(k_cache, cache_dtype, (int(slots.max()) + 1) * per_slot).reshape(-1, num_kv_heads, head_dim)
            vc = d.view(v_cache, cache_dtype, (int(slots.max()) + 1) * per_slot).reshape(-1, num_kv_heads, head_dim)
            qs = _f32(d, q, t0 + nq, ldq)[t0:t0 + nq, :num_heads * head_dim].reshape(nq, num_heads, head_dim)
            per_split = split_size or round_up(-(-len(keys) // num_splits), 32)   # 0: spread in tiles of 32
            for z in range(num_splits):
                in_split = (keys >= lo + z * per_split) & (keys < lo + (z + 1) * per_split)
                for h in range(num_heads):
                    kh = h // group
                    k = kc[slots, kh].astype(np.float32)
                    v = vc[slots, kh].astype(np.float32)
                    sc = (qs[:, h] @ k.T) * np.float32(scale)                 # [nq, C]
                    if softcap > 0:
                        sc = np.float32(softcap) * np.tanh(sc / np.float32(softcap))
                    vis = (keys[None] <= pos[:, None]) & in_split[None]
                    if sliding_window > 0:
                        vis &= keys[None] > pos[:, None] - sliding_window
                    sc = np.where(vis, sc, -np.inf)
                    m = sc.max(axis=1, initial=-np.inf)
                    e = np.where(vis, np.exp(sc - np.where(np.isinf(m), 0, m)[:, None]), 0.0)
                    l, acc = e.sum(axis=1), e @ v
                    for i in range(nq):
                        t = t0 + i
                        if num_splits == 1:
                            _f32(d, out, t + 1, ldo)[t, h * head_dim:(h + 1) * head_dim] = acc[i] / l[i]
                        else:
                            w = (t * num_heads + h) * max_splits + z
                            d.view(ws_ml, np.float32, 2 * (w + 1))[2 * w:2 * w + 2] = (m[i], l[i])
                            d.view(ws_acc, np.float32, (w + 1) * head_dim)[w * head_dim:] = acc[i]
    return run


def _attention_fused(cache_dtype):
    """attention_paged_fused_*: the split kernel, then (folded into its last split) the combine."""
    plain = _attention(cache_dtype)

    def run(d, grid, counters, **args):
        num_items, chunks, num_splits = grid
        assert not d.view(counters, np.int32, num_items * chunks).any(), "attention split counters not re-armed"
        plain(d, grid, **args)
        if num_splits > 1:
            it = d.view(args["items"], np.int32, 3 * num_items).reshape(-1, 3)
            T = int((it[:, 1] + it[:, 2]).max())
            _combine(d, (T, args["num_heads"], 1), args["ws_ml"], args["ws_acc"], num_splits, args["max_splits"],
                     args["out"], args["ldo"], args["num_heads"], args["head_dim"])
    return run


def _combine(d, grid, ws_ml, ws_acc, num_splits, max_splits, out, ldo, num_heads, head_dim):
    T, H, _ = grid
    ml = d.view(ws_ml, np.float32, 2 * T * H * max_splits).reshape(T, H, max_splits, 2)[:, :, :num_splits]
    acc = d.view(ws_acc, np.float32, T * H * max_splits * head_dim).reshape(T, H, max_splits, head_dim)[:, :, :num_splits]
    m, l = ml[..., 0], ml[..., 1]
    wts = np.where(l > 0, np.exp(m - m.max(axis=2, keepdims=True)), 0.0)
    res = (acc * wts[..., None]).sum(axis=2) / (l * wts).sum(axis=2)[..., None]
    _f32(d, out, T, ldo)[:, :H * head_dim] = res.reshape(T, -1)


def _penalties(d, grid, logits, plogits, ldl, vocab_size, fparams, iparams, row_ptr, entries):
    R = grid[0]
    fp = d.view(fparams, np.float32, 4 * R).reshape(R, 4)
    ip = d.view(iparams, np.int32, 4 * R).reshape(R, 4)
    rp = d.view(row_ptr, np.int32, R + 1)
    ent = d.view(entries, np.int32, 2 * int(rp[R])).reshape(-1, 2)
    src, dst = _f32(d, logits, R, ldl), _f32(d, plogits, R, ldl)
    for r in range(R):
        if not ip[r, 2]:
            continue
        row = src[r, :vocab_size].copy()
        for tok, count in ent[rp[r]:rp[r + 1]]:
            if not 0 <= tok < vocab_size:
                continue
            v = row[tok]
            if fp[r, 0] != 1.0:
                v = v / fp[r, 0] if v > 0 else v * fp[r, 0]
            if count > 0:
                v = v - (fp[r, 1] * np.float32(count) + fp[r, 2])
            row[tok] = v
        dst[r, :vocab_size] = row


def _argmax(d, grid, logits, ldl, vocab_size, tokens):
    R = grid[0]
    d.view(tokens, np.int32, R)[:] = np.argmax(_f32(d, logits, R, ldl)[:, :vocab_size], axis=1)


def _sample(d, grid, logits, plogits, ldl, vocab_size, dparams, iparams, rng, tokens):
    R = grid[0]
    dp = d.view(dparams, np.float64, 4 * R).reshape(R, 4)
    ip = d.view(iparams, np.int32, 4 * R).reshape(R, 4)
    seeds = d.view(rng, np.uint64, 2 * R).reshape(R, 2)
    raw, pen = _f32(d, logits, R, ldl), _f32(d, plogits, R, ldl)
    out = d.view(tokens, np.int32, R)
    for r in range(R):
        row = (pen if ip[r, 2] else raw)[r, :vocab_size]
        if dp[r, 0] == 0.0:
            out[r] = int(np.argmax(row))
            continue
        x = row.astype(np.float64)[None] / dp[r, 0]
        u = ref_sampling.request_uniform(seeds[r:r + 1, 0], seeds[r:r + 1, 1])
        p = SimpleNamespace(top_k=int(ip[r, 0]), top_p=float(dp[r, 1]), min_p=float(dp[r, 2]))
        if p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0:
            out[r] = int(ref_sampling.sample_filtered(x, u, [p])[0])
        else:
            out[r] = int(ref_sampling.invert_cdf(ref_sampling.softmax(x), u)[0])


def _logprobs(d, grid, logits, ldl, vocab_size, iparams, tokens, token_logprob, top_ids, top_logprobs):
    R = grid[0]
    ip = d.view(iparams, np.int32, 4 * R).reshape(R, 4)
    toks = d.view(tokens, np.int32, R)
    raw = _f32(d, logits, R, ldl)
    for r in range(R):
        n = int(ip[r, 1])
        if n < 0:
            continue
        x = raw[r, :vocab_size].astype(np.float64)
        lp = x - (np.log(np.exp(x - x.max()).sum()) + x.max())
        d.view(token_logprob, np.float64, R)[r] = lp[toks[r]]
        order = np.argsort(-lp, kind="stable")[:min(n, MAX_TOP_LOGPROBS)]
        d.view(top_ids, np.int32, R * MAX_TOP_LOGPROBS)[r * MAX_TOP_LOGPROBS:][:len(order)] = order
        d.view(top_logprobs, np.float64, R * MAX_TOP_LOGPROBS)[r * MAX_TOP_LOGPROBS:][:len(order)] = lp[order]


EMULATORS = {
    **{name: (lambda p: lambda d, g, **k: _int4_tc(d, g, **k, tokens=p.tokens, fp16=p.fp16))(p)
       for name, p in MM_PRODUCTS.items() if not p.epilogue},
    **{name: (lambda p, normed: lambda d, g, **k: _int4_tc_fused(
        d, g, **{n: v for n, v in k.items() if n != "tokens"}, out_tokens=k["tokens"], tokens=p.tokens, fp16=p.fp16,
        epilogue=p.epilogue, normed=normed))(p, name.endswith("_xn"))
       for name, p in MM_PRODUCTS.items() if p.epilogue},
    **{probe: (lambda d, grid, **args: None) for probes in MM_PROBES.values() for probe in probes},  # reads, writes nothing
    "int4_mm_simt": _int4_mm_simt,
    "int4_repack_tc": _int4_repack_tc,
    "dense_mm_f32": _dense(np.float32),
    "dense_mm_f16": _dense(np.float16),
    "dense_mm_i8": _dense(np.int8),
    "embed_f32": _embed("f32"),
    "embed_f16": _embed("f16"),
    "embed_i8": _embed("i8"),
    "embed_i4": _embed("i4"),
    "rmsnorm": _rmsnorm,
    "head_rmsnorm": _head_rmsnorm,
    "logit_softcap": _logit_softcap,
    "glu_silu": _glu(False),
    "glu_gelu_tanh": _glu(True),
    "rope_kv_append_f32": _rope(np.float32),
    "rope_kv_append_f16": _rope(np.float16),
    "attention_paged_f32": _attention(np.float32),
    "attention_paged_f16": _attention(np.float16),
    "attention_paged_fused_f32": _attention_fused(np.float32),
    "attention_paged_fused_f16": _attention_fused(np.float16),
    "attention_combine": _combine,
    "apply_penalties": _penalties,
    "argmax_rows": _argmax,
    "sample_tokens": _sample,
    "compute_logprobs": _logprobs,
}
