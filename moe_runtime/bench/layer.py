"""``python -m moe_runtime.bench`` without a mode flag: the step time of
:class:`moe_runtime.MoELayer` for every static configuration (r, d,
algorithm), the dictionary's choice, the experts' own compute and a
GShard-style peer, measured in the same run.

    python -m moe_runtime.bench                       # 4 ranks (2 emulated nodes of 2), the default sizes
    python -m moe_runtime.bench --quick --np 2        # seconds: small sizes
    python -m moe_runtime.bench --tokens 1024 --factors 1,4 --json out.json --plot out.png
    mpirun -np 8 python -m moe_runtime.bench --experts 4 --hidden 2048
    python -m moe_runtime.bench --gpu-step --json step.json   # the issue's comparison on one GPU (below)
    python -m moe_runtime.bench --device cuda --np 4 --transport mpi   # 4 ranks sharing one GPU

Under mpirun it runs on every rank of ``MPI_COMM_WORLD``; started plainly it
starts itself under mpirun through :mod:`a2a.launch` on ``--np`` ranks
(default 4, emulating 2 ranks per node unless ``--np``, ``--local-size`` or
``A2A_LOCAL_SIZE`` say otherwise; 1 with ``--device cuda``), as ``python -m
a2a.bench`` does.

``--device cuda`` puts the layers, the tokens, the expert-compute buffers,
the GShard peer and its float64 check on the GPU, with the communicator
``a2a.Comm.from_mpi(world, device="cuda")``: NCCL, one GPU per rank (its rank
on its node, modulo the GPUs), or ``--transport mpi``, the staged MPI
transport, with which several ranks may share one GPU (docs/gpu.md). A step
is then timed from a synchronized device to a synchronized device, and the
dictionary's trials too (the layer's ``timer``). Without a GPU, or with an
a2a built without CUDA, it exits 2 at once ("--device cuda: torch sees no
GPU"). ``--gpu-step`` is the issue's comparison on one GPU, in seconds::

    python -m moe_runtime.bench --gpu-step --json step.json

which is ``--device cuda --np 1 --dtype bfloat16 --tokens 0 --peer-tokens
4096,16384 --peer-factors 1 -M 1024 -H 1024 -E 8 -k 2 -w 3 -r 10 --switch-pairs 0
--dropless-factors '' --dynamic-steps 0 --profile 12``: no sweep (``--tokens 0``), the
T = 4096 and 16384, f = 1 cases alone: the dictionary's search, then the
step, its expert compute, the same step replayed from CUDA graphs
(``MoELayer(cuda_graphs=1)``) and captured whole by its caller (forward,
loss and backward in one ``torch.cuda.graph``, replayed), Tutel's and Megatron-Core's layers over the
same weights (moe_runtime.bench.peers, where installed: the GPU check's kit
installs them) and GShard taking turns, 10 rounds after 3 warm-up steps;
then, for each of them, the 12 kernels with the most device time in one
step (a2a.bench.kernel_profile; JSON: the summary's ``profiles``).
Before, on one rank, every peer is checked against the layer in float64
(``peers_check``). Flags given with it win (``--device cpu`` and smaller
sizes: the same run on the CPU, without the graphed row). Its JSON: each
comparison summary holds ``adaptive.time_ms`` (the step),
``adaptive.config``, ``expert.time_ms``, ``step_vs_expert``, ``gshard_ms``,
``gshard_vs_step``, ``graphed_ms``, ``graphed_vs_expert``, ``captured_ms``,
``captured_vs_expert`` and ``peers``
(name -> ``time_ms``, ``vs_step``; or ``missing``: not installed, or
"failed: ..." where a peer, the graphed or the captured step raised, which the run
reports instead of stopping); ``targets`` the
``expert`` (step within 1.15x of its expert compute) and ``gshard`` (>= 4x
faster than GShard at the issue's size) verdicts, ``met`` or ``missed``,
with those numbers per case (tools/gpu_check/targets.py judges the GPU
issue's own); ``device``, ``gpu`` and ``transport`` say where it ran.

The layer: ``E`` experts (``--experts``; ``E / W`` per rank, or ``W / E``
ranks sharing one), model dim ``M``, hidden ``H``, the top-k gate, Tutel's
capacity rule. The cases: ``T`` tokens per rank (``--tokens``; 0: none) at every
capacity factor of ``--factors`` (the sweep), then ``--peer-tokens`` at
every factor of ``--peer-factors`` (the comparison: GShard's einsums cost
about ``T / H`` times the experts, so the peer is compared at a larger T).
Defaults: the sweep at T = 256, f = 1, 2, 4, 8 and the comparison at the
issue's T = 4096, f = 1, both with M = H = 1024, E = 8, k = 2 (about 15
minutes on 4 ranks sharing 2 cores). In each case:

* ``static`` (the sweep only: in a comparison case the dictionary's search
  has just run every configuration, and each step costs seconds): one row
  per configuration: every valid r of the layer
  (``layer.valid_rs``; r = 0 runs no all-to-all, so it is one row), every
  pipelining degree of ``--degrees``, every algorithm of ``--algos``, passed
  per call (``adaptive_r=``, ``a2a_ffn_overlap_degree=``, ``algo=``).
* ``adaptive``: a second layer with the same weights and an
  :class:`moe_runtime.AdaptiveDictionary` (``--degrees``, ``--algos``,
  ``repeats=--tune-repeats``, no re-tuning on drift) first runs real steps
  until the case's capacity key is tuned (those steps are counted and
  reported: ``tuning``), then is timed like the static rows; ``choice`` is
  what the dictionary picked.
* ``expert``: the experts' FFN alone (fc1, relu, fc2, forward and
  backward: six batched matmuls, the biases and the relu mask, into buffers
  made once) on the rows the experts get in the layer under the dictionary's
  choice: ``(n_l, W * C / g, M)`` with hidden ``H / r`` (``(E, C, M)`` with
  ``H`` for r = 0), C the buffer capacity of that plan, with the layer's
  weights: the FLOP limit of the step. Gating, encode/decode, the exchanges
  and the weight gathers are the overhead above it.
* ``gshard``: :class:`moe_runtime.bench.peer.GShardPeer`, dense einsum
  dispatch and combine as Fairseq's MOELayer, with the same gate and
  experts (needs E >= W; ``--no-peer`` skips it). Before timing, a small
  float64 layer and its peer are run on the same tokens at every factor, and
  their outputs, input gradients and auxiliary losses must agree to 1e-10:
  the ``peer check`` line (the exit status is 1 when it fails).

* ``switch`` (the sweep only, when the layer has more than one r): what
  switching r costs. Each r of the layer (at the dictionary's d and
  algorithm; r = 0 at d = 1) takes a step right after a step at another r
  (the switch), then two steps at the same r (steady, again);
  ``--switch-pairs`` such triples per r. The cost is switch - steady, the
  median over them, in ms and relative to the steady step; the control is
  again - steady, the same estimate between two steps without a switch (its
  size is the noise of the estimate). The parameters have one layout for
  every r, so a switch moves nothing; this measures what is left (caches,
  buffers of another shape), and checks that the layer's buffer pool is
  the same before and after the pairs (no buffer allocated or grown).

* ``dropless`` (after the cases; needs E >= W): the capacity dispatcher at
  r1/d1/linear at each factor of ``--dropless-factors`` against
  ``flow="dropless"`` (same weights, ``--tokens`` tokens), taking
  turns: step times, the rows and MiB the busiest rank sends to the others
  per step (four exchanges), and the choices the capacity dropped.

* ``dynamic`` (after those; needs E >= W): ``--dynamic-steps`` steps of a
  skewed synthetic routing whose hot expert moves, for the static factor that
  drops nothing on them, ``flow="dropless"`` and ``flow="dynamic"``
  (per-expert capacities): step times, drops, rows per expert and capacity
  changes (moe_runtime.bench.dynamic).

Timing: one sample is one training step, forward and backward of ``y.sum()
+ y.l_aux`` (grads cleared before), after a barrier, its time the maximum
over ranks (``a2a.all_reduce(op="max")``). Every configuration of a case
first runs ``--warmup`` untimed steps; then in each of ``--repeats`` rounds
every configuration of the case takes one timed step in turn (so a busy
moment of a shared machine hits them alike); rows show the median, in
milliseconds. ``vs best`` is the row's time over the case's best static
time.

Per case the summary gives the best and worst static configuration, the
adaptive choice and its time (``/best``: adaptive / best; ``worst/``: worst
/ adaptive), the tuning cost (steps / trials), the expert compute and
``step/exp`` (adaptive / expert), and GShard's time with ``gshard/step``
(GShard / adaptive). The targets of issue 10 follow, each ``met`` or
``missed`` with its numbers: adaptive within 3% of the best static and at
least 1.2x faster than the worst; the step within 1.15x of its expert
compute; at least 4x faster than GShard at T = 4096, M = 1024, H = 1024,
E = 8, k = 2, f = 1 (checked in the ``--peer-tokens`` cases at f = 1);
switching r costs less than 1% of a step and allocates no buffer.

``--prior PRESET`` (an a2a.sim preset: ``local``, ``cluster``, ``a100`` ...; default none) gives the
adaptive layer's dictionary the scale model's prior
(:class:`moe_runtime.tuning.prior.ExchangePrior`, ``--prior-factor``, default 4):
the (d, algorithm) it predicts far slower are not tried. Each case then
reports the trials the search ran, the trials it would have run without the
prior (the search replayed, without it, on the static rows' times; in a
comparison case, which has no static rows, the trials plus those the prior
saved: the configurations it left out of the r the search measured).

``--json FILE`` writes the run (settings, peer check, every row, the
summaries, the targets); ``--plot FILE.png`` draws step time against (r, d)
per case, one line per algorithm, with the adaptive, expert and GShard times
as horizontal lines (needs matplotlib). Only rank 0 prints and writes.
``--threads`` (default 1: the ranks share the cores) sets torch's threads
and ``A2A_NUM_THREADS`` per rank. ``--quick`` picks small sizes (a test
run); flags given with it still win.

Here: the run on every rank and what rank 0 prints and writes. The command
line is layer_options.py, the steps and their timing layer_measure.py, the
summaries and the targets layer_summary.py, the text layer_tables.py, the
plot layer_plot.py; the peer peer.py, the dynamic rows dynamic.py.
"""

