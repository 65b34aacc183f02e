"""Mixed precision, two demos: accumulation error, and which dtypes torch.autocast produces.

1. Accumulation: add 0.01 a thousand times (exact answer 10) with the running sum and the addend
   in different dtypes. A float16 accumulator stalls once 0.01 is below half its spacing
   (float16 has 11 significant bits); a float32 accumulator of float16 addends is only off by
   float16's rounding of 0.01, which is why mixed precision keeps accumulators in float32.
2. ToyModel (Linear(in, 10) -> ReLU -> LayerNorm(10) -> Linear(10, out)) under
   ``torch.autocast(device, dtype)``: the dtypes of the parameters, the fc1 output, the LayerNorm
   output, the logits, the loss (cross-entropy) and the parameter gradients.

    python benchmarks/mixed_precision.py                    # CUDA when available, else CPU
    python benchmarks/mixed_precision.py --autocast-dtypes fp16,bf16 --out mp.json --plot mp.png
    python benchmarks/mixed_precision.py --smoke            # CPU, seconds
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._harness import csv_list, line_plot, parser, print_report, write_results

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
SHORT = {v: k for k, v in DTYPES.items()}
# (accumulator dtype, addend dtype, addend cast to the accumulator's dtype before the add)
ACCUMULATIONS = (
    ("fp32", "fp32", False),
    ("fp16", "fp16", False),
    ("bf16", "bf16", False),
    ("fp32", "fp16", False),
    ("fp32", "fp16", True),
    ("fp32", "bf16", True),
)


class ToyModel(nn.Module):
    """Linear(in, 10) -> ReLU -> LayerNorm(10) -> Linear(10, out). (batch, in) -> (batch, out)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, 10, bias=False)
        self.ln = nn.LayerNorm(10)
        self.fc2 = nn.Linear(10, out_features, bias=False)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.ln(self.relu(self.fc1(x))))


def accumulate(acc: str, add: str, cast: bool, n: int, value: float, device) -> list[float]:
    """The running sum after each of ``n`` additions of ``value`` (as Python floats)."""
    s = torch.tensor(0.0, dtype=DTYPES[acc], device=device)
    x = torch.tensor(value, dtype=DTYPES[add], device=device)
    if cast:
        x = x.to(DTYPES[acc])
    trace = []
    for _ in range(n):
        s += x  # in-place: the sum keeps the accumulator's dtype
        trace.append(s.clone())
    return torch.stack(trace).double().cpu().tolist()


def accumulation_rows(n: int, value: float, device) -> tuple[list[dict], dict[str, list]]:
    rows, series = [], {}
    exact = n * value
    for acc, add, cast in ACCUMULATIONS:
        trace = accumulate(acc, add, cast, n, value, device)
        label = f"{acc} += {add}" + (f" cast to {acc}" if cast else "")
        represented = torch.tensor(value, dtype=DTYPES[add]).double().item()
        rows.append({
            "table": "accumulation", "accumulator": acc, "addend": add,
            "addend cast": f"to {acc}" if cast else "no", "result": trace[-1],
            "abs error": abs(trace[-1] - exact),
            "addend as stored": represented,
            "n x stored addend": n * represented,
        })  # fmt: skip
        series[label] = [(i + 1, abs(t - (i + 1) * value)) for i, t in enumerate(trace)]
    return rows, series


def autocast_rows(dtype_name: str, device: torch.device, batch: int, seed: int) -> dict:
    """Dtypes observed in one forward+backward of ToyModel under autocast(device, dtype)."""
    gen = torch.Generator().manual_seed(seed)
    model = ToyModel(16, 5).to(device)
    x = torch.randn(batch, 16, generator=gen).to(device)
    y = torch.randint(0, 5, (batch,), generator=gen).to(device)
    seen: dict[str, torch.dtype] = {}

    def record(name: str):
        def hook(module, inputs, output) -> None:  # returning None keeps the output
            seen.setdefault(name, output.dtype)

        return hook

    hooks = [
        model.fc1.register_forward_hook(record("fc1 output")),
        model.ln.register_forward_hook(record("LayerNorm output")),
    ]
    with torch.autocast(device.type, dtype=DTYPES[dtype_name]):
        seen["parameters (inside autocast)"] = next(model.parameters()).dtype
        logits = model(x)
        loss = nn.functional.cross_entropy(logits, y)
    for h in hooks:
        h.remove()
    seen["logits"] = logits.dtype
    seen["loss"] = loss.dtype
    loss.backward()
    grad_dtypes = {p.grad.dtype for p in model.parameters()}
    seen["gradients"] = grad_dtypes.pop() if len(grad_dtypes) == 1 else str(grad_dtypes)
    return {k: SHORT.get(v, str(v)) for k, v in seen.items()}


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__, smoke="CPU, 100 additions, seconds", plot=True)
    p.add_argument("--n", type=int, default=1000, help="number of additions (1000)")
    p.add_argument("--value", type=float, default=0.01, help="the addend (0.01)")
    p.add_argument(
        "--autocast-dtypes", default="fp16,bf16", help="ToyModel autocast dtypes (fp16,bf16)"
    )
    p.add_argument("--batch", type=int, default=8, help="ToyModel batch size (8)")
    p.add_argument("--seed", type=int, default=0, help="seed for the ToyModel's data (0)")
    p.add_argument("--device", default="auto", help="cuda, cpu or auto (cuda when available)")
    args = p.parse_args(argv)
    if args.smoke:
        args.n, args.device = 100, "cpu"
    if args.n < 1:
        p.error(f"--n must be >= 1, got {args.n}")
    autocast_dtypes = csv_list(
        p, args.autocast_dtypes, "--autocast-dtypes", choices=("fp16", "bf16")
    )
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = device if args.device == "auto" else torch.device(args.device)
    acc_rows, series = accumulation_rows(args.n, args.value, device)
    reports = {d: autocast_rows(d, device, args.batch, args.seed) for d in autocast_dtypes}
    dtype_rows = [{"table": "autocast", "quantity": q, **{f"autocast {d}": reports[d][q] for d in reports}}
                  for q in reports[autocast_dtypes[0]]]  # fmt: skip
    write_results(args.out, acc_rows + dtype_rows)
    if args.plot:
        line_plot(args.plot, {k: v[:: max(1, args.n // 200)] for k, v in series.items()},
                  xlabel="additions", ylabel=f"|sum - exact| (adding {args.value})",
                  title="Accumulation error by dtype", logy=True)  # fmt: skip
    # the harness prints 3 significant digits: too few here
    shown = [
        {**r, **{k: f"{r[k]:.9g}" for k in ("result", "abs error", "addend as stored")}}
        for r in acc_rows
    ]
    columns = ["accumulator", "addend", "addend cast", "result", "abs error", "addend as stored"]
    print_report(
        f"Adding {args.value} {args.n} times (exact: {args.n * args.value:g})", shown, columns
    )
    title = f"ToyModel dtypes under torch.autocast('{device.type}', dtype)"
    print_report(title, dtype_rows, ["quantity", *(f"autocast {d}" for d in autocast_dtypes)])


if __name__ == "__main__":
    main()
