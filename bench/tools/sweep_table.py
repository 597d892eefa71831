"""Summarises capmoe-bench --sweep JSON files: one line per (shape, routing, op), the roofline,
Auto, every config's graph-replay time as x roofline, and the winner.

    python3 bench/tools/sweep_table.py results_enk.json [results_ekn.json ...]
"""
import json
import sys
from collections import defaultdict


def load(paths):
    groups = defaultdict(dict)
    for path in paths:
        for row in json.load(open(path))["rows"]:
            key = (row["shape"], row["routing"], row["op"])
            if row["us"] is not None:
                groups[key][row["impl"]] = row["us"]
    return groups


def main(paths):
    groups = load(paths)
    configs = sorted({imp for g in groups.values() for imp in g if imp.startswith("capmoe-graph[")})
    short = [c[len("capmoe-graph["):-1] for c in configs]
    print("shape/routing/op | roofline us | auto | " + " | ".join(short) + " | best")
    for key in sorted(groups):
        g = groups[key]
        roof = g.get("roofline")
        if not roof:
            continue
        cells = [f"{g[c] / roof:.2f}" if c in g else "-" for c in configs]
        timed = {c: g[c] for c in configs if c in g}
        best = min(timed, key=timed.get) if timed else None
        best_text = f"{best[len('capmoe-graph['):-1]} {timed[best]:.0f}us {timed[best] / roof:.2f}x" if best else "-"
        auto = g.get("capmoe-graph")
        auto_text = f"{auto / roof:.2f}" if auto else "-"
        print(f"{'/'.join(key)} | {roof:.0f} | {auto_text} | " + " | ".join(cells) + f" | {best_text}")


if __name__ == "__main__":
    main(sys.argv[1:])
