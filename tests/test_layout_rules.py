"""The package layout's rules, checked on the code (ARCHITECTURE.md: dependencies point one way).

- ``rollplex_contract`` (what trainer and engines exchange) imports none of the others, nor JAX or torch;
- ``rollout_torch`` imports neither JAX nor ``rollplex_jax``: importing every module of it in a fresh
  interpreter loads no ``jax`` or ``rollplex_jax`` module (a real import, so a transitive import counts);
- the library (``rollplex_jax``, ``rollout_torch``, ``rollplex_contract``) never imports ``launch`` (entry
  points), checked on every import statement, function-level ones included;
- inside ``rollplex_jax`` the parts are layered (``LAYERS``, top to bottom: the run loop, one RL step, the
  simulator, memory, weight sharing, programs, devices and processes, models, RL math, data, config, then the
  few modules kept at the top): a module imports only its own part or parts below it, so ``models/`` knows no
  RL, ``rl/`` no model, nothing below ``run/`` the loop; at most 6 modules sit directly in ``rollplex_jax/``;
- livable modules: every module opens with a docstring, no function is over 80 lines or takes more than 8
  parameters (``self``/``cls`` not counted, ``*args``/``**kwargs`` counted once each), no file over 500 lines.
"""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

import pytest

from tests.paths import REPO

PACKAGES = ("rollplex_contract", "rollplex_jax", "rollout_torch", "launch")


def _modules(package: str) -> list[pathlib.Path]:
    return sorted((REPO / package).rglob("*.py"))


def _imports(path: pathlib.Path) -> set[str]:
    """Top-level package names of every import in ``path`` (function-level imports included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


@pytest.mark.parametrize("package,forbidden", [
    ("rollplex_contract", {"rollplex_jax", "rollout_torch", "launch", "jax", "jaxlib", "torch", "flax"}),
    ("rollout_torch", {"rollplex_jax", "launch", "jax", "jaxlib", "flax", "optax"}),
    ("rollplex_jax", {"launch"}),
])
def test_imports_point_one_way(package, forbidden):
    bad = {str(p.relative_to(REPO)): sorted(_imports(p) & forbidden) for p in _modules(package)}
    assert not {k: v for k, v in bad.items() if v}


#: ``rollplex_jax``'s parts, top to bottom (ARCHITECTURE.md "Layout"); "" = the modules directly in the package.
LAYERS = ("run", "step", "sim", "memory", "weights", "programs", "parallel", "models", "rl", "data", "config", "")


def _part(module: str) -> str | None:
    """The part of ``rollplex_jax`` a dotted module name lies in (None outside the package)."""
    parts = module.split(".")
    if parts[0] != "rollplex_jax":
        return None
    return parts[1] if len(parts) > 1 and (REPO / "rollplex_jax" / parts[1]).is_dir() else ""


def _part_imports(path: pathlib.Path) -> set[str]:
    """The parts of ``rollplex_jax`` that ``path`` imports (``from rollplex_jax import x``: x's part)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {_part(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "rollplex_jax":
                out |= {_part(f"rollplex_jax.{a.name}") for a in node.names}
            else:
                out.add(_part(node.module))
    return out - {None}


def test_parts_import_downward_only():
    assert {_part(f"rollplex_jax.{p.name}") for p in (REPO / "rollplex_jax").iterdir()
            if p.is_dir() and (p / "__init__.py").exists()} <= set(LAYERS), "a new part: place it in LAYERS"
    bad = []
    for p in _modules("rollplex_jax"):
        mine = _part(".".join(p.relative_to(REPO).with_suffix("").parts))
        for other in _part_imports(p) - {mine}:
            if LAYERS.index(other) < LAYERS.index(mine):
                bad.append(f"{p.relative_to(REPO)} ({mine or 'top'}) imports {other or 'a top module'}, above it")
    assert not bad, "\n".join(bad)


def test_few_modules_directly_in_the_package():
    top = sorted(p.name for p in (REPO / "rollplex_jax").glob("*.py") if p.name != "__init__.py")
    assert len(top) <= 6, top


def test_importing_rollout_torch_loads_no_jax():
    mods = [".".join(p.relative_to(REPO).with_suffix("").parts) for p in _modules("rollout_torch")]
    mods = [m.removesuffix(".__init__") for m in mods if not m.endswith("vllm_engine")]  # vllm: its own venv
    code = ("import importlib, json, sys\n"
            f"for m in {mods!r}: importlib.import_module(m)\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'rollplex_jax'))))")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == []
    vllm = REPO / "rollout_torch" / "vllm_engine.py"  # statically, at least
    assert not _imports(vllm) & {"jax", "rollplex_jax", "launch"}


def _parameter_count(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = node.args
    names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs) if x.arg not in ("self", "cls")]
    return len(names) + (a.vararg is not None) + (a.kwarg is not None)


def test_modules_are_livable():
    problems = []
    for package in PACKAGES:
        for p in _modules(package):
            src = p.read_text()
            tree = ast.parse(src)
            name = str(p.relative_to(REPO))
            if not ast.get_docstring(tree):
                problems.append(f"{name}: no module docstring")
            if src.count("\n") > 500:
                problems.append(f"{name}: {src.count(chr(10))} lines > 500")
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = node.end_lineno - node.lineno + 1
                    if n > 80:
                        problems.append(f"{name}:{node.lineno} {node.name}: {n} lines > 80")
                    if (k := _parameter_count(node)) > 8:
                        problems.append(f"{name}:{node.lineno} {node.name}: {k} parameters > 8")
    assert not problems, "\n".join(problems)
