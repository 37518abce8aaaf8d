"""Pipeline params profiles (profiles/*.yaml): list, check, and switch params.yaml to one.

A profile is a complete params.yaml for one target and machine. Switching copies it over params.yaml
(comments included) after printing what changes; DVC tracks params.yaml, so the next `dvc repro`
reruns exactly the stages whose params moved, and `dvc params diff` shows the switch.

    python -m tools.profile                 # list the profiles, mark the one params.yaml equals
    python -m tools.profile check           # params.yaml and every profile complete and typed
    python -m tools.profile use NAME [--force]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from eagle3.atomic import atomic_write_bytes
from eagle3.data import prompts
from eagle3.errors import PipelineError
from eagle3.evaluation.params import EvaluateParams, agreement_problem
from eagle3.generation import requests
from eagle3.params import PARAMS_FILE, ParamsError, check_params_file, load_section, read_params
from eagle3.training import params as train_params

PROFILES_DIR = Path("profiles")


def profile_paths(profiles_dir: Path = PROFILES_DIR) -> dict[str, Path]:
    return {path.stem: path for path in sorted(profiles_dir.glob("*.yaml"), key=lambda path: path.stem)}


def flatten(data: dict[str, Any]) -> dict[str, Any]:
    """{"section.key": value}: the granularity DVC's params diff uses too."""
    return {f"{section}.{key}": value for section, keys in data.items() if isinstance(keys, dict)
            for key, value in keys.items()}


def diff_lines(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    a, b = flatten(old), flatten(new)

    def shown(values: dict[str, Any], key: str) -> str:
        return repr(values[key]) if key in values else "(absent)"

    return [f"  {key}: {shown(a, key)} -> {shown(b, key)}"
            for key in sorted(set(a) | set(b)) if a.get(key, ...) != b.get(key, ...)]


def active_profile(params_file: Path = PARAMS_FILE, profiles_dir: Path = PROFILES_DIR) -> str | None:
    """The profile whose values params.yaml holds (comments and layout aside), if any."""
    current = read_params(params_file)
    return next((name for name, path in profile_paths(profiles_dir).items() if read_params(path) == current), None)


def check_all(params_file: Path = PARAMS_FILE, profiles_dir: Path = PROFILES_DIR) -> list[str]:
    """Every problem in params.yaml and the profiles, one message each naming the file and key."""
    sections = set(read_params(params_file))
    errors = []
    for path in [params_file, *profile_paths(profiles_dir).values()]:
        try:
            check_params_file(path, sections)
        except ParamsError as e:
            errors.append(str(e))
            continue
        errors += value_problems(path)
    return errors


def value_problems(path: Path) -> list[str]:
    """What the stages would refuse when they start, found before hours of generation and extraction run:
    their own checks of the values, and an agreement check beside every vLLM figure."""
    problems = []
    stage_checks = [
        ("prompts", prompts.PromptsParams, prompts.check_params),
        ("generate", requests.GenerateParams, requests.check_params),
        # the world size is torchrun's, unknown here: 1 divides every batches_per_step
        ("train", train_params.TrainParams, lambda p: train_params.check_params(p, world=1)),
    ]
    for section, cls, check in stage_checks:
        try:
            check(load_section(section, cls, path))
        except PipelineError as e:
            problems.append(f"{path}: {e}")
    problem = agreement_problem(load_section("evaluate", EvaluateParams, path), str(path))
    return problems + ([problem] if problem else [])


def use(name: str, force: bool = False, params_file: Path = PARAMS_FILE, profiles_dir: Path = PROFILES_DIR) -> None:
    profiles = profile_paths(profiles_dir)
    if name not in profiles:
        raise ParamsError(f"{profiles_dir}/{name}.yaml: no such profile (have: {', '.join(profiles)})")
    source = profiles[name]
    check_params_file(source, set(read_params(params_file)))
    if problems := value_problems(source):
        raise ParamsError("; ".join(problems))
    changes = diff_lines(read_params(params_file), read_params(source))
    if not changes:
        print(f"profile: {params_file} already has the values of {source}")
        return
    # Edits to params.yaml that no profile holds would be lost without a trace (git may not have them either).
    if active_profile(params_file, profiles_dir) is None and not force:
        raise ParamsError(f"{params_file}: its values match no profile in {profiles_dir}/, so switching would lose "
                          f"them; keep them with `cp {params_file} {profiles_dir}/<name>.yaml`, or overwrite "
                          f"with FORCE=1 (make) / --force")
    print(f"profile: {params_file} <- {source} ({len(changes)} values change)")
    print("\n".join(changes))
    atomic_write_bytes(params_file, source.read_bytes())
    print("profile: done; `dvc repro` reruns the stages these params feed, `dvc params diff` shows the switch")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.profile", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("list", help="list the profiles (the default)")
    sub.add_parser("check", help="check params.yaml and every profile against the params schema")
    use_parser = sub.add_parser("use", help="copy profiles/NAME.yaml over params.yaml, showing what changes")
    use_parser.add_argument("name")
    use_parser.add_argument("--force", action="store_true", help="overwrite edits that are in no profile")
    args = parser.parse_args(argv)
    try:
        if args.command == "use":
            use(args.name, args.force)
        elif args.command == "check":
            errors = check_all()
            print("\n".join(errors) or f"profile: {PARAMS_FILE} and {len(profile_paths())} profiles are complete")
            return 1 if errors else 0
        else:
            active = active_profile()
            for name, path in profile_paths().items():
                print(f"{'*' if name == active else ' '} {name:<16} {path}")
            if active is None:
                print(f"  ({PARAMS_FILE} matches no profile: it has local edits)")
    except ParamsError as e:
        print(f"profile: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
