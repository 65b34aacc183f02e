"""The ```python blocks of README.md and docs/*.md run, so that examples cannot rot silently.

Every block runs (``exec`` in a fresh namespace, in-process, line numbers those of the .md file)
unless the HTML comment on the line just above its fence says otherwise; readers of the rendered
page do not see it. ``<!-- doc-test: D; D; ... -->``, each directive one of:

- ``skip (reason)``: not run here (needs torchrun / several processes, a GPU only, or a fragment
  that cannot be completed, e.g. one with elided arguments);
- ``on-cpu``: without CUDA, ``device="cuda"`` becomes ``device="cpu"`` (the PyTorch backend of
  ``flash_attention``, which ``backend="auto"`` picks for CPU tensors); with CUDA it runs as written;
- ``setup NAME``: ``SETUPS[NAME]`` runs first in the block's namespace (what a reader defines
  around a fragment: ``model``, ``q, k, v``, ...);
- ``check EXPR``: after the block, ``EXPR`` must be true in its namespace (what the text says).

A block that is not skipped and still mentions ``cuda`` or starts a process group fails: GPU-only
and multi-process blocks must say so with ``skip``. docs/benchmarks.md (tables and data) is not
read. The benchmarks package is not imported.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md"] + sorted(
    p for p in (ROOT / "docs").glob("*.md") if p.name != "benchmarks.md"
)
MARKER = re.compile(r"^<!-- doc-test: (.*) -->$")
FENCE = re.compile(r"^```python\s*$")

SETUPS = {
    "qkv": "import torch\nq, k, v = torch.randn(3, 2, 4, 64, 16).unbind(0)\n",
    "mha": "import torch\nfrom torch import nn\nmha = nn.MultiheadAttention(512, 8)\n",
    "encoder": (
        "import torch\nfrom torch import nn\n"
        "layer = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True)\n"
        "model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)\n"
        "batch = torch.randn(2, 10, 64)\n"
    ),
    "transformer": "from torch import nn\nmodel = nn.Transformer(64, 4, 2, 2, 128, batch_first=True)\n",
    "sdpa_model": (  # a model that calls SDPA and returns an output with .loss (HF-style)
        "import types\nimport torch\nimport torch.nn.functional as F\nfrom torch import nn\n"
        "class Model(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.qkv = nn.Linear(16, 48)\n"
        "    def forward(self, x):\n"
        "        q, k, v = self.qkv(x).view(2, 12, 3, 2, 8).permute(2, 0, 3, 1, 4)\n"
        "        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)\n"
        "        return types.SimpleNamespace(loss=out.square().mean())\n"
        "model, batch = Model(), torch.randn(2, 12, 16)\n"
    ),
    "decode": (
        "import torch\nfrom torch_flashsys import flash_attention\n"
        "from torch_flashsys.attention import KVCache\n"
        "batch, heads, kv_heads, capacity, head_dim = 2, 8, 2, 64, 32\n"
        "k_prompt, v_prompt = torch.randn(2, batch, kv_heads, 10, head_dim).unbind(0)\n"
        "k_new, v_new = torch.randn(2, batch, kv_heads, 3, head_dim).unbind(0)\n"
        "q_new = torch.randn(batch, heads, 3, head_dim, dtype=torch.bfloat16)\n"
        # what the new tokens should get: the prompt and, causally, themselves
        "keys, values = (torch.cat(t, 2).bfloat16().float() for t in ((k_prompt, k_new), (v_prompt, v_new)))\n"
        "expected = torch.nn.functional.scaled_dot_product_attention(q_new.float(), keys, values,\n"
        "    attn_mask=torch.ones(3, 13, dtype=torch.bool).tril(10), enable_gqa=True)\n"
    ),
    "tokens": "import torch\ntokens = torch.randint(0, 10000, (2, 64))\n",
    "lm": "import torch\nfrom torch_flashsys.models import build_model\n",
}


@dataclass
class Block:
    where: str  # file:line of the opening fence
    line: int
    source: str
    skip: str | None = None
    on_cpu: bool = False
    setup: str | None = None
    checks: tuple[str, ...] = ()


def _parse_marker(block: Block, marker: str) -> None:
    checks = []
    for directive in (d.strip() for d in marker.split(";")):
        if directive.startswith("skip"):
            block.skip = directive[4:].strip(" ()") or "marked skip"
        elif directive == "on-cpu":
            block.on_cpu = True
        elif directive.startswith("setup "):
            block.setup = directive.split(None, 1)[1]
        elif directive.startswith("check "):
            checks.append(directive.split(None, 1)[1])
        else:
            raise ValueError(f"{block.where}: unknown doc-test directive {directive!r}")
    block.checks = tuple(checks)


def _blocks() -> list[Block]:
    found = []
    for path in FILES:
        lines = path.read_text().splitlines()
        for i, text in enumerate(lines):
            if not FENCE.match(text):
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            where = f"{path.relative_to(ROOT)}:{i + 1}"
            block = Block(where, i + 1, "\n".join(lines[i + 1 : end]) + "\n")
            marker = MARKER.match(lines[i - 1]) if i else None
            if marker:
                _parse_marker(block, marker.group(1))
            found.append(block)
    return found


BLOCKS = _blocks()


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_doc_example(block: Block, monkeypatch, tmp_path):
    if block.skip:
        pytest.skip(block.skip)
    source = block.source
    if block.on_cpu and not torch.cuda.is_available():
        source = source.replace('device="cuda"', 'device="cpu"')
    assert "cuda" not in source.replace('device="cuda"', ""), (
        f"{block.where} uses CUDA beyond device=: mark it skip (needs a GPU)"
    )
    assert block.on_cpu or 'device="cuda"' not in source, f"{block.where}: mark it on-cpu or skip"
    assert "init_process_group" not in source, f"{block.where}: mark it skip (torchrun)"
    namespace: dict = {"__name__": "__doc_example__"}
    monkeypatch.chdir(tmp_path)  # whatever a block writes stays out of the checkout
    if block.setup:
        exec(SETUPS[block.setup], namespace)
    # Padded to the block's first line: a traceback names the .md file's own line numbers.
    code = compile("\n" * block.line + source, str(ROOT / block.where.split(":")[0]), "exec")
    exec(code, namespace)
    for check in block.checks:
        assert eval(check, namespace), f"{block.where}: doc-test check failed: {check}"


def test_examples_are_found_and_run():
    """The extraction still finds the blocks, and some run (all skipped would test nothing)."""
    assert {Path(b.where.split(":")[0]).name for b in BLOCKS} >= {"README.md", "attention.md"}
    runnable = [b.where for b in BLOCKS if not b.skip]
    assert len(runnable) > 0, "no documentation example runs: every block is marked skip"
    unknown = {b.setup for b in BLOCKS if b.setup} - set(SETUPS)
    assert not unknown, f"doc-test setups not in SETUPS: {unknown}"
