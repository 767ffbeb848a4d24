"""Hardware table: one chip's peak rates and the pod it sits in.

Per chip: ``P`` peak dense bf16 FLOP/s, ``M`` HBM bytes, ``W`` HBM bandwidth (bytes/s),
``β`` collective bandwidth per chip inside its fast domain (one direction, bytes/s),
``D`` chips in that domain, ``β_net`` per-chip bandwidth across domains, ``τ`` the fixed
latency of one forward call (launch, host round trip), ``λ`` the fixed latency of one
layer of one forward (per-op overhead that neither FLOPs nor bytes account for: a forward
costs ``τ + λ·L`` on top of its roofline), ``η_P`` and ``η_W`` the fractions of ``P`` and
``W`` that kernels reach.

Sources (vendor pages as of 2025):

* TPU v5p: Cloud TPU docs, "TPU v5p": 459 TFLOP/s bf16, 95 GB HBM2e at 2,765 GB/s, ICI
  4,800 Gbps per chip over 6 links of a 3D torus. A ring along one torus axis uses 2 of
  them, 100 GB/s each way: ``β`` = 200 GB/s. ``tpu-v5p-N`` counts TensorCores (the
  Cloud naming), 2 per chip: v5p-64 is 32 chips.
* H100 SXM: NVIDIA H100 datasheet: 989 TFLOP/s dense bf16, 80 GB HBM3 at 3.35 TB/s,
  NVLink 900 GB/s per GPU (450 each way) inside an 8-GPU node; 400 Gb/s InfiniBand per
  GPU across nodes.
* H200 SXM: NVIDIA H200 datasheet: as H100 with 141 GB HBM3e at 4.8 TB/s.
* GB200 (one Blackwell GPU of a GB200 NVL72): NVIDIA GB200 NVL72 page: 180 PFLOP/s dense
  bf16 and 13.4 TB HBM3e at 576 TB/s per 72 GPUs (2.5 PFLOP/s, 186 GB, 8 TB/s per GPU),
  NVLink 5 1.8 TB/s per GPU (900 GB/s each way) across the 72.
* this-machine: measured, not published, from a `bench.rollout` JSON
  (``--machine-json``: rows named as `THIS_MACHINE_DEFAULTS` where present), else the
  figures recorded in docs/benchmarks.md ("Performance simulator"): ``P`` a jitted fp32
  matmul, ``W`` `bench.common.measure_bandwidth`, ``τ`` an engine round of the tiny test
  model, ``λ`` fitted by `sim.overhead` to 1-slot engine rounds of the default policy
  and draft shapes at 1-8 layers less their roofline (no cost shows above the roofline:
  0), ``η_P`` the decode FLOP/s of `bench.rollout`'s 110M model at batch 32 over ``P``,
  ``η_W`` its batch-1 fraction of the bandwidth bound. Calibration (a) uses the
  ``P``, ``W``, ``τ``, ``λ`` its recording probed alongside its steps (`sim.record`).

``τ``, ``η_P`` and ``η_W`` of the accelerators are assumptions (no vendor states them):
τ = 30 µs per forward (kernel launches), λ = 0 (per-layer cost is in τ: forwards are
captured or fused into few launches), η_P = 0.7, η_W = 0.8.
"""

from __future__ import annotations

import dataclasses
import json
import re

HBM_USABLE = 0.9  # of M: the runtime, compiler scratch and fragmentation keep the rest


@dataclasses.dataclass(frozen=True)
class Chip:
  """One accelerator (symbols in the module docstring)."""

  name: str
  peak_flops: float  # P
  hbm_bytes: float  # M
  hbm_bw: float  # W
  link_bw: float  # β
  domain: int  # D
  net_bw: float  # β_net
  call_latency: float = 30e-6  # τ
  layer_latency: float = 0.0  # λ
  flops_eff: float = 0.7  # η_P
  bw_eff: float = 0.8  # η_W
  source: str = ""


