"""Packed batches and KV-cache decoding beside their peers (``benchmarks/flash.py --preset varlen``).

Rows ``impl,case,ms`` (``impl`` "ours" for flash_attention), bf16 on CUDA:

- ``packed``: 16 causal sequences of random.seed(1) randint(128, 8192) lengths (65,617 tokens), 16
  heads, d 128, fwd+bwd: ours packed (cu_seqlens), FlexAttention with a document block mask, SDPA
  cuDNN / efficient padded to the longest with a causal+padding mask, ours padded the same way; and
  the equal-length batch (16, 4101) with plain causal, for TFLOP/s at the same work; and ours on
  the same batch as nested jagged tensors (``nested_tensor_from_jagged`` of the packed values,
  transposed to (batch, heads, j, dim)).
- ``decode b8 c32768`` / ``decode b64 c1024``: one new query against a full cache, 32 query heads,
  8 key/value heads, d 128: ours (cache_seqlens), SDPA flash / cuDNN (enable_gqa), FlexAttention,
  and ``copy bandwidth`` (half the time of a device copy of the cache's K and V, which reads and
  writes every byte: the time to read them once, the bandwidth floor).
- ``decode b8 random lengths``: cache_seqlens drawn from 1..32768 in a 32768 cache (time should
  follow the used part).
"""

from __future__ import annotations

import random

import torch

from benchmarks._harness import bench
from benchmarks._peers import sdpa_call


def _lengths(smoke: bool) -> list[int]:
    if smoke:
        return [5, 17, 9]
    rng = random.Random(1)
    return [rng.randint(128, 8192) for _ in range(16)]


def _row(rows, impl, case, fn, device, ms_scale=1.0, **extra):
    try:
        rows.append(
            {"impl": impl, "case": case, "ms": bench(fn, device)["median_ms"] * ms_scale, **extra}
        )
    except Exception as exc:  # an impl that cannot run this case: an empty ms and why
        rows.append({"impl": impl, "case": case, "ms": None, **extra,
                     "note": f"{type(exc).__name__}: {str(exc).splitlines()[0][:70]}"})  # fmt: skip
    if device == "cuda":
        torch.cuda.empty_cache()


def _fwd_bwd(fn, inputs, dout):
    def run():
        for t in inputs:
            t.grad = None
        fn(*inputs).backward(dout)

    return run


