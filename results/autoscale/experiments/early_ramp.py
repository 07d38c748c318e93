"""The first minutes of one run of the shipped policy: 30 s bins of arrivals, missed, provisioned, serving.

    python results/autoscale/experiments/early_ramp.py diurnal 12 > early_ramp/diurnal-12.txt

Seeds outside the judging seeds only (autoscale/scenarios.py), like `python -m autoscale.timeline`.
"""

import sys

from autoscale.experiment import DEFAULT_DEPLOYMENT, PolicySpec, load_deployment, smallest_static
from autoscale.scenarios import JUDGING_SEEDS, TraceSpec, build_trace
from autoscale.sim import ScaleEvent, simulate

BIN_S, BINS, EVENTS = 30, 16, 6

kind, seed = sys.argv[1], int(sys.argv[2])
if seed in JUDGING_SEEDS:
    raise SystemExit(f"seed {seed} judges the benchmark")
spec, dep = TraceSpec(kind, seed), load_deployment(str(DEFAULT_DEPLOYMENT))
trace, static = build_trace(spec), smallest_static(spec, dep)
events: list[ScaleEvent] = []
policy = PolicySpec("headroom", "headroom").build(dep, trace)
run = simulate(
    trace, policy, dep.setup(seed, static["initial_replicas"]), keep_timeline=True, on_event=events.append
)
tl = run.timeline
assert tl is not None
print(f"{spec.label}: static 99% fleet {static['static_replicas']}, start fleet {static['initial_replicas']}")
print("bin start s | arrivals/s | missed | provisioned | serving")
for b in range(BINS):
    span = slice(b * BIN_S, (b + 1) * BIN_S)
    print(f"{b * BIN_S} | {tl['rate_rps'][b]:.1f} | {tl['missed'][b]} | {max(tl['provisioned'][span])} | "
          f"{min(tl['ready'][span])}")  # fmt: skip
for e in events[:EVENTS]:
    print(f"{e.t_s:.0f} s: {e.from_replicas} -> {e.to_replicas} ({e.code}): {e.reason}")