@dataclasses.dataclass(frozen=True)
class Pod:
  """``chips`` chips of one kind, named as on the command line."""

  name: str
  chip: Chip
  chips: int

  def collective_bw(self, group: int) -> float:
    """Per-chip bandwidth of a collective over ``group`` chips: ``β`` while the group
    fits one fast domain (``group <= D``), else ``β_net``."""
    return self.chip.link_bw if group <= self.chip.domain else self.chip.net_bw


CHIPS: dict[str, Chip] = {c.name: c for c in (
    Chip("tpu-v5p", 459e12, 95e9, 2.765e12, 200e9, 10**6, 200e9,
         source="Cloud TPU v5p docs"),
    Chip("h100", 989e12, 80e9, 3.35e12, 450e9, 8, 50e9, source="NVIDIA H100 SXM datasheet"),
    Chip("h200", 989e12, 141e9, 4.8e12, 450e9, 8, 50e9, source="NVIDIA H200 SXM datasheet"),
    Chip("gb200", 2.5e15, 186e9, 8e12, 900e9, 72, 50e9, source="NVIDIA GB200 NVL72 page"),
)}

# This machine (2 shared CPU cores, AMD EPYC): docs/benchmarks.md, "Performance simulator".
THIS_MACHINE_DEFAULTS = {"matmul_GFLOPs": 220.0, "read_bandwidth_GBps": 38.7,
                         "call_latency_ms": 0.08, "layer_latency_ms": 0.0, "flops_eff": 0.62,
                         "bw_eff": 0.77}

HARDWARE_FORMS = ("tpu-v5p-<TensorCores>", "h100-x<GPUs>", "h200-x<GPUs>", "gb200-x<GPUs>",
                  "this-machine")


def this_machine_from(figures: dict) -> Chip:
  """This machine as a `Chip` from figures named as `THIS_MACHINE_DEFAULTS`."""
  bw = figures["read_bandwidth_GBps"] * 1e9
  return Chip("this-machine", figures["matmul_GFLOPs"] * 1e9, 64e9, bw, bw, 1, bw,
              call_latency=figures["call_latency_ms"] * 1e-3,
              layer_latency=figures["layer_latency_ms"] * 1e-3, flops_eff=figures["flops_eff"],
              bw_eff=figures["bw_eff"], source=figures.get("source", "docs/benchmarks.md"))


def this_machine(machine_json: str | dict | None = None) -> Chip:
  """This machine as a `Chip` from its measured figures (module docstring); from
  ``machine_json`` (a `bench.rollout` or `sim.overhead` result, rows named as
  `THIS_MACHINE_DEFAULTS`; or those figures as a dict) where it has them."""
  figures = dict(THIS_MACHINE_DEFAULTS)
  if isinstance(machine_json, dict):
    figures.update(machine_json)
  elif machine_json:
    with open(machine_json) as f:
      rows = json.load(f).get("rows", [])
    figures.update({r["metric"]: float(r["value"]) for r in rows
                    if r.get("metric") in THIS_MACHINE_DEFAULTS})
    figures["source"] = machine_json
  return this_machine_from(figures)


def get_pod(name: str, machine_json: str | None = None) -> Pod:
  """``tpu-v5p-64`` (TensorCores), ``h100-x8`` / ``h200-x64`` / ``gb200-x32`` (GPUs) or
  ``this-machine``; anything else is an error that lists the known forms."""
  if name == "this-machine":
    return Pod(name, this_machine(machine_json), 1)
  m = re.fullmatch(r"tpu-v5p-(\d+)", name)
  if m and int(m.group(1)) >= 2 and int(m.group(1)) % 2 == 0:
    return Pod(name, CHIPS["tpu-v5p"], int(m.group(1)) // 2)
  m = re.fullmatch(r"(h100|h200|gb200)-x(\d+)", name)
  if m and int(m.group(2)) >= 1:
    return Pod(name, CHIPS[m.group(1)], int(m.group(2)))
  raise ValueError(f"unknown hardware {name!r}; known forms: {', '.join(HARDWARE_FORMS)}"
                   f" (e.g. tpu-v5p-64, tpu-v5p-512, h100-x8, h200-x64, gb200-x32)")
