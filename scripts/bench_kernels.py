"""What each llama.cpp kernel plan costs on this machine: verification t(1..N) per mode, interleaved.

Each pass runs ``hetero-spec calibrate`` once per mode in a child process (the plan is fixed per
process: ``HETERO_SPEC_KERNELS``), in alternating order, and the table gives the median over passes.
Modes that would crash here (``default`` where AMX tiles fault) are refused.

    python scripts/bench_kernels.py MODEL.gguf [--modes no-amx,plain] [--passes 3] [--threads 2] \
        [--out results/kernels/NAME.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

from hetero_spec.bench.command import model_arg
from hetero_spec.cpu_features import cpu_info
from hetero_spec.target.kernels import ENV, MODES, decide


def calibrate(model: Path, mode: str, threads: int, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "curve.json"
        cmd = [sys.executable, "-m", "hetero_spec", "calibrate", str(model), "-t", str(threads),
               "--repeats", str(repeats), "--out", str(out), "--plot", str(Path(tmp) / "curve.png")]
        proc = subprocess.run(cmd, env=dict(os.environ, **{ENV: mode}), capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"error: calibrate under {mode} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
        return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--modes", help=f"comma-separated, of {', '.join(MODES)} (default: this machine's plan and plain)")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--threads", "-t", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=9, help="timings per n in each calibration")
    ap.add_argument("--max-n", type=int, default=8)
    ap.add_argument("--out", type=Path, help="JSON of the medians, the command and the CPU")
    args = ap.parse_args()
    if not args.model.is_file():
        sys.exit(f"error: model file not found: {args.model}")
    auto = decide("auto")
    modes = args.modes.split(",") if args.modes else list(dict.fromkeys([auto.mode, "plain"]))
    for m in modes:
        if m not in MODES:
            sys.exit(f"error: unknown mode {m!r} (expected {', '.join(MODES)})")
        if m == "default" and auto.mode != "default":
            sys.exit(f"error: mode default would crash here ({auto.reason})")
    curves: dict[str, list[dict]] = {m: [] for m in modes}
    with tqdm(total=args.passes * len(modes), desc="calibrate", unit="run") as bar:
        for p in range(args.passes):
            for m in (modes if p % 2 == 0 else modes[::-1]):
                curves[m].append(calibrate(args.model, m, args.threads, args.repeats))
                bar.update(1)
    ns = list(range(1, args.max_n + 1))
    table = {m: {n: statistics.median(c["verify_ms"][str(n)] for c in curves[m]) for n in ns} for m in modes}
    cpu, flags = cpu_info()
    result = {
        "command": " ".join(["python", "scripts/bench_kernels.py", model_arg(args.model), "--modes", ",".join(modes),
                             "--passes", str(args.passes), "--threads", str(args.threads)]),
        "cpu": cpu, "cpu_flags": sorted(f for f in flags if f.startswith(("avx", "amx"))),
        "threads": args.threads, "passes": args.passes, "auto_plan": auto.describe(),
        "kernels": {m: curves[m][0].get("kernels", "") for m in modes},
        "verify_ms": {m: {str(n): round(v, 3) for n, v in table[m].items()} for m in modes},
    }
    print(f"# {args.model.name}, {cpu}, {args.threads} threads, median of {args.passes} interleaved passes")
    print("| n | " + " | ".join(f"{m} t(n) ms | {m} t(n)/t(1)" for m in modes) + " |")
    print("|---:|" + "---:|---:|" * len(modes))
    for n in ns:
        cells = " | ".join(f"{table[m][n]:.2f} | {table[m][n] / table[m][1]:.2f}" for m in modes)
        print(f"| {n} | {cells} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
