"""Summarises capmoe-bench --sweep JSON files: one line per (shape, routing, op), the roofline,
Auto, every config's graph-replay time as x roofline, and the winner. Then what issue 13 acts
on: the cases where Auto is slower than the best config, and each config's count of cases it
wins or comes within NEAR of the best; a config near the best nowhere (over every file given,
so pass both weight layouts) is a candidate to delete, since every config costs CI time,
unless KEPT_FOR_UNSWEPT names it (it serves cases no sweep times).

    python3 bench/tools/sweep_table.py results_enk.json [results_ekn.json ...]
"""
import json
import sys
from collections import defaultdict

# A config within this factor of a case's best time counts as near the best there.
NEAR = 1.02
# Auto more than this factor slower than the best config is listed as a case to fix.
AUTO_SLACK = 1.03
PREFIX = "capmoe-graph["
# Configs kept for cases a sweep does not time, whatever their count of cases near the best.
KEPT_FOR_UNSWEPT = {
    "sm90-coop": "the wgrad for an fp32 dW (accumulate), pointer arrays and more than 1024 experts",
}


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
    configs = sorted({imp for g in groups.values() for imp in g if imp.startswith(PREFIX)})
    short = [config_name(c) for c in configs]
    print("shape/routing/op | roofline us | auto | " + " | ".join(short) + " | best")
    for key in sorted(groups):
        g = groups[key]
        roof = g.get("roofline")
        if not roof:
            continue
        cells = [f"{g[c] / roof:.2f}" if c in g else "-" for c in configs]
        timed = {c: g[c] for c in configs if c in g}
        best = min(timed, key=timed.get) if timed else None
        best_text = f"{config_name(best)} {timed[best]:.0f}us {timed[best] / roof:.2f}x" if best else "-"
        auto = g.get("capmoe-graph")
        auto_text = f"{auto / roof:.2f}" if auto else "-"
        print(f"{'/'.join(key)} | {roof:.0f} | {auto_text} | " + " | ".join(cells) + f" | {best_text}")


def config_name(impl):
    return impl[len(PREFIX):-1]


def summary(groups):
    """(cases where Auto trails the best config, wins per config, near-best counts per config)."""
    wins, near = defaultdict(int), defaultdict(int)
    configs = {imp for g in groups.values() for imp in g if imp.startswith(PREFIX)}
    for c in configs:
        wins[config_name(c)] += 0
        near[config_name(c)] += 0
    auto_behind = []
    for key in sorted(groups):
        g = groups[key]
        timed = {config_name(c): g[c] for c in configs if c in g}
        if not timed:
            continue
        best = min(timed, key=timed.get)
        wins[best] += 1
        for c, us in timed.items():
            if us <= timed[best] * NEAR:
                near[c] += 1
        auto = g.get("capmoe-graph")
        if auto and auto > timed[best] * AUTO_SLACK:
            auto_behind.append((key, auto, best, timed[best]))
    return auto_behind, wins, near


def print_summary(groups):
    auto_behind, wins, near = summary(groups)
    print(f"\nAuto more than {AUTO_SLACK:.2f}x the best config ({len(auto_behind)} cases):")
    for key, auto, best, best_us in auto_behind:
        print(f"  {'/'.join(key)}: auto {auto:.0f}us, {best} {best_us:.0f}us ({auto / best_us:.2f}x)")
    print(f"\nconfig: cases won / cases within {NEAR:.2f}x of the best")
    for c in sorted(near, key=lambda c: (-near[c], c)):
        print(f"  {c}: {wins[c]} / {near[c]}")
    nowhere = sorted(c for c in near if near[c] == 0)
    candidates = [c for c in nowhere if c not in KEPT_FOR_UNSWEPT]
    print("near the best nowhere (candidates to delete): " + (", ".join(candidates) if candidates else "none"))
    for c in nowhere:
        if c in KEPT_FOR_UNSWEPT:
            print(f"  {c} is near the best nowhere but kept: {KEPT_FOR_UNSWEPT[c]}")


if __name__ == "__main__":
    main(sys.argv[1:])
    print_summary(load(sys.argv[1:]))
