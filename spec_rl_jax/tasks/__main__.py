"""Exports a built-in task split to JSONL (the prompt/answer schema of user datasets).

  python -m spec_rl_jax.tasks countdown --split test --n 500 --out cd_test.jsonl \\
      --param num_numbers=4 --param max_number=20
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from spec_rl_jax.tasks import TASKS, get_task
from spec_rl_jax.tasks.base import SPLITS, export_jsonl


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("task", choices=sorted(TASKS))
  parser.add_argument("--split", choices=SPLITS, default="train")
  parser.add_argument("--n", type=int, default=1000, help="distinct problems to write")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", required=True)
  parser.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                      help="difficulty parameter (repeatable), e.g. max_digits=5")
  args = parser.parse_args(argv)
  params = {k: json.loads(v) for k, _, v in (p.partition("=") for p in args.param)}
  n = export_jsonl(get_task(args.task, **params), args.out, args.split, args.n, args.seed)
  print(f"wrote {n} {args.task} {args.split} records to {args.out}")


if __name__ == "__main__":
  main()
