"""`python -m torch_flashsys.demo`: its task data, and its entry point end to end (2 gloo ranks)."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_flashsys import demo


@settings(max_examples=10)
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(1, 4),
    length=st.integers(1, 9),
    symbols=st.integers(2, 20),
    task=st.sampled_from(["reverse", "copy"]),
)
def test_make_batch(seed, batch, length, symbols, task):
    inputs, targets = demo.make_batch(
        batch, length, symbols, task, torch.Generator().manual_seed(seed)
    )
    assert inputs.shape == targets.shape == (batch, 2 * length)
    prompt, sep = inputs[:, :length], inputs[:, length]
    assert (sep == symbols).all() and (prompt < symbols).all() and (prompt >= 0).all()
    answer = prompt.flip(1) if task == "reverse" else prompt
    # Only the answer is scored; the inputs are the targets shifted by one (teacher forcing).
    assert (targets[:, :length] == -100).all()
    assert torch.equal(targets[:, length:], answer)
    assert torch.equal(inputs[:, length + 1 :], answer[:, :-1])


def test_demo_trains_two_ranks_and_replicas_agree(tmp_path, capfd):
    out = tmp_path / "demo.json"
    # backend "torch": what "auto" picks for CPU tensors, named so a GPU run trains the same way.
    code = demo.main(
        ["--steps", "80", "--batch-size", "16", "--attention-backend", "torch",
         "--no-progress", "--out", str(out)]
    )  # fmt: skip
    printed = capfd.readouterr().out
    assert code == 0
    assert "replicas: 2 ranks" in printed and "identical" in printed and "step |" in printed
    results = json.loads(out.read_text())
    expected_backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    assert results["world_size"] == 2 and results["dist_backend"] == expected_backend
    assert results["replicas_identical"] and results["replicas_max_abs_diff"] == 0.0
    loss = results["loss"]
    assert len(loss) == 80 and all(map(torch.isfinite, torch.tensor(loss)))
    first, last = sum(loss[:10]) / 10, sum(loss[-10:]) / 10
    assert last < 0.8 * first, f"loss did not fall: {first:.3f} -> {last:.3f}"


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--steps", "0"], "--steps must be >= 1"),
        (["--nproc", "0"], "--nproc must be >= 1"),
        (["--symbols", "1"], "--symbols must be >= 2"),
        (["--lr", "-1"], "--lr must be a positive number"),
        (["--task", "sort"], "invalid choice"),
        # checked before training, not after it (the results would be lost)
        (["--steps", "1", "--out", "no_such_dir/x.json"], "--out no_such_dir/x.json: the folder"),
        (["--steps", "1", "--plot", "no_such_dir/x.png"], "--plot no_such_dir/x.png: the folder"),
    ],
)
def test_demo_rejects_bad_arguments(argv, match, capsys):
    with pytest.raises(SystemExit) as exc:
        demo.main(argv)
    assert exc.value.code == 2 and match in capsys.readouterr().err
