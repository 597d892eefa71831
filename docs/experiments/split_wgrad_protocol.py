# A discrete-event model of the column-split counter wgrad's barrier protocol
# (csrc/grouped_gemm/sm90_counter_wgrad.cu, namespace split): its five roles (A + B0 producer,
# B1 producer, the two consumers, the storer) as generators that yield the barrier wait they
# block on, run in random interleavings over random tile lists (experts without rows, one K
# block, many). Checks: no deadlock; every parity wait names one phase (the barrier has
# completed the phase before the one meant, or that one: a parity test cannot tell a phase
# from the one two before it); no stage reloaded while read or read stale; no output tile
# rewritten before its store read it; the storer sees every tile of both consumers in order.
# A model, not the kernel: keep it in step with the kernel when either changes. Each of the
# mistakes this protocol was written to avoid (the B1 producer releasing A stages it has not
# seen filled, the order wait one phase off, an output tile freed right after its store is
# issued, a producer not waiting for a free B stage) makes it fail.
#   python3 docs/experiments/split_wgrad_protocol.py
import random, sys

class Bar:
    def __init__(s, name, count): s.name, s.count, s.pending, s.done = name, count, 0, 0
    def arrive(s):
        s.pending += 1
        assert s.pending <= s.count
        if s.pending == s.count: s.done += 1; s.pending = 0

class Violation(Exception): pass

def wait(bar, q):
    # the waiter means "phase q has completed"; the hardware tests parity only
    def cond():
        if not (q <= bar.done <= q + 1):
            raise Violation(f"ambiguous parity wait on {bar.name}: phase {q}, completed {bar.done}")
        return (bar.done & 1) != (q & 1)
    return cond

class Ring:
    def __init__(s, n): s.n, s.i = n, 0
    @property
    def stage(s): return s.i % s.n
    @property
    def lap(s): return s.i // s.n

