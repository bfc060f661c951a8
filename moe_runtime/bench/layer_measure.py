"""The layer mode's measurements on one rank: the layers and the GShard
peer of a run, and how each configuration of a case is stepped and timed."""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from a2a.bench import common

from .layer_options import Case
from .layer_summary import TUNING_STEP_LIMIT, config_label, summarize, summarize_switch, trials_without_prior
from .rank import slowest

__all__ = ["LayerBench", "Timing", "static_configs"]

WINDOW = 128  # the dictionary's capacity window (its default)


@dataclass
class Timing:
    """One configuration of a case: a step to warm up and time."""

    kind: str  # "static", "adaptive", "expert", "gshard", "graphed", "captured", a peer's name
    step: Callable[[], None]
    r: int | None = None
    d: int | None = None
    algo: str | None = None
    plan: Any = None  # static: the layer's last_plan after the step


def static_configs(valid_rs: list[int], degrees: list[int], algos: list[str]) -> list[tuple[int, int, str]]:
    """Every (r, d, algo) the sweep times: r = 0 once (no exchange to split or route)."""
    configs = []
    for r in valid_rs:
        if r == 0:
            configs.append((0, 1, "linear"))
        else:
            configs += [(r, d, algo) for d in degrees for algo in algos]
    return configs


class LayerBench:
    """The objects of one run on one rank: the communicator, the layers, the peer."""

    def __init__(self, args: argparse.Namespace):
        import torch
        from mpi4py import MPI

        import a2a

        from ..common.host_values import torch_device
        from .peer import GShardPeer

        self.args, self.torch, self.a2a = args, torch, a2a
        self.world = MPI.COMM_WORLD
        if args.device == "cuda":
            self.comm = common.cuda_comm(self.world, local_size=args.local_size, transport=args.transport)
        else:
            self.comm = a2a.Comm.from_mpi(self.world, local_size=args.local_size)
        self.device = torch_device(self.comm)  # the layers, tokens and buffers: where the communicator moves memory
        self.clock = common.Clock(torch, args.device)
        self.dtype = getattr(torch, args.dtype)
        ranks = self.comm.size
        per_device = args.experts // ranks if args.experts >= ranks else -(ranks // args.experts)
        self.layer_args = (
            {"type": "top", "k": args.top_k},
            args.model_dim,
            {"type": "ffn", "num_experts_per_device": per_device, "hidden_size_per_expert": args.hidden},
        )
        self.layer = self.new_layer()
        self.peer = None
        if not args.no_peer and self.layer.experts.sharers == 1:
            self.peer = GShardPeer(self.layer).to(device=self.device, dtype=self.dtype)

    def new_layer(self, **options: Any) -> Any:
        """A layer with the run's sizes and weights (seeds 1, 2), on the run's device and dtype."""
        from ..layer import MoELayer

        layer = MoELayer(*self.layer_args, comm=self.comm, seeds=(1, 2), **options)
        return layer.to(device=self.device, dtype=self.dtype)

    def adaptive_layer(self, adaptive: Any) -> Any:
        """The layer under the dictionary `adaptive`, whose trials are timed
        by the run's clock (on CUDA: until the device is done)."""
        return self.new_layer(adaptive=adaptive, timer=self.clock.now)

    # -- timing ------------------------------------------------------------------------------------------
    def timed(self, step: Callable[[], None]) -> float:
        """Seconds of one step, from a barrier (the device idle) until the
        step's work is done (on CUDA: synchronized), the maximum over ranks."""
        self.clock.sync()
        self.world.Barrier()
        start = time.perf_counter()
        step()
        return slowest(self.clock.now() - start, self.comm)

    def tokens(self, count: int) -> Any:
        torch = self.torch
        generator = torch.Generator(device=self.device).manual_seed(7919 * count + self.comm.rank)
        x = torch.randn(count, self.args.model_dim, generator=generator, dtype=torch.float32, device=self.device)
        return x.to(self.dtype).requires_grad_(True)

    @staticmethod
    def layer_step(layer: Any, x: Any, **options: Any) -> Callable[[], None]:
        def step() -> None:
            x.grad = None
            layer.zero_grad(set_to_none=True)
            y = layer(x, **options)
            (y.sum() + y.l_aux).backward()

        return step

    @staticmethod
    def captured_step(layer: Any, x: Any, **options: Any) -> Callable[[], None]:
        """The step as a caller captures it whole (forward, loss, backward in one torch.cuda.graph, as
        Megatron-Core's full-iteration graphs): three eager steps on a side stream, the capture at the
        first call, then a replay per call. The gradients stay in the graph's memory, where each replay
        writes them."""
        import torch

        graph = None

        def step() -> None:
            nonlocal graph
            if graph is None:
                plain = LayerBench.layer_step(layer, x, **options)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(3):
                        plain()
                torch.cuda.current_stream().wait_stream(side)
                capture = torch.cuda.CUDAGraph()
                with torch.cuda.graph(capture):
                    plain()  # its gradients set to None first: the captured backward makes them, in the graph
                graph = capture
            graph.replay()

        return step

    def static_timing(self, x: Any, factor: float, r: int, d: int, algo: str) -> Timing:
        """The static layer at (r, d, algo); the timing keeps the plan of its last step."""
        step = self.layer_step(self.layer, x, capacity_factor=factor, adaptive_r=r, a2a_ffn_overlap_degree=d,
                               algo=algo)
        timing = Timing("static", step, r, d, algo)

        def remembering() -> None:
            step()
            timing.plan = self.layer.last_plan

        timing.step = remembering
        return timing

    def tune(self, layer: Any, x: Any, factor: float) -> dict:
        """Real steps of the adaptive layer until its dictionary has tuned the
        case's capacity; what the search cost and chose."""
        step = self.layer_step(layer, x, capacity_factor=factor)
        start = self.clock.now()
        step()
        steps, capacity = 1, layer.last_plan.capacity
        while layer.adaptive.tuning(capacity):
            if steps >= TUNING_STEP_LIMIT:
                raise RuntimeError(f"the dictionary did not finish tuning capacity {capacity} in {steps} steps")
            step()
            steps += 1
        seconds = slowest(self.clock.now() - start, self.comm)
        entry = layer.adaptive.entries[capacity // WINDOW]
        config = entry.config
        return {"config": config_label(config.r, config.d, config.algo), "r": config.r, "d": config.d,
                "algo": config.algo, "steps": steps, "trials": entry.trials, "seconds": seconds,
                "dictionary_ms": entry.seconds * 1e3, "skipped": layer.adaptive.skipped(capacity)}

    def expert_step(self, plan: Any) -> tuple[Callable[[], None], list[int]]:
        """The experts' FFN alone, forward and backward, on the rows and the
        hidden slice that `plan` computes on this rank; its shape (n, rows, M, H).

        Written as the matmuls themselves into buffers made once (no
        autograd, no allocation): what no implementation of the layer can go
        below. Forward: h = relu(x fc1^T + b1), y = h fc2 + b2; backward of
        sum(y): dh = dy fc2^T masked by h > 0, dfc2 = h^T dy, dfc1 = dh^T x,
        dx = dh fc1, and the two bias gradients."""
        torch, layer = self.torch, self.layer
        experts = layer.experts
        whole = layer.gather_experts()  # collective: every expert whole, (E, H, M) ...
        if plan.r == 0:
            first, count, hidden, rows = 0, layer.num_global_experts, experts.hidden_size, plan.buffer_capacity
        else:
            group = experts.sharers // plan.r
            first, count = experts.first_expert, experts.num_local
            hidden, rows = experts.hidden_size // plan.r, self.comm.size * plan.buffer_capacity // group
        pick = slice(first, first + count)
        fc1 = whole["batched_fc1_w"][pick, :hidden].contiguous()  # (n, Hl, M)
        fc2 = whole["batched_fc2_w"][pick, :hidden].contiguous()  # (n, Hl, M)
        fc1_bias = whole.get("batched_fc1_bias")
        fc1_bias = None if fc1_bias is None else fc1_bias[pick, :hidden].unsqueeze(1).contiguous()  # (n, 1, Hl)
        fc2_bias = whole.get("batched_fc2_bias")
        fc2_bias = None if fc2_bias is None else fc2_bias[pick].unsqueeze(1).contiguous()  # (n, 1, M)
        device = self.device
        generator = torch.Generator(device=device).manual_seed(31 + self.comm.rank)
        model_dim = self.args.model_dim
        x = torch.randn(count, rows, model_dim, generator=generator, device=device).to(self.dtype)

        def empty(*shape: int) -> Any:
            return torch.empty(shape, dtype=self.dtype, device=device)

        h, grad_h = empty(count, rows, hidden), empty(count, rows, hidden)
        y, grad_x = empty(count, rows, model_dim), empty(count, rows, model_dim)
        grad_fc1, grad_fc2 = empty(*fc1.shape), empty(*fc2.shape)
        grad_b1, grad_b2 = empty(count, hidden), empty(count, model_dim)
        grad_y = torch.ones(count, rows, model_dim, dtype=self.dtype, device=device)  # the gradient of sum(y)

        def step() -> None:
            if fc1_bias is None:
                torch.bmm(x, fc1.transpose(1, 2), out=h)
            else:
                torch.baddbmm(fc1_bias, x, fc1.transpose(1, 2), out=h)
            h.relu_()
            torch.bmm(h, fc2, out=y)
            if fc2_bias is not None:
                y.add_(fc2_bias)
                torch.sum(grad_y, dim=1, out=grad_b2)
            torch.bmm(grad_y, fc2.transpose(1, 2), out=grad_h)
            torch.bmm(h.transpose(1, 2), grad_y, out=grad_fc2)
            grad_h.masked_fill_(h <= 0, 0)
            torch.bmm(grad_h.transpose(1, 2), x, out=grad_fc1)
            if fc1_bias is not None:
                torch.sum(grad_h, dim=1, out=grad_b1)
            torch.bmm(grad_h, fc1, out=grad_x)

        return step, [count, rows, model_dim, hidden]

    def switch_pairs(self, x: Any, factor: float, plan: Any) -> tuple[list[dict], bool]:
        """Steps of the static layer that time switching r: each r of the
        layer in turn takes a step right after a step at another r (the
        switch), then two at the same r (steady, again). Every r runs at the
        dictionary's d and algorithm (r = 0 at d = 1, linear), all warmed up
        by the sweep. One record per switch; `again - steady`, two steady
        steps, is the control: what the same difference shows without a
        switch. Also whether the layer's buffer pool stayed the same (no
        buffer allocated or grown) across them."""
        configs = [(r, plan.d, plan.algo) if r else (0, 1, "linear") for r in self.layer.valid_rs]
        steps = [self.layer_step(self.layer, x, capacity_factor=factor, adaptive_r=r, a2a_ffn_overlap_degree=d,
                                 algo=algo) for r, d, algo in configs]
        pairs, buffers = [], self.layer._pool.snapshot()
        for _ in range(self.args.switch_pairs):
            for (r, d, algo), step in zip(configs, steps):
                switched, steady, again = (self.timed(step) for _ in range(3))
                pairs.append({"config": config_label(r, d, algo), "switch_ms": switched * 1e3,
                              "steady_ms": steady * 1e3, "again_ms": again * 1e3})
        return pairs, self.layer._pool.snapshot() == buffers

    def dropless_rows(self, factors: list[float]) -> list[dict]:
        """The capacity dispatcher (r1/d1/linear) at each factor against the
        dropless one, same weights and tokens, taking turns: step times, the
        rows and bytes each rank sends to the others per step (four exchanges:
        two forward, two backward; the maximum over ranks), and the choices the
        capacity dropped (summed over ranks)."""
        if self.layer.experts.sharers > 1 or not factors:
            return []
        import numpy as np

        from ..common.host_values import all_reduce_values
        from .step_memory import peak_step_bytes

        dropless = self.new_layer(flow="dropless")
        x = self.tokens(self.args.tokens)
        steps = [self.layer_step(self.layer, x, capacity_factor=f, adaptive_r=1, a2a_ffn_overlap_degree=1,
                                 algo="linear") for f in factors]
        steps.append(self.layer_step(dropless, x))
        plans = []
        for step, layer in zip(steps, [self.layer] * len(factors) + [dropless]):
            for _ in range(max(self.args.warmup, 1)):
                step()
            plans.append(layer.last_plan)
        samples = common.take_turns([lambda s=step: self.timed(s) for step in steps], self.args.repeats)
        row_bytes = self.args.model_dim * self.dtype.itemsize
        peaks = []
        for step, layer in zip(steps, [self.layer] * len(factors) + [dropless]):
            layer._pool.clear()  # the pool then holds this step's buffers only (not earlier configurations')
            step()
            peaks.append(peak_step_bytes(step, layer._pool, self.device))
        counts = np.array([[p.rows_sent for p in plans], [p.dropped for p in plans], peaks], dtype=np.float64)
        most_sent = all_reduce_values(counts[0], self.comm, op="max")
        dropped = all_reduce_values(counts[1], self.comm)
        peak = all_reduce_values(counts[2], self.comm, op="max")
        dropless_ms = statistics.median(samples[-1]) * 1e3
        rows = []
        for index, factor in enumerate([*factors, None]):
            time_ms = statistics.median(samples[index]) * 1e3
            rows.append({"dispatcher": "dropless" if factor is None else "capacity", "factor": factor,
                         "tokens": self.args.tokens, "time_ms": time_ms, "vs_dropless": time_ms / dropless_ms,
                         "rows_sent": int(most_sent[index]), "mib_sent": 4 * most_sent[index] * row_bytes / 2**20,
                         "dropped": int(dropped[index]), "peak_mib": peak[index] / 2**20,
                         "peak_vs_dropless": peak[index] / peak[-1], "samples_ms": [t * 1e3 for t in samples[index]]})
        return rows

    def peer_step(self, x: Any, factor: float) -> Callable[[], None]:
        peer = self.peer

        def step() -> None:
            x.grad = None
            peer.zero_grad(set_to_none=True)
            y = peer(x, factor)
            (y.sum() + y.l_aux).backward()

        return step

    def comparison_timings(self, x: Any, factor: float, plan: Any) -> tuple[list[Timing], dict[str, str]]:
        """On one rank, beside the step: the same step replayed from CUDA
        graphs (on a GPU), and Tutel's and Megatron-Core's layers over the
        layer's weights (moe_runtime.bench.peers; Megatron-Core's without the
        experts' biases, which its linears do not take here). Returns the
        timings and, by name, why a peer is missing."""
        from .peers import failure, peer_builders

        timings, missing = [], {}

        def probed(name: str, step: Callable[[], None], *config: Any) -> None:
            """The timing of `step`, or why it fails (a row saying so, not a crash: one GPU call runs it all)."""
            try:
                step()
            except Exception as error:  # noqa: BLE001 -- reported in the table and the JSON
                missing[name] = failure(error)
                return
            timings.append(Timing(name, step, *config))

        if self.args.device == "cuda":
            graphed = self.new_layer(cuda_graphs=1)
            options = {"capacity_factor": factor, "adaptive_r": plan.r, "a2a_ffn_overlap_degree": plan.d,
                       "algo": plan.algo}
            probed("graphed", self.layer_step(graphed, x, **options), plan.r, plan.d, plan.algo)
            probed("captured", self.captured_step(self.new_layer(), x.detach().clone().requires_grad_(), **options),
                   plan.r, plan.d, plan.algo)
        for name, build in peer_builders(self.layer, factor, drop_biases=True):
            try:
                peer = build()
            except Exception as error:  # noqa: BLE001 -- reported in the table and the JSON
                missing[name] = failure(error)
                continue
            if peer.forward is None:
                missing[peer.name] = peer.missing
                continue

            def step(peer=peer) -> None:
                x.grad = None
                peer.module.zero_grad(set_to_none=True)
                peer.loss(x).backward()

            probed(peer.name, step)
        return timings, missing

    def profiles(self, timings: list[Timing], seconds: list[float]) -> dict[str, dict]:
        """By timing's kind (the static sweep's left out): where one step's
        self time goes (a2a.bench.kernel_profile), with the step's
        median time; on one rank only."""
        from a2a.bench.kernel_profile import top_self_time

        if self.comm.size != 1:
            return {}
        return {t.kind: {**top_self_time(self.torch, t.step, device=self.args.device, top=self.args.profile),
                         "step_ms": taken * 1e3}
                for t, taken in zip(timings, seconds) if t.kind != "static"}

    # -- one case ----------------------------------------------------------------------------------------
    def run_case(self, case: Case) -> tuple[list[dict], dict]:
        """The rows and the summary of one (T, f)."""
        from ..tuning.dictionary import AdaptiveDictionary

        args = self.args
        x = self.tokens(case.tokens)
        prior = None
        if args.prior:
            from ..tuning.prior import ExchangePrior

            prior = ExchangePrior(args.prior)
        dictionary = AdaptiveDictionary(window=WINDOW, degrees=tuple(args.degrees), algos=tuple(args.algos),
                                        repeats=args.tune_repeats, drift=math.inf, prior=prior,
                                        prior_factor=args.prior_factor)
        adaptive = self.adaptive_layer(dictionary)
        tuning = self.tune(adaptive, x, case.factor)
        plan = adaptive.last_plan

        # The comparison cases skip the static sweep: the search has just run
        # every configuration there, and each step costs seconds.
        configs = [] if case.comparison else static_configs(self.layer.valid_rs, args.degrees, args.algos)
        timings = [self.static_timing(x, case.factor, r, d, algo) for r, d, algo in configs]
        timings.append(Timing("adaptive", self.layer_step(adaptive, x, capacity_factor=case.factor),
                              plan.r, plan.d, plan.algo, plan))
        expert_step, expert_shape = self.expert_step(plan)
        timings.append(Timing("expert", expert_step, plan.r))
        if self.peer is not None:
            timings.append(Timing("gshard", self.peer_step(x, case.factor)))
        missing: dict[str, str] = {}
        if case.comparison and self.comm.size == 1 and not args.no_peer:
            compared, missing = self.comparison_timings(x, case.factor, plan)
            timings += compared

        for timing in timings:
            for _ in range(args.warmup):
                timing.step()
        samples = common.take_turns([lambda t=timing: self.timed(t.step) for timing in timings], args.repeats)
        seconds = [statistics.median(s) for s in samples]

        rows = []
        for timing, taken, median in zip(timings, samples, seconds):
            row = {"tokens": case.tokens, "factor": case.factor, "kind": timing.kind, "r": timing.r,
                   "d": timing.d, "algo": timing.algo, "time_ms": median * 1e3,
                   "samples_ms": [s * 1e3 for s in taken]}
            if timing.plan is not None:
                row.update(capacity=timing.plan.capacity, buffer_capacity=timing.plan.buffer_capacity,
                           dropped=timing.plan.dropped)
            rows.append(row)
        static = [row for row in rows if row["kind"] == "static"]
        best_ms = min((row["time_ms"] for row in static), default=None)
        for row in rows:
            row["vs_best"] = None if best_ms is None else row["time_ms"] / best_ms
        if args.prior:
            tuning["trials_without_prior"] = trials_without_prior(rows, tuning, self.layer.valid_rs, args,
                                                                  self.comm.num_nodes > 1 and self.comm.local_size > 1)
        summary = summarize(case, rows, tuning, expert_shape, plan)
        summary["peers"].update({name: {"missing": why} for name, why in missing.items()})
        if case.comparison and args.profile:
            summary["profiles"] = self.profiles(timings, seconds)
        # Switching r: the sweep cases only (a comparison case's steps cost seconds each).
        if not case.comparison and len(self.layer.valid_rs) > 1 and args.switch_pairs:
            summary["switch"] = summarize_switch(*self.switch_pairs(x, case.factor, plan))
        del adaptive, x
        return rows, summary


