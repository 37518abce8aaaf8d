"""`make plan`: hours, disk and dollars of a hero run on a given machine, before renting it.

  python -m tools.plan --hw b300-nvl8 --target kimi-k2.5 --samples 10000 [--compare h200-8]

Each stage's first-principles time (tools/planner/model.py) is divided by an efficiency measured on a
real run (tools/planner/calibrate.py: metrics/ of the last pipeline run, benchmarks/results/); the
table says which measurement calibrated each stage. With --compare, the speedup per stage and the
bottleneck on each machine. A PNG of the stage hours goes to --plot.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from tools.planner import model, sources
from tools.planner.calibrate import Calibration, CalibrationError, Measurement, calibrate
from tools.planner.profiles import PLANNER_DIR, Hardware, ProfileError, Target, load_hardware, load_target

STAGES = ("generate", "extract", "train", "transfer")
TOKEN_STORE_BYTES = 5  # per token, what an online run keeps: int32 id + uint8 mask (before zstd)
DEFAULT_COMPRESS_MB_S = 180.0  # per core, zstd-1 on byte planes: what the H200 extract benchmark sustained per thread
# stored/raw where no measurement of that store_dtype is given: lossless planes as measured on real states;
# float8 as its bytes, half of bf16's before zstd (zstd took it to 0.43 on the embedded default's states)
DEFAULT_STORED_OVER_RAW = {"bf16": 0.69, "fp8_e4m3": 0.5}


@dataclass(frozen=True)
class StageEstimate:
    stage: str
    seconds: float
    note: str  # what bounds it and what calibrated it


@dataclass(frozen=True)
class Plan:
    hardware: Hardware
    target: Target
    work: model.Workload
    stages: list[StageEstimate]
    hidden_bytes: float
    weight_bytes: float
    alternatives: list[StageEstimate]  # shown beside the stages, not in the total (the other extraction path)
    sources: list[sources.SourceEstimate]  # train.source store / online / hybrid, fastest first

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.stages)

    @property
    def dollars(self) -> float:
        return self.seconds / 3600 * self.hardware.price_per_hour

    def stage(self, name: str) -> StageEstimate:
        return next(s for s in self.stages if s.stage == name)

    @property
    def bottleneck(self) -> StageEstimate:
        return max(self.stages, key=lambda s: s.seconds)


def first(values: list[tuple[float, str]], default: float, what: str) -> tuple[float, str]:
    return values[0] if values else (default, f"default {what}")


def project(target: Target, hw: Hardware, work: model.Workload, cal: Calibration) -> Plan:
    on_gpu = hw.gpu_count > 0
    gen, ext, trn = (cal.pick(stage, on_gpu) for stage in ("generate", "extract", "train"))

    def source(m: Measurement) -> str:
        return f"eff {m.efficiency:.2f} from {m.source} ({m.hardware.name}, {m.target})"

    generate_s = model.generation_roofline_s(target, hw, work) / gen.efficiency
    ratio, ratio_source = first(cal.stored_over_raw[work.store_dtype], DEFAULT_STORED_OVER_RAW[work.store_dtype],
                                f"{work.store_dtype} stored/raw")
    mb_s, mb_s_source = first(cal.compress_mb_s_per_core, DEFAULT_COMPRESS_MB_S, "MB/s per core")
    compute_s = model.extraction_roofline_s(target, hw, work.tokens, work.seq_len, work.weights) / ext.efficiency
    compress_s = model.compression_s(target, hw, work.tokens, mb_s)
    replica = model.devices_per_replica(target, hw, work.weights)
    split = (f"needs {replica} GPUs: split over all {hw.devices} by layers, one computes at a time; "
             if replica > 1 else "")

    def bound(compute: float) -> str:
        return (f"CPU compression ({hw.cpu_cores} cores x {mb_s:.0f} MB/s, {mb_s_source})" if compress_s > compute
                else "prefill compute")

    hf_extract = StageEstimate("extract", max(compute_s, compress_s), f"hf: {split}{bound(compute_s)}; {source(ext)}")
    group, replicas = model.engine_layout(target, hw, work.weights)
    try:
        eng = cal.pick("extract-vllm", on_gpu)
        eng_source = source(eng)
    except CalibrationError:  # no measured run of the engine path: the HF path's efficiency, said so
        eng, eng_source = ext, f"uncalibrated, the HF path's {source(ext)}"
    engine_s = model.engine_extraction_roofline_s(target, hw, work.tokens, work.seq_len, work.weights) / eng.efficiency
    layout = f"{replicas} replica(s) x TP/EP {group}, all {hw.devices} GPUs busy" if on_gpu else "the CPU"
    engine_extract = StageEstimate("extract", max(engine_s, compress_s),
                                   f"vllm: {layout}; {bound(engine_s)}; {eng_source}")
    chosen, other = ((engine_extract, hf_extract) if work.extract_engine == "vllm" else (hf_extract, engine_extract))
    other = StageEstimate(f"({other.note.split(':')[0]})", other.seconds, "the other extract.engine, not in the total: "
                          + other.note.split(": ", 1)[1])
    train_compute, train_comm = model.training_roofline_s(target, hw, work.tokens * work.epochs, work.seq_len,
                                                          work.ttt_steps, work.tokens_per_device_step)
    hidden = model.hidden_store_bytes(target, work.tokens, ratio)
    weights = target.weight_bytes(work.weights)
    comm = f", gradient all-reduce {train_comm / 60:.1f} min over {hw.link}" if train_comm else ""
    stages = [
        StageEstimate("generate", generate_s, f"decode at {min(work.concurrency, work.samples)} concurrent; {source(gen)}"),
        chosen,
        StageEstimate("train", train_compute / trn.efficiency + train_comm, f"drafter compute{comm}; {source(trn)}"),
        StageEstimate("transfer", model.transfer_s(weights + hidden, work.link_gbit_s),
                      f"weights in + hidden store out at {work.link_gbit_s:g} Gbit/s; stored/raw {ratio:.3f} "
                      f"({work.store_dtype}) from {ratio_source}"),
    ]
    by_source = sources.compare(chosen.seconds, stages[2].seconds, work.epochs, hw.devices, replica if on_gpu else 1,
                                hidden, work.tokens * TOKEN_STORE_BYTES)
    return Plan(hw, target, work, stages, hidden, weights, [other], by_source)


# ------------------------------------------------------------------------------------------ output


def hours(seconds: float) -> str:
    return f"{seconds / 3600:,.2f}"


def describe(plan: Plan) -> list[str]:
    w, t, hw = plan.work, plan.target, plan.hardware
    return [f"target   {t.name}: {t.description}; {w.weights} weights {plan.weight_bytes / 1e9:,.0f} GB",
            f"workload {w.samples:,} samples x ({w.prompt_tokens:,.0f} prompt + {w.completion_tokens:,.0f} completion) "
            f"= {w.tokens / 1e6:,.1f}M tokens; {w.epochs} epochs, K={w.ttt_steps}, {w.concurrency} concurrent",
            f"machine  {hw.name}: {hw.description}, ${hw.price_per_hour:g}/h"]


def table(plan: Plan) -> str:
    lines = describe(plan) + ["", f"{'stage':<9} {'hours':>9}  what bounds it; calibration"]
    for s in plan.stages:
        lines.append(f"{s.stage:<9} {hours(s.seconds):>9}  {s.note}")
        lines += [f"{a.stage:<9} {hours(a.seconds):>9}  {a.note}" for a in plan.alternatives if s.stage == "extract"]
    lines += [f"{'total':<9} {hours(plan.seconds):>9}  bottleneck: {plan.bottleneck.stage}",
              f"disk      hidden store {plan.hidden_bytes / 1e12:,.2f} TB "
              f"({model.raw_bytes_per_token(plan.target):,.0f} B/token raw), weights {plan.weight_bytes / 1e9:,.0f} GB",
              f"cost      ${plan.dollars:,.0f} at ${plan.hardware.price_per_hour:g}/h", "",
              "train.source: extract + train hours, disk for states (the total above is the store's)"]
    lines += [f"{s.source:<9} {hours(s.seconds):>9}  {s.disk_bytes / 1e12:,.3f} TB; {s.note}" for s in plan.sources]
    return "\n".join(lines)


def comparison(a: Plan, b: Plan) -> str:
    """Per stage: hours on each machine and the speedup of `a` over `b`."""
    name_a, name_b = a.hardware.name, b.hardware.name
    lines = describe(a)[:2] + [f"machines {name_a} (${a.hardware.price_per_hour:g}/h) vs {name_b} "
                               f"(${b.hardware.price_per_hour:g}/h)", "",
                               f"{'stage':<9} {name_a:>16} {name_b:>16} {'speedup':>8}"]
    for sa in a.stages:
        sb = b.stage(sa.stage)
        lines.append(f"{sa.stage:<9} {hours(sa.seconds):>14} h {hours(sb.seconds):>14} h {sb.seconds / sa.seconds:>7.2f}x")
        if sa.stage == "extract":
            lines += [f"{xa.stage:<9} {hours(xa.seconds):>14} h {hours(xb.seconds):>14} h "
                      f"{xb.seconds / xa.seconds:>7.2f}x  (not in the total)"
                      for xa, xb in zip(a.alternatives, b.alternatives)]
    lines += [f"{'total':<9} {hours(a.seconds):>14} h {hours(b.seconds):>14} h {b.seconds / a.seconds:>7.2f}x",
              f"{'cost':<9} {'$' + format(a.dollars, ',.0f'):>16} {'$' + format(b.dollars, ',.0f'):>16}",
              f"bottleneck: {a.bottleneck.stage} on {name_a} ({a.bottleneck.seconds / a.seconds:.0%} of its time), "
              f"{b.bottleneck.stage} on {name_b} ({b.bottleneck.seconds / b.seconds:.0%})",
              f"disk: hidden store {a.hidden_bytes / 1e12:,.2f} TB on either"]
    return "\n".join(lines)


def plot(plans: list[Plan], path: Path) -> None:
    """Stacked horizontal bars: hours per stage, one bar per machine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.8 * len(plans)))
    for row, plan in enumerate(plans):
        left = 0.0
        for i, s in enumerate(plan.stages):
            ax.barh(row, s.seconds / 3600, left=left, color=f"C{i}", label=s.stage if row == 0 else None)
            left += s.seconds / 3600
        ax.text(left, row, f" {left:,.1f} h, ${plan.dollars:,.0f}", va="center")
    ax.set_yticks(range(len(plans)), [p.hardware.name for p in plans])
    ax.set_xlabel("hours")
    ax.set_title(f"{plans[0].target.name}: {plans[0].work.samples:,} samples, {plans[0].work.epochs} epochs")
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small")
    ax.margins(x=0.25)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hw", required=True, help="hardware profile (tools/planner/hardware/<name>.yaml)")
    p.add_argument("--target", required=True, help="target profile (tools/planner/targets/<name>.yaml)")
    p.add_argument("--samples", type=int, required=True)
    p.add_argument("--compare", help="a second hardware profile: speedup per stage and bottlenecks")
    p.add_argument("--prompt-tokens", type=float, default=500, help="mean prompt tokens per sample")
    p.add_argument("--completion-tokens", type=float, default=2000, help="mean generated tokens per sample")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--ttt-steps", type=int, default=7, help="training-time-test unroll K")
    p.add_argument("--concurrency", type=int, default=128, help="sequences decoded together")
    p.add_argument("--weights", help="weight format served (default: the target profile's)")
    p.add_argument("--extract-engine", choices=("vllm", "hf"), default="vllm",
                   help="the extraction path counted in the total (the other one is shown beside it)")
    p.add_argument("--store-dtype", choices=tuple(DEFAULT_STORED_OVER_RAW), default="bf16",
                   help="extract.store_dtype: the hidden store lossless (bf16) or in float8 (fp8_e4m3)")
    p.add_argument("--tokens-per-gpu-step", type=int, default=16384, help="training tokens per GPU per step")
    p.add_argument("--link-gbit", type=float, default=10.0, help="network of the rented box, Gbit/s")
    # Not metrics/ by default: whatever ran last in the working tree (a resumed stage, a run on shared cores)
    # would calibrate the plan; benchmarks/results/embedded-run-cpu is a whole run on an idle machine,
    # embedded-fp8-cpu the fp8 store's extract + train (its stored/raw prices --store-dtype fp8_e4m3).
    p.add_argument("--measured", type=Path, nargs="+",
                   default=[Path("benchmarks/results/embedded-run-cpu/metrics"),
                            Path("benchmarks/results/embedded-fp8-cpu/metrics"), Path("benchmarks/results")],
                   help="metrics dirs and benchmark files/dirs to calibrate on, preferred in this order "
                        "(add metrics to calibrate on your own last run)")
    p.add_argument("--profiles", type=Path, default=PLANNER_DIR)
    p.add_argument("--plot", type=Path, help="PNG of the stage hours (default run/plan/<target>-<hw>.png)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        target = load_target(args.target, args.profiles)
        machines = [load_hardware(name, args.profiles) for name in filter(None, (args.hw, args.compare))]
        work = model.Workload(samples=args.samples, prompt_tokens=args.prompt_tokens,
                              completion_tokens=args.completion_tokens, epochs=args.epochs, ttt_steps=args.ttt_steps,
                              concurrency=args.concurrency, weights=args.weights or target.default_weights,
                              tokens_per_device_step=args.tokens_per_gpu_step, link_gbit_s=args.link_gbit,
                              extract_engine=args.extract_engine, store_dtype=args.store_dtype)
        cal = calibrate(args.measured, args.profiles)
        plans = [project(target, hw, work, cal) for hw in machines]
    except (ProfileError, CalibrationError, ValueError) as err:
        sys.exit(f"plan: {err}")
    print(comparison(*plans) if len(plans) == 2 else table(plans[0]))
    if cal.unused:
        print("not calibrated on: " + "; ".join(cal.unused))
    path = args.plot or Path("run/plan") / f"{args.target}-{'-vs-'.join(m.name for m in machines)}.png"
    plot(plans, path)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
