"""Micro-benchmark of the paged attention kernels: ``python -m spec_rl_jax.bench.kernels``.

Per case (one layer, ragged slot lengths around a context ``L``), timed side by side:

* verification (``Q = 4``, i.e. ``k = 3``): ``impl="xla"`` vs ``impl="pallas"``. The
  Pallas row exists only where the kernels compile (`kernels_pallas.KERNEL_BACKENDS`,
  TPU); a kernel for another backend joins ``auto`` (`attention.resolve_impl`) once this
  row shows it faster than XLA there.
* draft decode (``Q = 1``): dense attention vs page selection + sparse attention, both
  through this backend's kernels (the XLA reference where none compiles).

Plus bytes-read accounting of sparse vs dense attention per slot and layer: dense
reads every used page of K and V; sparse reads the ``B`` selected pages of K and V per
KV head plus the key summaries (``k_min, k_max``) of every used page for the selection
(``1 / Ps`` of the dense bytes). The timed cases report the pages actually selected.
Timings: AOT compile timed apart, warm-up, then A B A B ... repetitions; medians and the
median of per-pair ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import jaxlib

import kernels_pallas
from spec_rl_jax.bench import common

BUDGETS = [(1, 4, 11), (1, 4, 27)]  # (n_sink, n_window, top_k): 16 and 32 pages


@dataclasses.dataclass(frozen=True)
class Case:
  slots: int  # S
  context: int  # L, longest slot; the others are shorter (ragged)
  q_heads: int  # H
  kv_heads: int  # Hk
  head_dim: int  # Dh
  page_size: int  # Ps
  dtype: str = "bfloat16"

  @property
  def name(self) -> str:
    return f"S{self.slots}_L{self.context}"

  @property
  def max_pages(self) -> int:  # M
    return -(-self.context // self.page_size)


def make_inputs(case: Case, queries: int, seed: int = 0) -> dict[str, jax.Array]:
  """A filled cache: slot lengths spread over ``[L/2, L]``, pages shuffled in the pool."""
  S, Hk, Ps, Dh, M = case.slots, case.kv_heads, case.page_size, case.head_dim, case.max_pages
  P = S * M
  dtype = jnp.dtype(case.dtype)
  kk, kv, kq, kp = jax.random.split(jax.random.key(seed), 4)
  k_pages = jax.random.normal(kk, (Hk, P, Ps, Dh), dtype)
  lens = case.context - (jnp.arange(S) * case.context) // (2 * S)
  return dict(
      q=jax.random.normal(kq, (S, queries, case.q_heads, Dh), dtype),
      k_pages=k_pages,
      v_pages=jax.random.normal(kv, (Hk, P, Ps, Dh), dtype),
      page_table=jax.random.permutation(kp, P).reshape(S, M).astype(jnp.int32),
      kv_lens=lens.astype(jnp.int32),
      k_min=k_pages.min(axis=2),
      k_max=k_pages.max(axis=2),
  )


def compile_timed(fn, *args) -> tuple[object, float]:
  t0 = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  return compiled, time.perf_counter() - t0


def timed(fn, args) -> Callable[[], object]:
  return lambda: jax.block_until_ready(fn(*args))


def kv_bytes(case: Case, pages: int) -> int:
  """K and V bytes of ``pages`` pages of one slot, one layer, all KV heads."""
  itemsize = jnp.dtype(case.dtype).itemsize
  return 2 * pages * case.page_size * case.head_dim * case.kv_heads * itemsize


def bytes_rows(case: Case, contexts: list[int]) -> list[dict]:
  """Sparse vs dense bytes read per slot and layer, for each context and budget."""
  rows = []
  for context in contexts:
    used = -(-context // case.page_size)
    dense = kv_bytes(case, used)
    summaries = kv_bytes(case, used) // case.page_size  # [Hk, Dh] min + max per page
    for budget in BUDGETS:
      selected = min(sum(budget), used)
      sparse = kv_bytes(case, selected) + summaries
      rows.append(dict(context=context, budget_pages=sum(budget), pages_read=selected,
                       pages_used=used, dense_mib=dense / 2**20, sparse_mib=sparse / 2**20,
                       fraction=sparse / dense))
  return rows


def bench_case(case: Case, reps: int, backend: str) -> tuple[list[dict], dict]:
  rows, summary = [], {}
  paged = ("q", "k_pages", "v_pages", "page_table", "kv_lens")

  def add(what, system, metric, value):
    rows.append(dict(case=f"{what} {case.name}", metric=metric, system=system, value=value))

  # Verification, Q = 4: xla vs pallas (TPU only).
  what = "verify Q=4"
  x = make_inputs(case, queries=4)
  args = [x[n] for n in paged]
  kv_read = kv_bytes(case, int((-(-x["kv_lens"] // case.page_size)).sum()))
  kernels = backend in kernels_pallas.KERNEL_BACKENDS
  impls = ["xla", "pallas"] if kernels else ["xla"]
  systems = {}
  for impl in impls:
    fn, compile_s = compile_timed(
        functools.partial(kernels_pallas.verify_attention, impl=impl), *args)
    add(what, impl, "compile_s", compile_s)
    systems[impl] = timed(fn, args)
  res = common.alternate(systems, reps, baseline="xla")
  for impl in impls:
    add(what, impl, "ms", 1e3 * res["median"][impl])
    add(what, impl, "kv_GBps", kv_read / res["median"][impl] / 1e9)
  if kernels:
    summary[f"verify_Q4_pallas_speedup_over_xla_{case.name}"] = res["ratio"]["pallas"]

  # Draft decode, Q = 1: dense vs selection + sparse attention, this backend's kernels.
  impl = "pallas" if kernels else "xla"
  x = make_inputs(case, queries=1, seed=1)
  args = [x[n] for n in paged]
  sparse_args = args + [x["k_min"], x["k_max"]]
  dense, _ = compile_timed(functools.partial(kernels_pallas.verify_attention, impl=impl),
                           *args)
  for n_sink, n_window, top_k in BUDGETS:
    select = functools.partial(kernels_pallas.select_pages, page_size=case.page_size,
                               n_sink=n_sink, n_window=n_window, top_k=top_k)

    def draft(q, k_pages, v_pages, page_table, kv_lens, k_min, k_max):
      sel = select(q, k_min, k_max, page_table, kv_lens)
      return kernels_pallas.sparse_attention(q, k_pages, v_pages, page_table, kv_lens,
                                             *sel, impl=impl)[0]

    what = f"draft Q=1 B={n_sink + n_window + top_k}"
    sparse, compile_s = compile_timed(draft, *sparse_args)
    add(what, f"{impl}-sparse", "compile_s", compile_s)
    _, valid = select(x["q"], x["k_min"], x["k_max"], x["page_table"], x["kv_lens"])
    add(what, "accounting", "pages_read_per_head", float(valid.sum(-1).mean()))
    add(what, "accounting", "pages_used_per_head",
        float((-(-x["kv_lens"] // case.page_size)).mean()))
    res = common.alternate({"dense": timed(dense, args), "sparse": timed(sparse, sparse_args)},
                           reps, baseline="dense")
    add(what, f"{impl}-dense", "ms", 1e3 * res["median"]["dense"])
    add(what, f"{impl}-sparse", "ms", 1e3 * res["median"]["sparse"])
    summary[f"draft_Q1_sparse_speedup_over_dense_{case.name}_B{n_sink + n_window + top_k}"] = (
        res["ratio"]["sparse"])
  return rows, summary


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="small sizes, few repetitions")
  parser.add_argument("--out", default=common.default_out("kernels"), help="JSON output path")
  args = parser.parse_args(argv)

  backend = jax.default_backend()
  if args.quick:
    cases = [Case(slots=4, context=c, q_heads=16, kv_heads=4, head_dim=64, page_size=16)
             for c in (1024, 4096)]
    reps = 5
  else:
    cases = [Case(slots=8, context=c, q_heads=32, kv_heads=8, head_dim=128, page_size=16)
             for c in (2048, 8192)]
    reps = 15
  bandwidth = common.measure_bandwidth(reps=reps)
  print(f"machine: {common.machine_info()}, jaxlib {jaxlib.__version__}, "
        f"read bandwidth {bandwidth / 1e9:.1f} GB/s")
  if backend not in kernels_pallas.KERNEL_BACKENDS:
    print(f"no Pallas kernel compiles for {backend!r}: timings are of the XLA reference")

  rows = [dict(case="machine", metric="read_bandwidth_GBps", system="machine",
               value=bandwidth / 1e9)]
  summary = {}
  for case in cases:
    case_rows, case_summary = bench_case(case, reps, backend)
    rows += case_rows
    summary.update(case_summary)
  common.print_table(rows, ["case", "system", "metric", "value"])

  # Llama-3-8B / Qwen3-8B attention shapes: Hk = 8, Dh = 128, Ps = 16, bf16.
  layout = Case(slots=1, context=0, q_heads=32, kv_heads=8, head_dim=128, page_size=16)
  accounting = bytes_rows(layout, [1024, 4096, 16384, 32768])
  print("\nbytes read per slot and layer (Hk=8, Dh=128, Ps=16, bf16); sparse includes the "
        "k_min/k_max summaries of every used page")
  common.print_table(accounting, ["context", "budget_pages", "pages_used", "pages_read",
                                  "dense_mib", "sparse_mib", "fraction"])
  for r in accounting:
    rows.append(dict(case=f"L={r['context']} B={r['budget_pages']}", system="accounting",
                     metric="sparse_over_dense_bytes", value=r["fraction"]))
    summary[f"sparse_over_dense_bytes_L{r['context']}_B{r['budget_pages']}"] = r["fraction"]

  print("\nsummary:")
  common.print_table([dict(name=k, value=v) for k, v in summary.items()], ["name", "value"])
  return common.write_results(args.out, "kernels", args.quick, summary, rows,
                              bandwidth_GBps=bandwidth / 1e9)


if __name__ == "__main__":
  main()
