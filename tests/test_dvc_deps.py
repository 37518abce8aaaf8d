"""The code layout's two promises: dvc.yaml lists exactly the code each stage runs, and imports run one way.

A stage's code deps are its module plus every project module it imports, directly or not. A missing
one means `dvc repro` keeps a stale artifact after that code changes, the silent kind of bug this
pipeline exists to prevent; an extra one reruns a stage (a terabyte extraction) for code it never runs.
Hence no stage imports another stage, and no import circle anywhere: either would pull one stage's
code into another's deps.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("stages", "eagle3", "kernels", "tools", "benchmarks")
# Modules that decide how a stage starts, reports or writes its files to disk, never what they hold:
# a change to them must not rerun a terabyte extraction.
NOT_DEPS = {"eagle3.progress", "eagle3.atomic", "eagle3.cli"}


def module_path(name: str) -> Path | None:
    for path in (ROOT / (name.replace(".", "/") + ".py"), ROOT / name.replace(".", "/") / "__init__.py"):
        if path.is_file():
            return path
    return None


def direct_imports(name: str) -> set[str]:
    """The project modules `name` imports anywhere in its body (functions included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(module_path(name).read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            candidates = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        elif isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            continue
        for candidate in candidates:
            path = module_path(candidate)
            # an empty package __init__ carries no code: `from eagle3.engine import server` imports server
            if candidate.split(".")[0] in PACKAGES and path and path.stat().st_size:
                found.add(candidate)
    return found - {name}


def project_modules() -> list[str]:
    return sorted(".".join(p.relative_to(ROOT).with_suffix("").parts) for package in PACKAGES
                  for p in (ROOT / package).rglob("*.py") if p.name != "__init__.py")


def closure(module: str) -> set[str]:
    seen, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += direct_imports(name)
    return seen


def dep_path(module: str) -> str:
    return module.replace(".", "/") + ".py"


STAGES = {name: stage for name, stage in yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"].items()
          if stage["cmd"].startswith("python -m stages.")}


def code_deps(stage: dict) -> set[str]:
    """The code files a stage's deps name; a folder (eagle3/training) stands for every module in it."""
    deps = [d if isinstance(d, str) else next(iter(d)) for d in stage.get("deps", [])]
    files = {d for d in deps if d.endswith(".py")}
    for folder in (d for d in deps if d.split("/")[0] in PACKAGES and (ROOT / d).is_dir()):
        files |= {str(p.relative_to(ROOT)) for p in (ROOT / folder).rglob("*.py") if p.stat().st_size}
    return files


def expected_deps(stage: dict) -> set[str]:
    entry = stage["cmd"].split()[2]
    return {dep_path(m) for m in closure(entry) - NOT_DEPS}


@pytest.mark.parametrize("name", sorted(STAGES))
def test_every_stage_lists_exactly_the_code_it_runs(name):
    listed, expected = code_deps(STAGES[name]), expected_deps(STAGES[name])
    assert listed == expected, (f"dvc.yaml stage {name!r}: missing {sorted(expected - listed)}, not run by it "
                                f"{sorted(listed - expected)}; its code deps are:\n"
                                + "\n".join(f"      - {d}" for d in sorted(expected)))


def test_no_stage_imports_another_stage():
    edges = [f"{m} -> {i}" for m in project_modules() if m.startswith("stages.")
             for i in direct_imports(m) if i.startswith("stages.")]
    assert not edges, f"a stage imports another stage (its code would join that stage's deps): {edges}"


def test_the_library_imports_no_stage_or_tool():
    edges = [f"{m} -> {i}" for m in project_modules() if m.startswith(("eagle3.", "kernels."))
             for i in direct_imports(m) if i.startswith(("stages.", "tools.", "benchmarks."))]
    assert not edges, f"library modules import entry points: {edges}"


def test_no_import_circle_anywhere():
    graph = {m: direct_imports(m) & set(project_modules()) for m in project_modules()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circle = path[path.index(nxt):] + [node, nxt] if nxt in path else [node, nxt]
                pytest.fail("import circle: " + " -> ".join(circle) + f" (the edge {node} -> {nxt} closes it)")
            if nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for module in graph:
        if module not in state:
            visit(module, [])


def test_a_generate_only_module_is_a_dep_of_generate_alone():
    """Touching generate's request and retry code reruns generate, and nothing else (until its
    responses change)."""
    users = {name for name, stage in STAGES.items() if "eagle3/generation/requests.py" in code_deps(stage)}
    assert users == {"generate"}
    assert all("stages/generate.py" not in code_deps(stage) for name, stage in STAGES.items() if name != "generate")
