"""The Python API's one-off `LLM()` with `compile = auto` on a CPU: eager while inductor's cache
does not hold its decode step (a cold compile would not pay back), compiled once it does. Each
engine runs in a process of its own with one inductor cache directory, as two runs of a script
would."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="compile = auto on a CPU")


def _run(script: str, cache_dir: str) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
    env.pop("TORCHINDUCTOR_FORCE_DISABLE_CACHES", None)
    run = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_llm_compiles_its_decode_step_from_a_warm_cache(hf_model_dirs, tmp_path):
    model = str(hf_model_dirs["llama"])
    cache = str(tmp_path / "inductor")
    common = f"""
import json
from torch._dynamo.utils import counters
from controlplane.engine import LLM, SamplingParams
MODEL = {model!r}
ARGS = dict(dtype="float32", max_num_seqs=4)
"""
    # A cold cache: LLM stays eager; LLM(compile="on") compiles and leaves the cache warm.
    first = _run(
        common
        + """
cold = LLM(MODEL, **ARGS)
state_cold = cold.engine.compile_state
del cold
on = LLM(MODEL, compile="on", **ARGS)
print(json.dumps({"cold": state_cold, "on": on.engine.compile_state,
                  "misses": counters["inductor"]["fxgraph_cache_miss"]}))
""",
        cache,
    )
    assert first == {"cold": "off", "on": "ready", "misses": first["misses"]}
    assert first["misses"] > 0  # it compiled: nothing was in the cache

    # Another process, the same cache: LLM() compiles (from the cache), runs its decode steps
    # compiled, and gives eager's tokens.
    second = _run(
        common
        + """
params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
prompts = [[5, 6, 7], [8, 9, 10, 11], [12]]
llm = LLM(MODEL, **ARGS)
outs = llm.generate(prompts, params, use_tqdm=False)
eager = LLM(MODEL, compile="off", **ARGS).generate(prompts, params, use_tqdm=False)
print(json.dumps({"state": llm.engine.compile_state,
                  "steps": llm.engine.runner.compiled.steps,
                  "hits": counters["inductor"]["fxgraph_cache_hit"],
                  "misses": counters["inductor"]["fxgraph_cache_miss"],
                  "tokens": [list(o.token_ids) for o in outs],
                  "eager": [list(o.token_ids) for o in eager]}))
""",
        cache,
    )
    assert second["state"] == "ready"
    assert second["steps"] > 0  # decode steps ran compiled
    assert second["hits"] > 0 and second["misses"] == 0, second  # every graph from the cache
    assert second["tokens"] == second["eager"]
    assert all(len(t) == 12 for t in second["tokens"])
