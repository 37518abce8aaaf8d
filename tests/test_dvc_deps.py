"""dvc.yaml lists, for every stage, the code it runs: each project module the stage's entry point
imports, directly or not. A missing one means `dvc repro` keeps a stale artifact after that code
changes, the silent kind of bug this pipeline exists to prevent."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("stages", "kernels")
# Modules that decide how a stage reports or how its files reach the disk, never what they hold:
# a change to them must not rerun a terabyte extraction.
NOT_DEPS = {"stages.progress", "stages.atomic"}


def project_imports(module: str) -> set[str]:
    """Dotted names of the project modules `module` imports, transitively (itself included)."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        path = ROOT / (name.replace(".", "/") + ".py")
        if name in seen or not path.exists():
            continue
        seen.add(name)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                todo += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                todo += [alias.name for alias in node.names]
    return {name for name in seen if name.split(".")[0] in PACKAGES}


def covered(module: str, deps: list[str]) -> bool:
    path = module.replace(".", "/") + ".py"
    return any(path == dep or path.startswith(dep.rstrip("/") + "/") for dep in deps)


STAGES = {name: stage for name, stage in yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"].items()
          if stage["cmd"].startswith("python -m stages.")}


@pytest.mark.parametrize("name", sorted(STAGES))
def test_every_stage_depends_on_all_the_code_it_runs(name):
    stage = STAGES[name]
    entry = stage["cmd"].split()[2]
    deps = [d if isinstance(d, str) else next(iter(d)) for d in stage.get("deps", [])]
    code = project_imports(entry) - NOT_DEPS - set(PACKAGES)
    missing = sorted(m for m in code if not covered(m, deps))
    assert not missing, f"dvc.yaml stage {name!r} runs {entry} but does not list: {missing}"
