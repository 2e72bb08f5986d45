"""The architecture as contracts: layers import only the layers below them (import-linter,
configured in pyproject.toml), and no module takes part in an import cycle (grimp's graph),
so a cycle cannot creep back unnoticed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_import_linter_contracts_are_kept():
    exe = Path(sys.executable).with_name("lint-imports")
    if not exe.exists():
        pytest.skip("import-linter is not installed (the dev extra)")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    r = subprocess.run([str(exe), "--config", str(ROOT / "pyproject.toml")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout, r.stdout


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.find_modules_directly_imported_by(w)))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_no_module_is_part_of_an_import_cycle():
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph("epochal")  # TYPE_CHECKING imports count too
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    class Fake:
        modules = {"a", "b", "c"}
        edges = {"a": {"b"}, "b": {"a"}, "c": {"a"}}

        def find_modules_directly_imported_by(self, m):
            return self.edges[m]

    assert _cycles(Fake()) == [["a", "b"]]
