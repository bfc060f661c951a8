"""Benchmark of the expert-specific operators: ``python -m a2a.bench --op esmm,ess,estmm``.

    python -m a2a.bench --op esmm --tokens 16384 --experts 8 --top-k 2 --model-dim 1024 --hidden 1024

One process (no mpirun), CPU or CUDA (``--device``). Every path computes the
same result from the same routing (top-k distinct experts per token,
uniformly random, float32 softmax gates), timed in turns (a2a.bench.common):

* ``esmm``: y (T, H) = sum over j of g_tj W[e_tj] x_t (an expert layer's
  matmul from tokens back to tokens). a2a: ``esmm(x, w, index, gates=g,
  y_rows="token")``. padded: ``fast_encode`` at capacity factor ``-f`` +
  ``torch.bmm`` + ``fast_decode`` with the gates (Tutel's path; a factor
  below the demand drops choices, so its result is not compared).
  dropless: ``permute`` + the experts' matmuls + ``unpermute``, the matmuls
  as one ``torch._grouped_mm`` where torch runs it for the device and dtype
  (bfloat16 and float16 on a GPU, float32 too on the CPU: what the runtime's
  dropless and Hexa flows run), else one ``torch.mm`` per expert.
* ``ess``: the bias gradient (E, H) = per-expert sum of g * dy rows.
  padded: ``fast_encode(dy, gates)`` + a sum over the capacity; dropless:
  ``permute`` + per-expert sums (gates folded in before the permute).
* ``estmm``: the weight gradient (E, H, M) = per expert sum of g dy_t x_t^T.
  padded: two ``fast_encode`` + ``torch.bmm``; dropless: two ``permute`` +
  the experts' matmuls (one grouped GEMM, or one ``torch.mm`` per expert, as for esmm).
* ``dense``: the physical limit in the same run: one ``torch.mm`` of the
  same multiply-adds (esmm, estmm: (N, M) @ (M, H) with N the routed
  choices), or a sum over the same elements (ess).

Columns: time (median of ``-r`` repetitions of the mean of ``-n`` calls, us),
GFLOP/s (2 * N * M * H for esmm / estmm, N * H for ess, over a2a's time),
``vs dense`` = dense time / a2a time (the issue's target: >= 0.7 for esmm on
CPU), ``vs padded`` and ``vs dropless`` = that path's time / a2a's (above 1:
a2a faster), ``#wrong``: elements of a2a's result that differ from the
dropless path's beyond the tolerance (fp32 accumulation in both; exit status
1 if any). ``--profile N`` prints, after each row, a2a's call's N kernels
with the most device self time (CPU: ops), from torch.profiler.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from . import common

__all__ = ["ES_OPS", "is_es_mode", "main", "parse_args"]

ES_OPS = ("esmm", "ess", "estmm")
TOLERANCE = {"float32": 1e-3, "float64": 1e-10, "bfloat16": 5e-2, "float16": 1e-2}  # relative to the output's scale


def is_es_mode(argv: list[str]) -> bool:
    """Whether --op names only expert-specific operators."""
    return common.names_only(argv, ES_OPS)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m a2a.bench", usage="python -m a2a.bench --op esmm,ess,estmm [options]",
                                description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--op", required=True, help="esmm, ess, estmm, or a comma list")
    p.add_argument("--tokens", type=common.int_list, default=[4096, 16384], help="T, comma list (default 4096,16384)")
    p.add_argument("--experts", type=common.int_list, default=[8], help="E, comma list (default 8)")
    p.add_argument("--top-k", type=common.int_list, default=[2], help="k, comma list (default 2)")
    p.add_argument("--model-dim", type=common.int_list, default=[1024], help="M, comma list (default 1024)")
    p.add_argument("--hidden", type=common.int_list, default=[1024], help="H, comma list (default 1024)")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16, float16, float64, comma list")
    p.add_argument("-f", "--capacity-factor", type=float, default=1.25, help="the padded path's factor (default 1.25)")
    common.add_op_bench_flags(p, repeats=5, iters=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after each row, a2a's call under torch.profiler: its N kernels (ops on the CPU) with the "
                        "most self time (JSON: the row's profile); 0: none (default)")
    return p


class _Case:
    """Inputs of one configuration and the four paths of each op."""

    def __init__(self, torch: Any, a2a: Any, T: int, E: int, k: int, M: int, H: int, dtype: Any, device: str,
                 factor: float, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.torch, self.a2a = torch, a2a
        self.indices = torch.rand(T, E, generator=gen).argsort(dim=1)[:, :k].contiguous().to(device)
        self.gates = torch.rand(T, k, generator=gen).softmax(dim=1).to(device)
        self.x = (torch.rand(T, M, generator=gen) * 2 - 1).to(device=device, dtype=dtype)
        self.dy = (torch.rand(T, H, generator=gen) * 2 - 1).to(device=device, dtype=dtype)
        self.w = ((torch.rand(E, H, M, generator=gen) * 2 - 1) / M**0.5).to(device=device, dtype=dtype)
        self.index = a2a.es_index(self.indices, E)
        self.routing = a2a.route(self.indices, E, capacity_setting=factor)
        self.routed = T * k
        self.E = E
        self._grouped_runs: bool | None = None

    # -- esmm: y (T, H) = sum_j g W[e] x_t
    def esmm(self):
        return self.a2a.esmm(self.x, self.w, self.index, gates=self.gates, y_rows="token")

    def esmm_padded(self):
        d = self.a2a.fast_encode(self.x, self.routing)
        return self.a2a.fast_decode(self.torch.bmm(d, self.w.transpose(1, 2)), self.routing, self.gates)

    def _per_expert(self, rows: Any, perm: Any, fn: Any) -> list:
        offsets = perm.offsets.tolist()
        return [fn(e, rows[offsets[e]:offsets[e + 1]]) for e in range(self.E)]

    def _grouped_ends(self, perm: Any) -> Any:
        """The experts' ends as torch's grouped GEMM takes them (int32 on the device), or None where it does
        not run for this device and dtype (asked once per case with a tiny call)."""
        if self._grouped_runs is None:
            torch, dtype, device = self.torch, self.x.dtype, self.x.device
            item = self.x.element_size()
            if (self.x.shape[1] * item) % 16 or (self.dy.shape[1] * item) % 16:  # its strides: 16-byte multiples
                self._grouped_runs = False
                return None
            try:
                a = torch.ones(8, 8, dtype=dtype, device=device)
                ends = torch.tensor([4, 8], dtype=torch.int32, device=device)
                torch._grouped_mm(a, torch.ones(2, 8, 8, dtype=dtype, device=device), offs=ends)
                torch._grouped_mm(a.t(), a, offs=ends)
                self._grouped_runs = not (device.type == "cuda" and dtype == torch.float32)  # (TF32 there)
            except (AttributeError, RuntimeError):
                self._grouped_runs = False
        if not self._grouped_runs:
            return None
        return perm.offsets[1:].to(self.torch.int32)

    def esmm_dropless(self):
        rows, perm = self.a2a.permute(self.x, self.indices, self.E)
        ends = self._grouped_ends(perm)
        if ends is not None:
            out = self.torch._grouped_mm(rows, self.w.transpose(1, 2), offs=ends)
        else:
            out = self.torch.cat(self._per_expert(rows, perm, lambda e, r: r @ self.w[e].t()))
        return self.a2a.unpermute(out, perm, self.gates)

    def esmm_dense(self):
        return self.torch.mm(self._dense_rows, self.w[0].t())

    # -- ess: (E, H) per-expert sums of g dy
    def ess(self):
        return self.a2a.ess(self.dy, self.index, gates=self.gates)

    def ess_padded(self):
        return self.a2a.fast_encode(self.dy, self.routing, self.gates).sum(dim=1)

    def ess_dropless(self):
        rows, perm = self.a2a.permute(self.dy, self.indices, self.E)
        scale = self._permuted_gates(perm).unsqueeze(1).to(rows.dtype)
        return self.torch.stack(self._per_expert(rows * scale, perm, lambda e, r: r.sum(dim=0)))

    def ess_dense(self):
        return self._dense_rows_h.sum(dim=0)

    # -- estmm: (E, H, M) per-expert sum g dy_t x_t^T
    def estmm(self):
        return self.a2a.estmm(self.dy, self.x, self.index, gates=self.gates, a_rows="token", b_rows="token")

    def estmm_padded(self):
        a = self.a2a.fast_encode(self.dy, self.routing, self.gates)
        return self.torch.bmm(a.transpose(1, 2), self.a2a.fast_encode(self.x, self.routing))

    def estmm_dropless(self):
        a, perm = self.a2a.permute(self.dy, self.indices, self.E)
        b, _ = self.a2a.permute(self.x, self.indices, self.E)
        a = a * self._permuted_gates(perm).unsqueeze(1).to(a.dtype)
        ends = self._grouped_ends(perm)
        if ends is not None:  # an expert without rows: zero, whatever the grouped GEMM leaves there
            return self.torch._grouped_mm(a.t(), b, offs=ends).masked_fill_((perm.counts == 0).view(-1, 1, 1), 0)
        offsets = perm.offsets.tolist()
        return self.torch.stack([a[offsets[e]:offsets[e + 1]].t() @ b[offsets[e]:offsets[e + 1]] for e in range(self.E)])

    def estmm_dense(self):
        return self.torch.mm(self._dense_rows_h.t(), self._dense_rows)

    def _permuted_gates(self, perm: Any) -> Any:
        """The gates in the permuted rows' order (row_map gives each choice's row)."""
        order = self.torch.empty(self.routed, dtype=self.gates.dtype, device=self.gates.device)
        order[perm.row_map.reshape(-1)] = self.gates.reshape(-1)
        return order

    def prepare_dense(self) -> None:
        self._dense_rows = self.x.repeat_interleave(self.indices.shape[1], dim=0)
        self._dense_rows_h = self.dy.repeat_interleave(self.indices.shape[1], dim=0)


def _profiled(torch: Any, call: Any, label: str, seconds: float, device: str, top: int) -> dict:
    """a2a's call under torch.profiler (a2a.bench.kernel_profile): which kernels hold its time (the
    operator's own, the index's, the sum over choices), printed as comment lines after its row."""
    from .kernel_profile import format_profile, top_self_time

    profile = top_self_time(torch, call, device=device, top=top)
    for line in format_profile(label, profile, seconds * 1e3, "kernel" if device == "cuda" else "op"):
        print(line, flush=True)
    return profile


def _flops(op: str, routed: int, M: int, H: int) -> int:
    return routed * H if op == "ess" else 2 * routed * M * H


def _wrong(torch: Any, got: Any, want: Any, dtype: str) -> int:
    scale = float(want.abs().max()) if want.numel() else 1.0
    return int((~torch.isclose(got.double(), want.double(), rtol=0, atol=TOLERANCE[dtype] * max(scale, 1e-30))).sum())


def parse_args(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    started = common.start_op_bench(args)
    if started is None:
        return 2
    torch, a2a, ops = started
    device = args.device
    clock = common.Clock(torch, device)
    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    print(f"# a2a.bench --op {','.join(ops)}: {device}, threads {torch.get_num_threads()}, "
          f"{common.command_line(['--op', *argv[1:]] if argv and argv[0] == '--op' else argv)}")
    print(f"# {'op':>5} {'T':>6} {'E':>3} {'k':>2} {'M':>5} {'H':>5} {'dtype':>8} {'time us':>10} {'GFLOP/s':>8} "
          f"{'dense':>8} {'vs dense':>8} {'vs padded':>9} {'vs dropless':>11} {'#wrong':>6}")
    rows, failed = [], False
    for T in args.tokens:
        for E in args.experts:
            for k in args.top_k:
                for M in args.model_dim:
                    for H in args.hidden:
                        for dtype_name in dtypes:
                            case = _Case(torch, a2a, T, E, k, M, H, getattr(torch, dtype_name), device,
                                         args.capacity_factor, args.seed)
                            case.prepare_dense()
                            for op in ops:
                                paths = [getattr(case, op), getattr(case, f"{op}_dense"),
                                         getattr(case, f"{op}_padded"), getattr(case, f"{op}_dropless")]
                                wrong = _wrong(torch, paths[0](), paths[3](), dtype_name)
                                failed |= wrong > 0
                                t, dense, padded, dropless = common.medians_in_turns(paths, clock, args.iters,
                                                                                      args.repeats)
                                flops = _flops(op, case.routed, M, H)
                                row = {"op": op, "T": T, "E": E, "k": k, "M": M, "H": H, "dtype": dtype_name,
                                       "device": device, "time_us": t * 1e6, "gflops": flops / t / 1e9,
                                       "dense_gflops": flops / dense / 1e9, "vs_dense": dense / t,
                                       "vs_padded": padded / t, "vs_dropless": dropless / t, "wrong": wrong,
                                       "capacity_factor": args.capacity_factor}
                                rows.append(row)
                                print(f"  {op:>5} {T:>6} {E:>3} {k:>2} {M:>5} {H:>5} {dtype_name:>8} "
                                      f"{row['time_us']:>10.0f} {row['gflops']:>8.1f} {row['dense_gflops']:>8.1f} "
                                      f"{row['vs_dense']:>8.2f} {row['vs_padded']:>9.2f} {row['vs_dropless']:>11.2f} "
                                      f"{wrong:>6}", flush=True)
                                if args.profile:
                                    row["profile"] = _profiled(torch, paths[0], f"{op} {dtype_name}", t, device,
                                                               args.profile)
    if args.json:
        common.write_json(args.json, rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
