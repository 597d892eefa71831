#!/usr/bin/env python3
"""SM clock and board power of each timed row, from an nvidia-smi trace (scripts/gpu-clocks.sh).

The H200 (and H100) hold a 700 W board limit: a GEMM that runs its tensor cores hard throttles
its SM clock ("SW power cap" in the clock-event reasons), and one that also streams its weights
from HBM spends part of that power on the memory and runs at a lower clock than a dense GEMM of
the same FLOPs. The bench's times alone do not show that; this table does.

    clock_table.py SMI_CSV MARKS [LABELS...]

SMI_CSV: `nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_event_reasons.active
--format=csv,noheader -lms 20`. MARKS: lines "MARK start|end NAME HH:MM:SS.mmm", one pair per
bench process, and optionally "MARK labels NAME a,b,c" naming that process's segments. Within a process the loaded samples (> LOAD_W watts) below FULL_MHZ form one
segment per timed row: between two rows the power falls and the clock returns to full for a few
samples, which splits them. LABELS names the segments of every process without labels of its own, in
order (e.g. "auto dense": the sweep's AUTO graph row, then cublas-dense; the copy floor runs at
full clock and is not a segment); a process whose segment count differs is printed unlabelled.
"""
import datetime
import sys

LOAD_W = 450.0
FULL_MHZ = 1850


def clock_time(text):
    return datetime.datetime.strptime(text, "%H:%M:%S.%f")


def read_trace(path):
    samples = []
    for line in open(path):
        fields = [f.strip() for f in line.split(",")]
        try:
            when = clock_time(fields[0].split()[1])
            mhz = int(fields[1].split()[0])
            watts = float(fields[2].split()[0])
        except (IndexError, ValueError):
            continue  # a header or a cut line
        capped = len(fields) > 3 and fields[3] not in ("0x0000000000000000", "Not Active")
        samples.append((when, mhz, watts, capped))
    return samples


def read_marks(path):
    """[(name, start, end, labels or None)] in the order the processes ended."""
    spans, start, labels = [], {}, {}
    for line in open(path):
        parts = line.split()
        if len(parts) != 4 or parts[0] != "MARK":
            continue
        if parts[1] == "labels":
            labels[parts[2]] = parts[3].split(",")
        elif parts[1] == "start":
            start[parts[2]] = clock_time(parts[3])
        elif parts[2] in start:
            spans.append((parts[2], start.pop(parts[2]), clock_time(parts[3]), labels.get(parts[2])))
    return spans


def segments(samples):
    runs, current = [], []
    for sample in samples:
        if sample[2] > LOAD_W and sample[1] < FULL_MHZ:
            current.append(sample)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [r for r in runs if len(r) >= 5]  # shorter: a ramp, not a row


def median(values):
    values = sorted(values)
    return values[len(values) // 2]


def describe(run):
    steady = run[len(run) // 4:]  # the first quarter is the power ramp
    capped = sum(s[3] for s in steady) / len(steady)
    return median(s[1] for s in steady), median(s[2] for s in steady), capped, len(run)


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    samples = read_trace(sys.argv[1])
    labels = sys.argv[3:]
    print(f"{'process':44s} {'row':10s} {'SM MHz':>7s} {'power W':>8s} {'capped':>7s} {'samples':>8s}")
    for name, start, end, own_labels in read_marks(sys.argv[2]):
        runs = segments([s for s in samples if start <= s[0] <= end])
        wanted = own_labels or labels
        names = wanted if len(wanted) == len(runs) else [f"seg{i}" for i in range(len(runs))]
        for label, run in zip(names, runs):
            mhz, watts, capped, count = describe(run)
            print(f"{name:44s} {label:10s} {mhz:7d} {watts:8.0f} {capped:7.0%} {count:8d}")


if __name__ == "__main__":
    main()
