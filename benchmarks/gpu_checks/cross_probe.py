"""One problem through the forward's CROSS variant (``_fwd._consume_cross``) against the library's
default kernel: whether O and LSE are equal bit for bit (run one process per problem, so that a
faulting variant does not take the others with it).

    PYTHONPATH=. python3 benchmarks/gpu_checks/cross_probe.py B H HK L D c|f st|dyn
"""

import sys

import torch

from benchmarks.sm90_fwd import _launcher, _problem
from torch_flashsys.attention import _sm90


def main() -> None:
    b, h, hk, n, d = (int(x) for x in sys.argv[1:6])
    causal, dynamic = sys.argv[6] == "c", sys.argv[7] == "dyn"
    q, k, v, causal, label = _problem((b, h, hk, n, d, causal))
    ref, ref_lse = _sm90.forward(q, k, v, d**-0.5, causal)
    extra = {"KV_SPLIT": True, "DYNAMIC": dynamic, "CROSS": True}
    launch, out, lse, grid = _launcher(q, k, v, causal, extra)
    launch()
    torch.cuda.synchronize()
    diff = (out.float() - ref.float()).abs().max().item()
    print(label, "dynamic" if dynamic else "static", grid, "out equal", torch.equal(out, ref),
          "lse equal", torch.equal(lse, ref_lse), "max diff", diff)  # fmt: skip


if __name__ == "__main__":
    main()
