"""The one timer of the benchmark suites: CUDA events around CUDA-graph replays, the L2 flush, the copy bandwidth.

Timing: CUDA events around each call, median of many calls. **L2 cold** rows zero a 1 GiB buffer
before every call (the H200's L2 is ~60 MB), which also keeps the GPU busy while Python launches the
next call, so launch overhead does not leak into the numbers; inputs rotate among several copies.
**L2 warm** rows replay a CUDA graph of the same call on the same input. The device-to-device copy
bandwidth is measured in the same run; effective TB/s is the bytes the operation must move over the time.
"""

from __future__ import annotations

import math
import statistics
import time
from functools import partial

import torch

FLUSH_BYTES = 1 << 30


# ------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------
class Timer:
    def __init__(self, device: torch.device, reps: int):
        self.device = device
        self.reps = reps
        self.on_gpu = device.type == "cuda"
        self.flush = torch.empty(FLUSH_BYTES // 4 if self.on_gpu else 1, dtype=torch.int32, device=device)
        self.mode = "graph" if self.on_gpu else "cpu"

    def cold(self, fns) -> float:
        """Median µs of one call, L2 flushed before each; ``fns`` rotates over input copies.

        On a GPU each call is captured once in a CUDA graph and the graph is replayed, so the
        time is the GPU's alone (no Python launch overhead); ``self.mode`` says "graph" or, when
        a call cannot be captured, "eager".
        """
        for fn in fns:  # warm-up / compile
            fn()
        if not self.on_gpu:
            self.mode = "cpu"
            times = []
            for i in range(self.reps):
                t0 = time.perf_counter()
                fns[i % len(fns)]()
                times.append((time.perf_counter() - t0) * 1e6)
            return statistics.median(times)
        torch.cuda.synchronize()
        try:
            calls = [capture_graph(fn).replay for fn in fns]
            self.mode = "graph"
        except Exception:  # not capturable (e.g. a host sync inside): time eager calls
            torch.cuda.synchronize()
            calls = list(fns)
            self.mode = "eager"
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        for i in range(self.reps):
            self.flush.zero_()
            starts[i].record()
            calls[i % len(calls)]()
            ends[i].record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends, strict=True))

    def warm(self, fn, calls: int = 20) -> float:
        """Median µs of one call replayed from a CUDA graph of ``calls`` calls on the same (L2-resident) input."""
        if not self.on_gpu:
            return self.cold([fn])
        fn()
        graph = capture_graph(fn, calls)
        times = []
        for _ in range(max(5, self.reps // 10)):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            graph.replay()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e) * 1e3 / calls)
        return statistics.median(times)



def capture_graph(fn, calls: int = 1) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``calls`` back-to-back calls of ``fn`` (warmed up on a side stream first)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph



COPY_DETAIL: dict = {}


def copy_bandwidth(device: torch.device, timer: Timer) -> float:
    """Device-to-device copy bandwidth in TB/s (bytes read + bytes written), the best of two ways.

    Eager ``copy_`` (a copy kernel on the SMs) and an elementwise ``mul`` kernel, each timed with
    events around eager calls (a 1 GiB copy takes ~0.5 ms, so launch overhead does not matter).
    Not a graph replay: inside a CUDA graph a device-to-device copy becomes a memcpy node that
    may run on the copy engines, which move ~2.7 TB/s on an H200 (seen here), not ~4.3.
    """
    if device.type != "cuda":
        return float("nan")
    n = (1 << 30) // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    ways = {"copy_": partial(dst.copy_, src), "mul": partial(torch.mul, src, 1.0, out=dst)}
    for name, fn in ways.items():
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(20):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e) * 1e-3)
        COPY_DETAIL[name] = round(2 * n * 4 / statistics.median(times) / 1e12, 3)
    return max(COPY_DETAIL.values())



def eager_cold(timer, fn, reps, before=None):
    """Median µs of eager calls of ``fn`` with the L2 flushed before each (for calls that cannot be captured);
    ``before()``, untimed, ahead of each (e.g. restoring state the call changes)."""
    fn()
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        if timer.on_gpu:
            timer.flush.zero_()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)



# ------------------------------------------------------------------------------------------
# Suites
# ------------------------------------------------------------------------------------------
def row(shape, k, dist, l2, torch_us, ours_us, bytes_moved, copy_bw, op, **extra):
    """One result row (and its progress line). Bandwidth is reported on a GPU only (``copy_bw`` is NaN on CPU,
    where interpreter timings say nothing about bytes): there the row holds None and the line says n/a."""
    on_gpu = math.isfinite(copy_bw)
    tbps = bytes_moved / (ours_us * 1e-6) / 1e12 if on_gpu and ours_us and ours_us > 0 else None
    speedup = torch_us / ours_us if ours_us and math.isfinite(torch_us) else None
    row = dict(op=op, shape=shape, k=k, distribution=dist, l2=l2, torch_us=round(torch_us, 2),
               ours_us=round(ours_us, 2), speedup=None if speedup is None else round(speedup, 2),
               bytes=int(bytes_moved), tbps=None if tbps is None else round(tbps, 3),
               pct_copy_bw=None if tbps is None else round(100 * tbps / copy_bw, 1))
    row.update(extra)
    k_txt = "-" if k is None else k
    rate = "n/a on CPU" if tbps is None else f"{tbps:6.2f} TB/s ({row['pct_copy_bw']}% of copy)"
    print(f"  {op:<14} {shape:<22} k={k_txt:<5} {dist:<10} L2 {l2:<4} torch {torch_us:9.1f} us | ours "
          f"{ours_us:9.1f} us | {'x  n/a' if speedup is None else f'x{speedup:6.2f}'} | {rate}", flush=True)
    return row


def wall_clock_us(fn, reps: int, device: torch.device) -> float:
    """Median wall-clock µs of ``fn`` (synced before and after): for host-bound baselines such as per-request loops."""
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)
