"""Summarizes ncu's CSV (--csv --metrics gpu__time_duration.sum,
launch__grid_size,launch__block_size) per kernel and grid: launches,
total and mean GPU time, share of the whole. Used by tests/gpu/profile.sh.

    python3 tests/gpu/ncu_summary.py ncu.csv [top]
"""
import csv
import sys
from collections import defaultdict


def main(path, top=40):
    rows = defaultdict(lambda: [0, 0.0])
    with open(path, newline="") as f:
        lines = [ln for ln in f if ln.startswith('"')]
    per = defaultdict(dict)
    for r in csv.DictReader(lines):
        key = (r["ID"], r["Kernel Name"].split("(")[0])
        val = float(r["Metric Value"].replace(",", ""))
        unit = r.get("Metric Unit", "")
        if r["Metric Name"] == "gpu__time_duration.sum":
            val *= {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6, "second": 1e6}.get(unit, 1.0)
        per[key][r["Metric Name"]] = val
        per[key]["grid"] = r.get("Grid Size", "")
        per[key]["block"] = r.get("Block Size", "")
    total = 0.0
    for (_, name), m in per.items():
        us = m.get("gpu__time_duration.sum", 0.0)
        k = (name, m["grid"], m["block"])
        rows[k][0] += 1
        rows[k][1] += us
        total += us
    print(f"{len(per)} launches, {total / 1e3:.2f} ms of GPU time")
    print(f"{'share':>6} {'total ms':>9} {'launches':>8} {'mean us':>9}  kernel grid block")
    for (name, grid, block), (n, us) in sorted(rows.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"{100 * us / total:5.1f}% {us / 1e3:9.3f} {n:8d} {us / n:9.2f}  {name} {grid} {block}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40)
