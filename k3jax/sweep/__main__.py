"""``python -m k3jax.sweep {plan,run,report}``.

    plan SPEC [--dir DIR]              print the points (name, N, N_total, D, C, time);
                                       trains nothing
    run SPEC --dir DIR [--executor K]  run every unfinished point (again: resumes)
    report DIR [--compute C] [--out O] results table, fits, plots and a markdown summary
                                       (DIR/report)
"""

from __future__ import annotations

import argparse
import sys

from k3jax.config.base import ConfigError
from k3jax.sweep.spec import EXECUTORS, load_sweep


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m k3jax.sweep",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="print the points of a sweep file")
    p.add_argument("spec")
    p.add_argument("--dir", help="a sweep directory whose finished points give measured tokens/s")
    r = sub.add_parser("run", help="run (or resume) a sweep")
    r.add_argument("spec")
    r.add_argument("--dir", required=True)
    r.add_argument("--executor", choices=EXECUTORS, help="overrides the sweep file's executor")
    r.add_argument("--devices", choices=("cpu", "gpu"))
    r.add_argument("--per-device", type=int,
                   help="local: runs sharing each GPU, or the number of CPU processes")
    rep = sub.add_parser("report", help="tables, fits, plots and a summary of a sweep directory")
    rep.add_argument("dir")
    rep.add_argument("--compute", type=float,
                     help="the compute C at which multipliers are stated (default: the plan's "
                          "reference_compute, else its largest budget)")
    rep.add_argument("--bootstrap", type=int, default=200, help="bootstrap resamples")
    rep.add_argument("--out", help="where the report goes (default: DIR/report)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "report":
            from k3jax.sweep.report import write_report

            print(write_report(args.dir, compute=args.compute, resamples=args.bootstrap,
                               out=args.out))
            return 0
        from k3jax.sweep.plan import format_plan, plan_sweep

        sweep = load_sweep(args.spec)
        if args.command == "run":
            changes = {k: v for k, v in (("kind", args.executor), ("devices", args.devices),
                                         ("per_device", args.per_device)) if v is not None}
            sweep = sweep.with_executor(**changes)
        plan = plan_sweep(sweep)
        if args.command == "plan":
            from k3jax.sweep.report import measured_tokens_per_s

            print(format_plan(plan, measured_tokens_per_s(args.dir) if args.dir else None))
            return 0
        from k3jax.sweep.runner import run_sweep

        statuses = run_sweep(plan, args.dir)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    counts = {s: sum(v == s for v in statuses.values()) for s in sorted(set(statuses.values()))}
    print(f"[sweep] {', '.join(f'{n} {s}' for s, n in counts.items())}")
    return 0 if set(statuses.values()) == {"done"} else 1


if __name__ == "__main__":
    sys.exit(main())
