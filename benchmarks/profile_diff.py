"""Two step profiles side by side: where the GPU time moved between them, by program, category and
source, from the ``ops.jsonl`` files ``step_profile.py --out DIR`` writes (per-step times).

    python benchmarks/profile_diff.py BEFORE/ops.jsonl AFTER/ops.jsonl [--top 30]

JSON lines, the largest changes first::

    {"program": "jit_gradients", "category": "fusion", "source": "kda/mixer/split", "pass": "bwd",
     "before_ms": 6.06, "after_ms": 2.10, "delta_ms": -3.96}

then totals per program (``"source": "(all)"``). Reading them needs nothing but the files, so two
profiles from a GPU can be compared anywhere.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys


def per_source(path: str) -> collections.Counter:
    """``{(program, category, source, pass): ms per step}`` of one ``ops.jsonl``."""
    totals = collections.Counter()
    with open(path) as f:
        for line in f:
            op = json.loads(line)
            totals[(op.get("module") or "(unnamed)", op["category"], op["source"],
                    op["pass"])] += op["ms"]
    return totals


def diff(before: collections.Counter, after: collections.Counter
         ) -> tuple[list[dict], list[dict]]:
    """``(changes, totals)``: one row per source in either profile, the largest change first, and
    one row per program with its totals."""
    def row(names: dict, a, b) -> dict:
        return {**names, "before_ms": round(float(a), 3), "after_ms": round(float(b), 3),
                "delta_ms": round(float(b - a), 3)}

    keys = before.keys() | after.keys()
    changes = sorted((row(dict(zip(("program", "category", "source", "pass"), key)),
                          before[key], after[key]) for key in keys),
                     key=lambda r: (-abs(r["delta_ms"]), r["source"]))
    totals = [row({"program": program, "source": "(all)"},
                  sum(v for k, v in before.items() if k[0] == program),
                  sum(v for k, v in after.items() if k[0] == program))
              for program in sorted({k[0] for k in keys})]
    return changes, totals


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("before", help="ops.jsonl of the first profile")
    ap.add_argument("after", help="ops.jsonl of the second profile")
    ap.add_argument("--top", type=int, default=30, help="sources to print (the totals follow)")
    args = ap.parse_args(argv)
    changes, totals = diff(per_source(args.before), per_source(args.after))
    for row in changes[:args.top] + totals:
        print(json.dumps(row))
    print(f"\n{'program / source':<60}{'pass':>5}{'before':>9}{'after':>9}{'delta':>9}",
          file=sys.stderr)
    for row in changes[:min(args.top, 20)] + totals:
        name = row["program"] if row["source"] == "(all)" else f"{row['category']} {row['source']}"
        print(f"{name[:59]:<60}{row.get('pass', ''):>5}{row['before_ms']:>9.2f}"
              f"{row['after_ms']:>9.2f}{row['delta_ms']:>+9.2f}", file=sys.stderr)


if __name__ == "__main__":
    main()
