"""notebooks/quickstart.ipynb runs top to bottom (nbclient) at tiny sizes: SFT of tiny
models into a temporary cache, a 2-step GRPO run with speculative rollouts, the plots
inline, a generation with the trained policy."""

import ast
import base64
import glob
import json
import os
import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"
TINY_PARAMETERS = """
TINY = True
SFT_STEPS = 2
SFT_BATCH_SIZE = 4
RL_STEPS = 2
PROMPTS_PER_STEP = 2
GROUP_SIZE = 4
MAX_NEW_TOKENS = 12
NUM_DRAFT_TOKENS = 2
EVAL_N = 0
NUM_EXAMPLES = 3
PROGRESS = False
"""


def _tagged(nb, tag):
  cells = [c for c in nb.cells if tag in c.metadata.get("tags", [])]
  assert len(cells) == 1, f"expected one cell tagged {tag!r}"
  return cells[0]


def _text(cell) -> str:
  return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream"
                 and o.name == "stdout")


def test_quickstart_notebook_runs_at_tiny_sizes(tmp_path, monkeypatch):
  nb = nbformat.read(NOTEBOOK, as_version=4)
  params = _tagged(nb, "parameters")
  # The test's values replace every default (papermill-style), so a parameter added to
  # the notebook without a tiny value here fails loudly.
  names = lambda src: sorted(line.split("=")[0].strip() for line in src.splitlines()
                             if "=" in line and not line.lstrip().startswith("#"))
  assert names(params.source) == names(TINY_PARAMETERS)
  params.source = TINY_PARAMETERS.strip()

  cache = tmp_path / "cache"
  monkeypatch.setenv("SPEC_RL_JAX_CACHE", str(cache))
  monkeypatch.delenv("SPEC_RL_JAX_XLA_CACHE", raising=False)  # the notebook's own cache
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.setenv("XLA_FLAGS", "")  # one CPU device, not the tests' eight
  work = tmp_path / "work"
  work.mkdir()
  client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                   resources={"metadata": {"path": str(work)}})
  client.execute()  # raises CellExecutionError on the first failing cell

  # Step 1: the tiny models went to the cache's tiny/ subdirectory, not over the defaults.
  for target in ("policy", "draft"):
    assert (cache / "tiny" / target / "config.json").exists()
    assert not (cache / target).exists()
  with open(cache / "tiny" / "report.json") as f:
    assert {m["steps"] for m in json.load(f)["models"].values()} == {2}

  # Step 2: two GRPO steps, every round speculative (K = 2), logged in runs/quickstart-*.
  run_dirs = glob.glob(str(work / "runs" / "quickstart-*"))
  assert len(run_dirs) == 1
  with open(os.path.join(run_dirs[0], "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  assert [r["step"] for r in records] == [1, 2]
  for r in records:
    assert 0.0 <= r["rollout/reward_mean"] <= 1.0
    assert r["spec/k_frac/2"] == 1.0
    assert 1.0 <= r["spec/acceptance_length"] <= 3.0
    assert r["train/skipped"] == 0

  # Step 3: one inline figure (PNG) and the last step's summary line.
  plots = _tagged(nb, "plots")
  pngs = [o.data["image/png"] for o in plots.outputs if "image/png" in o.get("data", {})]
  assert len(pngs) == 1
  assert base64.b64decode(pngs[0]).startswith(b"\x89PNG")
  assert "acceptance length" in _text(plots)

  # Step 4: the trained policy answered the held-out problems.
  lines = _text(_tagged(nb, "generation")).splitlines()
  responses = [ast.literal_eval(line[len("response:"):].strip()) for line in lines
               if line.startswith("response:")]  # printed with repr
  assert len(responses) == 3
  assert all(isinstance(r, str) for r in responses) and any(responses)
  assert sum(line.startswith("reference:") for line in lines) == 3
