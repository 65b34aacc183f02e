"""Random attention problems for the property tests, and the dtype-aware comparison rule."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from tests.reference import attention_reference, naive_attention, scores

# Absolute slack on top of the "2x PyTorch's own error" rule, relative to the reference's magnitude:
# it covers the rounding of the output itself (the baseline can be luckily exact on tiny problems).
ATOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
ATOL_TF32 = 4e-3  # float32 with TF32 allowed (10-bit mantissa dots)


@dataclass(frozen=True)
class Problem:
    """The sizes every test problem has (query heads = kv_heads * group)."""

    batch: int
    kv_heads: int
    group: int
    seq_q: int
    seq_k: int
    head_dim: int
    is_causal: bool

    @property
    def heads(self) -> int:
        return self.kv_heads * self.group

    @property
    def gqa(self) -> bool:
        return self.group > 1


@dataclass(frozen=True)
class Case(Problem):
    scale: float | None
    rank3: bool  # (batch, seq, dim) inputs instead of (batch, heads, seq, dim)
    transposed: bool  # (batch, seq, heads, dim) memory, viewed as (batch, heads, seq, dim)
    seed: int

    def make(self, dtype: torch.dtype, device: str = "cpu", requires_grad: bool = True):
        gen = torch.Generator(device="cpu").manual_seed(self.seed)

        def rand(heads: int, seq: int) -> torch.Tensor:
            if self.rank3:
                shape = (heads * self.batch, seq, self.head_dim)
                t = torch.randn(shape, generator=gen)
            elif self.transposed:
                t = torch.randn(self.batch, seq, heads, self.head_dim, generator=gen).transpose(
                    1, 2
                )
            else:
                t = torch.randn(self.batch, heads, seq, self.head_dim, generator=gen)
            t = t.to(device=device, dtype=dtype)
            return t.requires_grad_(requires_grad) if requires_grad else t

        q = rand(self.heads, self.seq_q)
        k, v = rand(self.kv_heads, self.seq_k), rand(self.kv_heads, self.seq_k)
        return q, k, v


@st.composite
def cases(draw, max_seq: int = 40, head_dims=(16, 24, 32, 48, 64), max_batch: int = 2) -> Case:
    rank3 = draw(st.booleans())
    return Case(
        batch=draw(st.integers(1, max_batch)),
        kv_heads=1 if rank3 else draw(st.integers(1, 2)),
        group=draw(st.sampled_from([1, 1, 2, 3])),
        seq_q=draw(st.integers(1, max_seq)),
        seq_k=draw(st.integers(1, max_seq)),
        head_dim=draw(st.sampled_from(head_dims)),
        is_causal=draw(st.booleans()),
        scale=draw(st.one_of(st.none(), st.floats(0.05, 1.0))),
        rank3=rank3,
        transposed=not rank3 and draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def padded_mask(lengths: list[int], seq: int) -> torch.Tensor:
    """The (batch, 1, seq, seq) mask of causal attention over each sequence's first n_b keys
    (a Hugging Face model's right-padded causal mask)."""
    rows = torch.arange(seq)
    causal = rows[None, :] <= rows[:, None]
    keys = rows[None, None, :] < torch.tensor(lengths)[:, None, None]
    return (causal[None] & keys)[:, None]


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def assert_close(name: str, ours, baseline, ref, dtype: torch.dtype, atol: float | None = None,
                 slack: float = 0.0):  # fmt: skip
    """flash-attention's rule: our error against float64 is at most ~2x PyTorch's own (dtype X).
    ``slack``: an error the algorithm makes by design, measured in float64 (a gradient's
    :func:`output_rounding_slack`), added to the tolerance."""
    err, base = max_err(ours, ref), max_err(baseline, ref)
    magnitude = ref.abs().max().item() if ref.numel() else 0.0
    tol = 2 * base + (ATOL[dtype] if atol is None else atol) * max(1.0, magnitude) + slack
    assert err <= tol, f"{name}: max error {err:.3g} > tolerance {tol:.3g} (baseline {base:.3g})"


def rounded_output_terms(out, out64, lse64, dout, q64, k64):
    """``(dq term, dk term)``: the one deviation from the exact gradients that FlashAttention's
    backward makes by design, in float64 (None where the problem is empty). It takes ``D =
    rowsum(dO * O)`` (of ``dS = P * (dP - D)``) from the output it returned, rounded to the dtype,
    as flash-attn and FA3 do. That moves dS by ``-P * dD``, ``dD = rowsum(dO * (out - out64))``:
    dq and dk by the gradient of ``-sum(dD * lse)``, dv not at all. Where PyTorch's own error is
    zero (rows with a single key, whose exact dS is 0, under dropout, whose scaled output the
    dtype cannot hold exactly) this is all of our error. Call before ``out64``'s graph is freed;
    ``lse64`` is differentiable in q64 and k64."""
    if not (lse64.requires_grad and lse64.numel()):
        return None, None
    d_delta = (dout.double() * (out.detach().double() - out64.detach())).sum(-1)
    d_delta = torch.where(lse64.detach().isfinite(), d_delta, 0.0)  # rows with no key: no lse
    return torch.autograd.grad(lse64, (q64, k64), -d_delta, retain_graph=True, allow_unused=True)


def output_rounding_slack(out, out64, lse64, dout, q64, k64) -> dict[str, float]:
    """The size of :func:`rounded_output_terms` per gradient, for :func:`assert_close`."""
    terms = rounded_output_terms(out, out64, lse64, dout, q64, k64)
    slack = {"dq": 0.0, "dk": 0.0, "dv": 0.0}
    for name, term in zip(("dq", "dk"), terms, strict=True):
        slack[name] = term.abs().max().item() if term is not None and term.numel() else 0.0
    return slack


def check_against_reference(case: Case, dtype, run, device="cpu", atol=None, grads=True,
                            lse_grad=True):  # fmt: skip
    """Run ``run(q, k, v) -> (out, lse)`` on the case; compare out, lse, dq, dk, dv with float64
    (``lse_grad`` False: the loss without lse, so the backward gets no dLSE, as in training)."""
    q, k, v = case.make(dtype, device)
    out, lse = run(q, k, v)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == q.shape[:-1] and lse.dtype == torch.float32

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out64, lse64 = attention_reference(q64, k64, v64, case.is_causal, case.scale)
    qb, kb, vb = (t.detach().clone().requires_grad_() for t in (q, k, v))
    base = naive_attention(qb, kb, vb, case.is_causal, case.scale)
    assert_close("out", out, base, out64, dtype, atol)
    # lse is float32 from fp32 score accumulation: compare with a float32-level tolerance.
    lse_tol = (1e-4 if atol is None else atol) * (1 + lse64.abs().max().item())
    assert max_err(lse, lse64) <= lse_tol, f"lse error {max_err(lse, lse64):.3g} > {lse_tol:.3g}"
    if not grads:
        return
    gen = torch.Generator(device="cpu").manual_seed(case.seed + 1)
    dout = torch.randn(out.shape, generator=gen).to(device=device, dtype=dtype)
    dlse = torch.randn(lse.shape, generator=gen).to(device=device) * lse_grad
    slack = output_rounding_slack(out, out64, lse64, dout, q64, k64)
    ((out.float() * dout.float()).sum() + ((lse * dlse).sum() if lse_grad else 0)).backward()
    ((out64 * dout.double()).sum() + (lse64 * dlse.double()).sum()).backward()
    base_lse = scores(qb, kb, case.is_causal, case.scale).float().logsumexp(-1)
    ((base.float() * dout.float()).sum() + (base_lse * dlse).sum()).backward()
    for name, ours, b, r in (
        ("dq", q.grad, qb.grad, q64.grad),
        ("dk", k.grad, kb.grad, k64.grad),
        ("dv", v.grad, vb.grad, v64.grad),
    ):
        assert ours.shape == r.shape and ours.dtype == dtype
        assert_close(name, ours, b, r, dtype, atol, slack[name])


def triton_run(case: Case):
    """``run(q, k, v) -> (out, lse)``: the case's call on the Triton backend (GQA, scale, causal)."""
    from torch_flashsys import flash_attention

    def run(q, k, v):
        return flash_attention(
            q, k, v, is_causal=case.is_causal, scale=case.scale, enable_gqa=case.gqa,
            backend="triton", return_lse=True,
        )  # fmt: skip

    return run