from __future__ import annotations

import argparse
import os
import sys

from a2a import launch
from a2a.bench import common

from .dynamic import dynamic_header_lines, dynamic_rows, format_dynamic
from .layer_measure import LayerBench
from .layer_options import DEFAULT_LOCAL_SIZE, cases, default_np, layout_error, parse_args
from .layer_plot import write_plot
from .layer_summary import evaluate_targets
from .layer_tables import (
    dropless_header_lines,
    format_comparison,
    format_dropless,
    format_row,
    format_summary,
    format_switch,
    header_lines,
    summary_header_lines,
    switch_header_lines,
    target_lines,
)

__all__ = ["main", "parse_args", "run"]


def main(argv: list[str] | None = None) -> int:
    """The layer's step: relaunched under mpirun when not under it already
    (and more than one rank is asked for), else the benchmark on every rank
    of MPI_COMM_WORLD."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.device == "cuda":  # refused here, before mpirun starts ranks that would all fail alike
        error = common.cuda_missing()
        if error:
            print(f"moe_runtime.bench {error}", file=sys.stderr)
            return 2
    if not launch.under_mpirun() and (args.np if args.np is not None else default_np(args)) > 1:
        return common.relaunch("moe_runtime.bench", argv, args.np, args.local_size, default_np=default_np(args),
                               default_local_size=DEFAULT_LOCAL_SIZE)
    os.environ["A2A_NUM_THREADS"] = str(args.threads)  # read once, at a2a's first kernel call
    return common.on_every_rank(lambda: run(args, argv))


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """The benchmark on this rank (every rank of MPI_COMM_WORLD runs it; rank
    0 prints and writes); 1 when the GShard peer's check failed."""
    import torch
    from mpi4py import MPI

    import a2a
    from a2a.bench.kernel_profile import format_profile

    from .peer import check_peer
    from .peers import check_peers, start_group

    torch.set_num_threads(args.threads)
    world = MPI.COMM_WORLD
    ranks = world.Get_size()
    error = layout_error(args, ranks)
    if error:
        raise SystemExit(f"moe_runtime.bench: {error}")
    bench = LayerBench(args)
    comm, layer = bench.comm, bench.layer
    lead = comm.rank == 0

    def say(text: str = "") -> None:
        if lead:
            print(text, flush=True)

    command = common.command_line(argv, "moe_runtime.bench")
    if lead and args.np is not None and args.np != ranks:
        print(f"# note: --np {args.np} ignored: running on the {ranks} ranks of mpirun", flush=True)
    emulated = " (emulated: A2A_LOCAL_SIZE / --local-size)" if (args.local_size or os.environ.get("A2A_LOCAL_SIZE")) else ""
    two_level = comm.num_nodes > 1 and comm.local_size > 1
    experts = layer.experts
    say(f"# moe_runtime.bench: {ranks} ranks = {comm.num_nodes} node(s) x {comm.local_size} ranks{emulated}; "
        f"a2a {a2a.__version__}, torch {torch.__version__}, {args.threads} thread(s) per rank, {args.dtype}")
    gpu = None
    if args.device == "cuda":
        gpu = torch.cuda.get_device_name(bench.device)
        say(f"# device: {bench.device} ({gpu}) per rank, transport {comm.transport}; a step is timed from a "
            "synchronized device to a synchronized device")
    say(f"# layer: E={layer.num_global_experts} experts ("
        + (f"{experts.num_local} per rank" if experts.sharers == 1 else f"each shared by {experts.sharers} ranks")
        + f"), M={args.model_dim}, H={args.hidden}, top-{args.top_k} gate, Tutel's capacity rule; "
        f"valid r {' '.join(map(str, layer.valid_rs))}; degrees {' '.join(map(str, args.degrees))}; "
        f"algos {' '.join(args.algos)}")
    if "2dh" in args.algos and not two_level:
        say("# note: with one node or one rank per node, 2dh runs the linear exchange (and the dictionary skips it)")
    say("# step: forward + backward of y.sum() + l_aux; one sample: one step after a barrier, max over ranks; "
        f"median of {args.repeats} round(s) after {args.warmup} warm-up step(s), the configurations taking turns")
    say(f"# adaptive: AdaptiveDictionary(degrees, algos, warmup=1, repeats={args.tune_repeats}, drift=inf) "
        "tuned on real steps first; expert: the FFN alone on the chosen plan's rows; gshard: dense einsum peer")

    failed = False
    peer_check = None
    if bench.peer is not None:
        peer_check = check_peer(comm, experts=args.experts, top_k=args.top_k,
                                factors=tuple(dict.fromkeys(case.factor for case in cases(args))))
        failed = not peer_check.passed
        say(f"# peer check (T={peer_check.tokens}, M={peer_check.model_dim}, H={peer_check.hidden}, float64, "
            f"r=1 d=1 linear, f {','.join(f'{f:g}' for f in peer_check.factors)}): max |y - y_gshard| "
            f"{peer_check.output_error:.2g}, max |dx - dx_gshard| {peer_check.grad_error:.2g}, "
            f"max |l_aux - l_aux_gshard| {peer_check.loss_error:.2g}: {'OK' if peer_check.passed else 'FAILED'}")
    elif not args.no_peer:
        say("# note: no GShard peer: it needs whole experts on each rank (E >= ranks)")
    peers_check: list = []
    end_group = lambda: None  # the peers' torch.distributed group, where they run
    if comm.size == 1 and args.peer_tokens:  # Tutel and Megatron-Core (moe_runtime.bench.peers) on one rank
        end_group = start_group(args.device)
        peers_check = check_peers(comm, experts=args.experts, top_k=args.top_k)
        for result in peers_check:
            if result.missing:
                say(f"# peer check {result.name}: {result.missing}")
                continue
            failed = failed or not result.passed
            say(f"# peer check {result.name} {result.version} (float64, f=0, T=48, M=16, H=32, within "
                f"{result.tolerance:g}: it routes in float32): max |y - y_peer| {result.output_error:.2g}, "
                f"max |dx - dx_peer| {result.grad_error:.2g}: {'OK' if result.passed else 'FAILED'}")
    say("#")

    rows: list[dict] = []
    summaries: list[dict] = []
    if args.tokens:  # the sweep's rows (a comparison case has none)
        for line in header_lines():
            say(line)
    for case in cases(args):
        case_rows, summary = bench.run_case(case)
        for row in case_rows:
            if row["kind"] == "static":
                say(format_row(row))
        rows += case_rows
        summaries.append(summary)
    say("#")
    say("# per case: times in ms; adaptive = the dictionary's choice; /best = adaptive / best static; worst/ = "
        "worst static / adaptive;")
    say("# tuning = steps / trials the search took; step/exp = adaptive / expert compute; gshard/step = GShard / adaptive")
    for line in summary_header_lines():
        say(line)
    for summary in summaries:
        say(format_summary(summary))
    for summary in summaries:
        line = format_comparison(summary)
        if line:
            say(line)
    for summary in summaries:
        if summary.get("profiles"):
            unit = "kernel" if args.device == "cuda" else "op"
            say(f"# where a step's time goes, T={summary['tokens']} f={summary['factor']:g} (torch.profiler, "
                f"{unit}s by self time; adaptive = our eager step):")
            for kind, profile in summary["profiles"].items():
                for line in format_profile(kind, profile, profile["step_ms"], unit):
                    say(line)
    if args.prior:
        say("#")
        say(f"# prior: a2a.sim preset {args.prior}, factor {args.prior_factor:g}: trials of the search with the "
            "prior, and without it (replayed on the static times)")
        for s in summaries:
            a = s["adaptive"]
            say(f"#   T={s['tokens']} f={s['factor']:g}: {a['trials']} trials, {a['trials_without_prior']} without "
                f"the prior ({a['trials_without_prior'] - a['trials']} saved; {a['skipped']} configurations of the "
                f"measured r left out); choice {a['config']}")
    dropless = bench.dropless_rows(args.dropless_factors)
    if dropless:
        say("#")
        say(f"# dropless: the capacity dispatcher (r1/d1/linear) at each factor against flow='dropless', "
            f"T={args.tokens}; sent = the most any rank sends to the others per step (4 exchanges); dropped = "
            "choices the capacity dropped, all ranks; peak = the most any rank's step holds at once, its "
            "allocations at their peak (torch.profiler; on CUDA the allocator's peak) plus the layer's pooled "
            "buffers (moe_runtime.bench.step_memory)")
        for line in dropless_header_lines():
            say(line)
        for row in dropless:
            say(format_dropless(row))
    dynamic = dynamic_rows(bench, args.dynamic_steps)
    if dynamic:
        say("#")
        say(f"# dynamic: {args.dynamic_steps} steps of a skewed routing (its hot expert moves every 2 steps), "
            f"T={args.tokens}: the static factor that drops nothing on them (r1/d1/linear), flow='dropless' "
            "and flow='dynamic' (per-expert capacities);")
        say("# median step times; dropped = choices dropped, all ranks and steps; rows/expert = the mean rows per "
            "expert of a rank's dispatched buffer; changes = steps that changed the capacities")
        for line in dynamic_header_lines():
            say(line)
        for row in dynamic:
            say(format_dynamic(row))
    switched = [s for s in summaries if s["switch"]]
    if switched:
        say("#")
        say("# switching r: each r takes a step right after a step at another r (switch), then two at the same r "
            f"(steady, again), {args.switch_pairs} times;")
        say("# medians in ms; cost = switch - steady; cost/step = the median of (switch - steady) / steady; "
            "control = the median of (again - steady) / steady: the same estimate without a switch")
        for line in switch_header_lines():
            say(line)
        for s in switched:
            for line in format_switch(s):
                say(line)
    sizes = {"model_dim": args.model_dim, "hidden": args.hidden, "experts": args.experts, "top_k": args.top_k}
    targets = evaluate_targets(summaries, sizes)
    say("#")
    for line in target_lines(targets):
        say(line)
    if failed:
        say("# a peer does not compute what the layer computes (its check above): its times compare nothing")

    if lead and args.json:
        import json

        record = {
            "command": command,
            "timestamp": common.utc_timestamp(),
            "ranks": ranks,
            "local_size": comm.local_size,
            "num_nodes": comm.num_nodes,
            "torch": torch.__version__,
            "threads": args.threads,
            "dtype": args.dtype,
            "device": args.device,
            "gpu": gpu,
            "transport": comm.transport,
            "settings": {name: getattr(args, name) for name in
                         ("tokens", "model_dim", "hidden", "experts", "top_k", "factors", "degrees", "algos",
                          "warmup", "repeats", "tune_repeats", "peer_tokens", "peer_factors", "switch_pairs",
                          "prior", "prior_factor")},
            "valid_rs": list(layer.valid_rs),
            "peer_check": None if peer_check is None else {**vars(peer_check), "factors": list(peer_check.factors),
                                                           "passed": peer_check.passed},
            "peers_check": [{**vars(result), "passed": result.passed} for result in peers_check],
            "rows": rows,
            "summaries": summaries,
            "targets": targets,
            "dropless": dropless,
            "dynamic": dynamic,
        }
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(record, fh, indent=1)
            fh.write("\n")
    if lead and args.plot:
        write_plot(args.plot, rows, summaries)
    end_group()
    return 1 if failed else 0