def packed_rows(device: str, dtype, smoke: bool) -> list[dict]:
    from torch_flashsys import flash_attention

    lens = _lengths(smoke)
    heads, dim = (2, 16) if smoke else (16, 128)
    total, longest, n = sum(lens), max(lens), len(lens)
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, dout = (torch.randn(total, heads, dim, device=device, dtype=dtype, generator=gen)
                     for _ in range(4))  # fmt: skip
    for t in (q, k, v):
        t.requires_grad_()
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=device,
                      dtype=torch.int32)  # fmt: skip
    flops = sum(4 * heads * n_i * n_i * dim * 0.5 for n_i in lens) * 3.5  # causal fwd+bwd
    rows: list[dict] = []
    case = "packed"
    packed = {
        "cu_seqlens_q": cu,
        "cu_seqlens_k": cu,
        "max_seqlen_q": longest,
        "max_seqlen_k": longest,
    }
    ours = lambda q, k, v: flash_attention(q, k, v, is_causal=True, **packed)
    _row(rows, "ours", case, _fwd_bwd(ours, (q, k, v), dout), device, flops=flops)
    # the same batch as nested jagged tensors, (n, heads, j, dim) as SDPA takes them
    offsets = cu.long()
    as_nested = lambda t: torch.nested.nested_tensor_from_jagged(t, offsets).transpose(1, 2)
    ours_nested = lambda q, k, v: (
        flash_attention(as_nested(q), as_nested(k), as_nested(v), is_causal=True)
        .transpose(1, 2)
        .values()
    )
    _row(rows, "ours nested jagged", case, _fwd_bwd(ours_nested, (q, k, v), dout), device,
         flops=flops)  # fmt: skip
    # padded to the longest: (n, heads, longest, dim) with a causal + key-padding mask
    pad = torch.zeros(n, heads, longest, dim, device=device, dtype=dtype)
    qp, kp, vp, dp = (pad.clone().requires_grad_(i < 3) for i in range(4))
    valid = (
        torch.arange(longest, device=device)[None, :] < torch.tensor(lens, device=device)[:, None]
    )
    causal = torch.ones(longest, longest, dtype=torch.bool, device=device).tril()
    mask = causal[None, None] & valid[:, None, None, :]
    for backend in ("CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
        sdpa = sdpa_call(backend, attn_mask=mask)
        _row(rows, f"sdpa {backend.split('_')[0].lower()} padded", case,
             _fwd_bwd(sdpa, (qp, kp, vp), dp), device, flops=flops)  # fmt: skip
    key_pad = valid[:, None, None, :]
    ours_pad = lambda q, k, v: flash_attention(q, k, v, attn_mask=key_pad, is_causal=True)
    _row(rows, "ours padded", case, _fwd_bwd(ours_pad, (qp, kp, vp), dp), device, flops=flops)
    if device == "cuda":
        _row(rows, "flex document mask", case, _flex_packed(lens, q, k, v, dout), device,
             flops=flops)  # fmt: skip
    # the equal-length batch of about the same number of tokens
    per = total // n
    qe, ke, ve, de = (torch.randn(n, heads, per, dim, device=device, dtype=dtype, generator=gen)
                      for _ in range(4))  # fmt: skip
    for t in (qe, ke, ve):
        t.requires_grad_()
    eq_flops = 4 * n * heads * per * per * dim * 0.5 * 3.5
    eq_case = f"equal-length ({n}, {per})"
    _row(rows, "ours", eq_case,
         _fwd_bwd(lambda q, k, v: flash_attention(q, k, v, is_causal=True), (qe, ke, ve), de),
         device, flops=eq_flops)  # fmt: skip
    return rows


def _flex_packed(lens, q, k, v, dout):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    total = q.shape[0]
    doc = torch.repeat_interleave(torch.arange(len(lens), device=q.device),
                                  torch.tensor(lens, device=q.device))  # fmt: skip

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    block = create_block_mask(mask_mod, None, None, total, total, device=q.device)
    compiled = torch.compile(flex_attention, dynamic=False)
    qf, kf, vf = (t.transpose(0, 1).unsqueeze(0).detach().requires_grad_() for t in (q, k, v))
    df = dout.transpose(0, 1).unsqueeze(0)
    return _fwd_bwd(lambda q, k, v: compiled(q, k, v, block_mask=block), (qf, kf, vf), df)


def _decode_case(rows, batch, cache, heads, kv_heads, dim, device, dtype, random_lengths):
    from torch_flashsys import flash_attention

    case = f"decode b{batch} c{cache}"
    gen = torch.Generator(device=device).manual_seed(batch)
    q = torch.randn(batch, heads, 1, dim, device=device, dtype=dtype, generator=gen)
    kc, vc = (torch.randn(batch, kv_heads, cache, dim, device=device, dtype=dtype, generator=gen)
              for _ in range(2))  # fmt: skip
    full = torch.full((batch,), cache, device=device, dtype=torch.int32)
    nbytes = 2 * kc.numel() * kc.element_size()

    def ours(lens):
        return lambda: flash_attention(q, kc, vc, cache_seqlens=lens, enable_gqa=True)

    with torch.no_grad():
        _row(rows, "ours", case, ours(full), device, bytes=nbytes)
        for backend in ("FLASH_ATTENTION", "CUDNN_ATTENTION"):
            sdpa = sdpa_call(backend, enable_gqa=True)
            _row(rows, f"sdpa {backend.split('_')[0].lower()}", case, lambda f=sdpa: f(q, kc, vc),
                 device, bytes=nbytes)  # fmt: skip
        if device == "cuda":
            from torch.nn.attention.flex_attention import flex_attention

            flex = torch.compile(flex_attention, dynamic=False)
            _row(rows, "flex", case, lambda: flex(q, kc, vc, enable_gqa=True), device,
                 bytes=nbytes)  # fmt: skip
        dst = torch.empty_like(kc)
        # A copy reads and writes every byte: reading K and V once at the copy bandwidth takes
        # half the copy's time (the "copy-bandwidth time").
        _row(rows, "copy bandwidth (K and V read once)", case,
             lambda: (dst.copy_(kc), dst.copy_(vc)), device, ms_scale=0.5, bytes=nbytes)  # fmt: skip
        if random_lengths:
            lens = torch.randint(1, cache + 1, (batch,), device=device, generator=gen,
                                 dtype=torch.int32)  # fmt: skip
            used = int(lens.sum()) / (batch * cache)
            _row(rows, "ours", f"decode b{batch} random lengths (used {used:.2f} of the cache)",
                 ours(lens), device, bytes=nbytes * used)  # fmt: skip


def decode_rows(device: str, dtype, smoke: bool) -> list[dict]:
    rows: list[dict] = []
    configs = [(8, 32768), (64, 1024)] if not smoke else [(2, 256)]
    heads, kv_heads, dim = (32, 8, 128) if not smoke else (4, 2, 16)
    for batch, cache in configs:
        _decode_case(rows, batch, cache, heads, kv_heads, dim, device, dtype,
                     random_lengths=batch == 8 or smoke)  # fmt: skip
    return rows


def run_varlen(smoke: bool = False) -> list[dict]:
    device = "cuda" if torch.cuda.is_available() and not smoke else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rows = packed_rows(device, dtype, smoke) + decode_rows(device, dtype, smoke)
    for r in rows:
        if r.get("ms"):
            if "flops" in r:
                r["TFLOP/s"] = r["flops"] / r["ms"] / 1e9
            if "bytes" in r:
                r["GB/s"] = r["bytes"] / r["ms"] / 1e6
    return rows
