"""Helpers shared by the tests of the two NKI kernels (``sim`` backend vs reference)."""

from __future__ import annotations

import ast
from pathlib import Path

import torch


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` in fp32 (relative L2 error of `a` against the reference `b`)."""
    a32, b32 = a.float(), b.float()
    return float((a32 - b32).norm() / b32.norm().clamp_min(1e-30))


def kernel_source_usage(path: Path) -> tuple[set[str], set[str]]:
    """``(modules the kernel file imports, nisa.<op> attributes it uses)``, from its AST."""
    tree = ast.parse(path.read_text())
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
    used = {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "nisa"
    }
    return imported, used