def run(seed, SA, SB, tiles):
    rnd = random.Random(seed)
    full_a = [Bar(f"full_a{i}", 1) for i in range(SA)]
    empty_a = [Bar(f"empty_a{i}", 9) for i in range(SA)]
    masked = [Bar(f"masked{i}", 1) for i in range(SA)]
    full_b = [[Bar(f"full_b{c}{i}", 1) for i in range(SB)] for c in range(2)]
    empty_b = [[Bar(f"empty_b{c}{i}", 4) for i in range(SB)] for c in range(2)]
    written = [Bar(f"written{c}", 1) for c in range(2)]
    free = [Bar(f"free{c}", 1) for c in range(2)]
    stage_tile = [None] * SA
    a_data = [None] * SA          # (tile, kb) held by A stage
    b_data = [[None] * SB for _ in range(2)]
    a_readers = [0] * SA          # live readers of the A stage's lap
    out_slot = [None, None]
    out_data = [None, None]       # what out[c] holds; None = free for writing
    stored = []
    seq = tiles                   # this CTA's tiles: (id, k_blocks)

    def producer_a():
        ra, rb = Ring(SA), Ring(SB)
        for t in seq:
            tid, kbs = t
            for kb in range(max(kbs, 1)):
                sa = ra.stage
                yield wait(empty_a[sa], ra.lap - 1) if ra.lap > 0 else None
                if a_readers[sa] != 0: raise Violation(f"A stage {sa} reloaded while read")
                if kb == 0: stage_tile[sa] = t
                a_data[sa] = (tid, kb)
                if kbs > 0:
                    sb = rb.stage
                    yield None
                    full_a[sa].arrive()  # the data lands
                    yield wait(empty_b[0][sb], rb.lap - 1) if rb.lap > 0 else None
                    b_data[0][sb] = (tid, kb)
                    full_b[0][sb].arrive()
                    rb.i += 1
                else:
                    full_a[sa].arrive()
                ra.i += 1
        sa = ra.stage
        yield wait(empty_a[sa], ra.lap - 1) if ra.lap > 0 else None
        stage_tile[sa] = "stop"
        full_a[sa].arrive()

    def producer_b1():
        ra, rb = Ring(SA), Ring(SB)
        while True:
            yield wait(full_a[ra.stage], ra.lap)
            t = stage_tile[ra.stage]
            if t == "stop": return
            tid, kbs = t
            for kb in range(max(kbs, 1)):
                if kbs > 0:
                    sb = rb.stage
                    yield wait(empty_b[1][sb], rb.lap - 1) if rb.lap > 0 else None
                    b_data[1][sb] = (tid, kb)
                    yield None
                    full_b[1][sb].arrive()
                    rb.i += 1
                if kb > 0: yield wait(full_a[ra.stage], ra.lap)
                empty_a[ra.stage].arrive()
                ra.i += 1

    def consumer(c):
        ra, rb = Ring(SA), Ring(SB)
        done = 0
        while True:
            yield wait(full_a[ra.stage], ra.lap)
            t = stage_tile[ra.stage]
            if t == "stop": break
            tid, kbs = t
            if t != seq[done]: raise Violation(f"consumer {c} got tile {t}, expected {seq[done]}")
            if kbs == 0:
                for _ in range(4): empty_a[ra.stage].arrive()
                ra.i += 1
            else:
                for kb in range(kbs):
                    sa, sb = ra.stage, rb.stage
                    yield wait(full_a[sa], ra.lap)
                    yield wait(full_b[c][sb], rb.lap)
                    if a_data[sa] != (tid, kb) or b_data[c][sb] != (tid, kb):
                        raise Violation(f"consumer {c} read stale stage {sa}/{sb}: {a_data[sa]} {b_data[c][sb]} for {(tid, kb)}")
                    last = kb == kbs - 1
                    if last:
                        if c == 0:
                            masked[sa].arrive()
                        else:
                            yield wait(masked[sa], masked_uses[sa])
                        masked_uses_c[c][sa] += 1
                        if c == 1: masked_uses[sa] += 1
                    a_readers[sa] += 1
                    yield None  # the wgmmas read the stage
                    a_readers[sa] -= 1
                    for _ in range(4):
                        empty_a[sa].arrive()
                        empty_b[c][sb].arrive()
                    ra.i += 1; rb.i += 1
            # the output turn
            if done > 0: yield wait(free[c], done - 1)
            if c == 1: yield wait(written[0], done)
            if out_data[c] is not None: raise Violation(f"out[{c}] overwritten before its store read it")
            out_data[c] = (tid, c)
            out_slot[c] = (tid, c)
            yield None
            written[c].arrive()
            done += 1
        if c == 0:
            if done > 0: yield wait(free[0], done - 1)
            out_slot[0] = "stop"
            written[0].arrive()

    def storer():
        k = 0
        while True:
            c = k & 1
            yield wait(written[c], k >> 1)
            slot = out_slot[c]
            if slot == "stop": return
            stored.append(slot)
            yield None  # the store reads out[c]
            if k > 0:
                out_data[c ^ 1] = None  # the previous one has been read
                free[c ^ 1].arrive()
            k += 1

    masked_uses = [0] * SA
    masked_uses_c = [[0] * SA, [0] * SA]
    roles = {"p0": producer_a(), "p1": producer_b1(), "c0": consumer(0), "c1": consumer(1), "st": storer()}
    conds = {name: None for name in roles}
    steps = 0
    while roles:
        ready = [n for n in roles if conds[n] is None or conds[n]()]
        if not ready:
            raise Violation("deadlock: " + ", ".join(f"{n}" for n in roles))
        n = rnd.choice(ready)
        try:
            conds[n] = next(roles[n])
        except StopIteration:
            del roles[n]; del conds[n]
        steps += 1
        if steps > 10**6: raise Violation("runaway")
    want = [(tid, c) for tid, _ in seq for c in (0, 1)]
    if stored != want: raise Violation(f"stored {stored[:6]}... expected {want[:6]}...")

if __name__ == "__main__":
    runs = 0
    for SA, SB in [(4, 3), (5, 2), (6, 2), (3, 3), (2, 2)]:
        for seed in range(400):
            rnd = random.Random(seed * 7 + SA)
            n = rnd.randint(0, 12)
            tiles = [(i, rnd.choice([0, 1, 1, 2, 3, 4, 4, 9, 33])) for i in range(n)]
            run(seed, SA, SB, tiles)
            runs += 1
    print(f"ok: {runs} random interleavings, no deadlock, no ambiguous parity wait, no early reuse")
