"""The ratio plot (``bench/e2e_ratios.png``) from saved results: end to end and per op.

    python bench/plot.py --e2e OUT/e2e.json [--e2e ...] --csv OUT/bench-*.csv [--csv ...] \
        [--out bench/e2e_ratios.png]

Left panel: each training-step row of ``bench/e2e.py`` as its speed-up over the eager PEFT
row of the same run (several runs: a later file replaces an earlier row of the same model,
adapter and variant; rows are labelled with their model when the files hold more than one).
Right panel: eager / ours per op from ``bench/bench.py``'s CSV, ours being the
tier ``auto`` takes (the CSV's ``ours == yes`` rows), forward and forward+backward per shape
and dtype (a later CSV replaces an earlier row of the same spec, shape, dtype and phase).
Needs matplotlib.
"""
import argparse
import csv
import json
import os
from typing import Dict, List, Optional, Sequence


def e2e_rows(paths: Sequence[str]) -> List[dict]:
    rows: Dict[tuple, dict] = {}
    for p in paths:
        with open(p) as f:
            doc = json.load(f)
        model = doc.get("meta", {}).get("model", "transformer")
        for r in doc["rows"]:
            if r.get("x_eager") == r.get("x_eager"):  # not NaN (a base row without a PEFT reference)
                rows[(model, r["adapter"], r["variant"])] = dict(r, model=model)
    return list(rows.values())


def per_op_rows(paths: Sequence[str]) -> List[dict]:
    rows: Dict[tuple, dict] = {}
    for p in paths:
        with open(p) as f:
            for r in csv.DictReader(f):
                ours = r.get("ours") == "yes" or r.get("column") == "ours"
                if r.get("kind") == "time" and ours and r.get("x_eager") not in (None, ""):
                    rows[(r["spec"], r["shape"], r["dtype"], r["phase"])] = r
    return [rows[k] for k in sorted(rows)]


def plot(rows: List[dict], per_op: Optional[List[dict]], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = 2 if per_op else 1
    fig, axes = plt.subplots(1, panels, figsize=(7 * panels, 4.5), squeeze=False)
    ax = axes[0][0]
    ax.bar(range(len(rows)), [r["x_eager"] for r in rows])
    ax.axhline(1.0, color="k", lw=0.8)
    models = {r.get("model", "transformer") for r in rows}
    label = (lambda r: f"{r['model']} {r['adapter']}\n{r['variant']}") if len(models) > 1 else \
        (lambda r: f"{r['adapter']}\n{r['variant']}")
    ax.set_xticks(range(len(rows)), [label(r) for r in rows], rotation=90, fontsize=7)
    ax.set_ylabel("step speed-up vs eager PEFT")
    ax.set_title("end-to-end training step")
    if per_op:
        ax2 = axes[0][1]
        ax2.bar(range(len(per_op)), [float(r["x_eager"]) for r in per_op])
        ax2.axhline(1.0, color="k", lw=0.8)
        labels = [f"{r['spec']} {r['shape']} {r['dtype']} {'f+b' if r['phase'] == 'fwdbwd' else r['phase']}"
                  for r in per_op]
        ax2.set_xticks(range(len(per_op)), labels, rotation=90, fontsize=6)
        ax2.set_yscale("log")
        ax2.set_ylabel("eager / ours (per op, log)")
        ax2.set_title("per op (tier auto takes)")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    print(f"plot: {path}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--e2e", action="append", default=[], help="e2e.json of bench/e2e.py (repeatable)")
    ap.add_argument("--csv", action="append", default=[], help="CSV of bench/bench.py (repeatable)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "e2e_ratios.png"))
    args = ap.parse_args(argv)
    plot(e2e_rows(args.e2e), per_op_rows(args.csv) or None, args.out)


if __name__ == "__main__":
    main()
