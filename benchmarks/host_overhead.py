"""The host time of a decode step: what `Engine.step()` spends outside the model's forward.

What is measured
----------------
A tiny random-weight Llama (the ``tiny`` demo model: hidden 64, 2 layers, vocabulary 1,024,
float32, written once into ``.bench/tiny``), so that the forward is small and the rest of the
step is what shows: scheduling, the runner's inputs and the attention metadata, sampling,
output processing (stop checks, detokenization, the ``RequestOutput`` of every row) and the
step's statistics. For each ``--rows`` count R (1, 16, 64, 256) and each ``--backends``
attention backend (``torch``, and ``cpu``, our C++ decode kernel, where it builds): an eager
engine (``compile = off``) with ``max_num_seqs = R``, a token budget that prefills all R at
once, and a KV cache that holds them all; R requests of ``--prompt`` (8) distinct token ids,
greedy (``--temperature`` to sample), EOS ignored, run to steady decode (every row decoding)
and on until each has ``--decoded`` output tokens (0; long outputs cost more where the work
grows with the text), then ``--warmup`` steps, then ``--steps`` timed steps, on
``--threads`` torch threads (1: the host work is single-threaded Python, and one thread keeps
the forward steady on a CPU that other jobs share).

Two passes a configuration, one after the other on the same engine:

* plain: only ``Engine.step()`` and the model's forward (``runner.model`` wrapped by a timer)
  are timed; **host = step - forward**, per step. This is the headline figure.
* phases: the same plus a timer around each phase (each adds well under a microsecond a
  call): ``schedule`` (``Scheduler.schedule``), ``inputs`` (``ModelRunner.execute`` minus the
  forward and ``prepare``: token ids, positions, spans, the input tensors, KV copies),
  ``prepare`` (the backend's metadata), ``sample`` (``Sampler.__call__``), ``output``
  (``Engine._after_forward`` minus sampling: bookkeeping, stop checks, detokenization,
  outputs), of which ``detok`` (every ``IncrementalDetokenizer.add``) is shown on its own, and
  ``rest`` (the step minus all of these: speculation's and the mask worker's checks, the
  ``StepStats`` snapshot).

Each configuration runs in a child process that imports ``controlplane`` from the checkout, or
from ``--rev``'s tree (``git archive``); ``--baseline REV`` measures that commit's tree too, in
children interleaved with ours (the order alternates every repeat), and prints ours / baseline
per configuration: best against best, and the median of the per-repeat ratios (each repeat
runs the two trees back to back, so on a machine whose speed drifts over minutes, as a shared
VM's does, the paired ratio is the steadier figure).

Every figure is the median over the timed steps, in microseconds per step; with ``--repeats``
the best (lowest) median of the repeats, since on a shared machine noise only adds. The
targets of issue 54: host at most 100 us at one row and 400 us at 256 rows. The load average
is printed at the start and the end: compare figures within one run.

How to run
----------
    python -m benchmarks.host_overhead                       # ~1 minute on 2 quiet cores
    python -m benchmarks.host_overhead --rows 1,256 --backends torch --repeats 1
    python -m benchmarks.host_overhead --json /tmp/host.json
    python -m benchmarks.host_overhead --rev HEAD --baseline HEAD~3   # ~2 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from controlplane.common import cpu_name

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL_DIR = REPO_ROOT / ".bench" / "tiny"
PHASES = ("schedule", "inputs", "prepare", "sample", "output", "detok", "rest")
TARGETS_US = {1: 100.0, 256: 400.0}


def log(msg: str) -> None:
    print(msg, flush=True)


def ensure_model(path: Path) -> Path:
    from controlplane.engine.demo_model import write_demo_model

    return write_demo_model(path, size="tiny")


class Timers:
    """Per-step sums of named timers: `wrap` a callable, then `take` after each step."""

    def __init__(self) -> None:
        self.now: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        acc = self.now
        clock = time.perf_counter

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[name] += clock() - t0

        return timed

    def take(self) -> dict[str, float]:
        out = dict(self.now)
        self.now.clear()
        return out


class _TimedSampler:
    """Stands in for the engine's Sampler: times its calls, passes everything else through."""

    def __init__(self, sampler: Any, timers: Timers) -> None:
        self._sampler = sampler
        self._call = timers.wrap("sample", sampler.__call__)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sampler, name)


class _TimedModel:
    """Stands in for runner.model: times the forward only."""

    def __init__(self, model: Any, timers: Timers) -> None:
        self._model = model
        self._call = timers.wrap("forward", model)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def instrument(engine: Any, timers: Timers, phases: bool) -> Callable[[], None]:
    """Put the timers in place (the forward's always, the phases' when asked); returns a
    function that takes them out again."""
    runner, scheduler = engine.runner, engine.scheduler
    saved: list[tuple[Any, str]] = [(runner, "model")]
    runner.model = _TimedModel(runner.model, timers)
    if phases:
        scheduler.schedule = timers.wrap("schedule", scheduler.schedule)
        runner.execute = timers.wrap("execute", runner.execute)
        runner.backend.prepare = timers.wrap("prepare", runner.backend.prepare)
        engine._after_forward = timers.wrap("after_forward", engine._after_forward)
        engine.sampler = _TimedSampler(engine.sampler, timers)
        saved += [
            (scheduler, "schedule"),
            (runner, "execute"),
            (runner.backend, "prepare"),
            (engine, "_after_forward"),
            (engine, "sampler"),
        ]
        for seq in engine.requests.values():
            seq.detokenizer.add = timers.wrap("detok", seq.detokenizer.add)
            saved.append((seq.detokenizer, "add"))

    def undo() -> None:
        for obj, name in saved:
            if name == "model":
                obj.model = obj.model._model
            elif name == "sampler":
                obj.sampler = obj.sampler._sampler
            else:
                delattr(obj, name)  # the instance attribute goes; the class's method is back

    return undo


def timed_steps(engine: Any, timers: Timers, steps: int) -> list[dict[str, float]]:
    """`steps` engine steps, each a record of seconds: step, forward and whatever is wrapped."""
    clock = time.perf_counter
    records = []
    for _ in range(steps):
        timers.take()
        t0 = clock()
        engine.step()
        total = clock() - t0
        rec = timers.take()
        rec["step"] = total
        records.append(rec)
    return records


def phase_breakdown(rec: dict[str, float]) -> dict[str, float]:
    """One step's phases in seconds, from its raw timers."""
    get = rec.get
    forward, prepare = get("forward", 0.0), get("prepare", 0.0)
    sample, after = get("sample", 0.0), get("after_forward", 0.0)
    schedule, execute = get("schedule", 0.0), get("execute", 0.0)
    return {
        "schedule": schedule,
        "inputs": execute - forward - prepare,
        "prepare": prepare,
        "sample": sample,
        "output": after - sample,
        "detok": get("detok", 0.0),
        "rest": rec["step"] - schedule - execute - after,
    }


def median_us(values: list[float]) -> float:
    return 1e6 * statistics.median(values)


def measure(model_dir: Path, backend: str, rows: int, args: argparse.Namespace) -> dict[str, Any]:
    """One configuration: both passes; medians in microseconds a step."""
    from controlplane.engine import Engine, SamplingParams

    steps = args.warmup + args.steps
    # Both passes, the ramp to steady decode, the outputs asked for before them, some slack.
    new_tokens = 2 * steps + args.decoded + 8
    per_seq_blocks = -(-(args.prompt + new_tokens) // args.block_size)
    engine = Engine(
        model=str(model_dir),
        dtype="float32",
        device="cpu",
        compile="off",
        attention_backend=backend,
        max_num_seqs=rows,
        max_num_batched_tokens=max(2048, rows * args.prompt),
        block_size=args.block_size,
        num_kv_blocks=rows * per_seq_blocks + 8,
        seed=0,
    )
    params = SamplingParams(
        max_tokens=new_tokens, temperature=args.temperature, ignore_eos=True, seed=None
    )
    vocab = engine.model_config.vocab_size
    for i in range(rows):
        prompt = [(97 * i + 13 * j) % (vocab - 16) + 8 for j in range(args.prompt)]
        engine.add_request(prompt, params)
    # Prefill (one step fits all prompts) then a couple of steps: every row decoding; then
    # the outputs grow to --decoded tokens.
    for _ in range(3 + args.decoded):
        engine.step()
    sch = engine.scheduler
    assert len(sch.running) == rows and not sch.waiting, (len(sch.running), len(sch.waiting))

    result: dict[str, Any] = {"backend": type(engine.runner.backend).__name__, "rows": rows}
    timers = Timers()
    for phases in (False, True):
        undo = instrument(engine, timers, phases)
        try:
            timed_steps(engine, timers, args.warmup)
            records = timed_steps(engine, timers, args.steps)
        finally:
            undo()
        decoding = [r for r in records if "forward" in r]
        if len(decoding) != len(records):
            raise RuntimeError("a timed step ran no forward: the requests ended early")
        if not phases:
            result["step_us"] = median_us([r["step"] for r in records])
            result["forward_us"] = median_us([r["forward"] for r in records])
            result["host_us"] = median_us([r["step"] - r["forward"] for r in records])
        else:
            broken = [phase_breakdown(r) for r in records]
            result["phases_step_us"] = median_us([r["step"] for r in records])
            for name in PHASES:
                result[name + "_us"] = median_us([b[name] for b in broken])
    assert all(not o.finished for o in engine.step()), "a request finished inside the run"
    return result


def best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Across repeats: each figure's lowest median."""
    out = dict(runs[0])
    for key in out:
        if key.endswith("_us"):
            out[key] = min(r[key] for r in runs)
    out["host_us_repeats"] = [round(r["host_us"], 1) for r in runs]
    return out


def table(results: list[dict[str, Any]]) -> str:
    head = ["backend", "rows", "step", "forward", "host", "target", *PHASES]
    lines = [
        " | ".join(head),
        " | ".join("---" for _ in head),
    ]
    for r in results:
        target = TARGETS_US.get(r["rows"])
        lines.append(
            " | ".join(
                [
                    r["backend"],
                    str(r["rows"]),
                    f"{r['step_us']:.0f}",
                    f"{r['forward_us']:.0f}",
                    f"{r['host_us']:.0f}",
                    "" if target is None else f"<= {target:.0f}",
                    *(f"{r[p + '_us']:.1f}" for p in PHASES),
                ]
            )
        )
    return "\n".join(lines)


def export_tree(rev: str, into: Path) -> Path:
    """`git archive` of `rev` into a fresh folder: a commit's code, whatever the checkout
    holds (the controlplane package is imported from there)."""
    import io
    import subprocess
    import tarfile

    data = subprocess.run(
        ["git", "archive", "--format=tar", rev, "controlplane"],
        cwd=REPO_ROOT,
        check=True,
        capture_output=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return into


def run_child(tree: Path, args: argparse.Namespace, backends: list[str]) -> list[dict[str, Any]]:
    """Every configuration once, in a child process importing controlplane from `tree`."""
    import subprocess
    import sys

    cmd = [
        sys.executable,
        "-P",  # not this script's folder on sys.path: controlplane comes from `tree`
        str(Path(__file__).resolve()),
        "--child",
        f"--rows={args.rows}",
        f"--backends={','.join(backends)}",
        f"--steps={args.steps}",
        f"--warmup={args.warmup}",
        f"--prompt={args.prompt}",
        f"--decoded={args.decoded}",
        f"--block-size={args.block_size}",
        f"--temperature={args.temperature}",
        f"--threads={args.threads}",
        f"--model-dir={args.model_dir}",
    ]
    env = dict(os.environ, PYTHONPATH=str(tree))
    if tree != REPO_ROOT and "CONTROLPLANE_KERNELS_DIR" not in env:
        # An exported tree is a second copy of the sources, which would get a build of its
        # own (minutes); where its sources are the checkout's, the checkout's build fits.
        from controlplane.engine.kernels.cpu_ops import extensions_root

        env["CONTROLPLANE_KERNELS_DIR"] = str(extensions_root())
    proc = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"child on {tree} failed:\n{proc.stderr[-4000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def child(args: argparse.Namespace) -> int:
    """--child: measure every configuration once, one JSON line each on stdout."""
    import controlplane

    here = Path(controlplane.__file__).resolve().parent.parent
    for backend in args.backends.split(","):
        for rows in map(int, args.rows.split(",")):
            r = measure(args.model_dir, backend, rows, args)
            r["tree"] = str(here)
            print(json.dumps(r), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--rows", default="1,16,64,256", help="decoding rows a step, comma-separated")
    p.add_argument(
        "--backends",
        default="torch,cpu",
        help="attention backends, comma-separated (one that cannot run here is skipped)",
    )
    p.add_argument("--steps", type=int, default=100, help="timed steps a pass")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps before each pass")
    p.add_argument("--repeats", type=int, default=3, help="runs of each configuration (best kept)")
    p.add_argument("--prompt", type=int, default=8, help="prompt tokens a request")
    p.add_argument(
        "--decoded",
        type=int,
        default=0,
        help="output tokens each request has before the passes (untimed): long outputs",
    )
    p.add_argument("--block-size", type=int, default=16, help="engine.block_size")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (0: torch's default); the host work is single-threaded Python, and "
        "one thread keeps the forward's timing steady on a CPU other jobs share",
    )
    p.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR, help="tiny demo model")
    p.add_argument(
        "--rev",
        default=None,
        help="measure this commit's controlplane package (git archive) instead of the checkout's",
    )
    p.add_argument(
        "--baseline",
        default=None,
        help="also measure this commit's package, interleaved, and print ours / baseline",
    )
    p.add_argument("--json", type=Path, default=None, help="write the summary here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        return child(args)

    import tempfile

    ensure_model(args.model_dir)
    from controlplane.engine.attention.registry import backend_class

    usable = []
    for name in (b.strip() for b in args.backends.split(",") if b.strip()):
        why = backend_class(name).unavailable(torch.device("cpu"))
        if why is None:
            usable.append(name)
        else:
            log(f"backend {name}: skipped ({why})")
    scratch_dir = tempfile.TemporaryDirectory(prefix="host_overhead-")
    scratch = Path(scratch_dir.name)
    trees = {"ours": export_tree(args.rev, scratch / "ours") if args.rev else REPO_ROOT}
    if args.baseline:
        trees["baseline"] = export_tree(args.baseline, scratch / "baseline")
    names = {"ours": args.rev or "the checkout", "baseline": args.baseline}
    load_start = os.getloadavg()
    log(f"CPU: {cpu_name()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    log(f"load average at start: {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}")
    runs: dict[tuple[str, str, int], list[dict[str, Any]]] = defaultdict(list)
    t_start = time.perf_counter()
    order = list(trees)
    for rep in range(args.repeats):
        for which in order if rep % 2 == 0 else order[::-1]:
            for r in run_child(trees[which], args, usable):
                runs[which, r["backend"], r["rows"]].append(r)
                log(
                    f"repeat {rep + 1}/{args.repeats} {which} ({names[which]}) {r['backend']} "
                    f"{r['rows']:>3} rows: step {r['step_us']:.0f} us, forward "
                    f"{r['forward_us']:.0f}, host {r['host_us']:.0f}"
                )
    results = {
        which: [
            best(runs[key]) for key in sorted(runs, key=lambda k: (k[1], k[2])) if key[0] == which
        ]
        for which in trees
    }
    load_end = os.getloadavg()
    log(f"load average at end: {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f}")
    for which, rs in results.items():
        log(
            f"\n{which} ({names[which]}): microseconds a decode step, best of {args.repeats} "
            f"medians over {args.steps} steps (host = step - forward; phases from the second, "
            "instrumented pass):\n"
        )
        log(table(rs))
    for r in results["ours"]:
        target = TARGETS_US.get(r["rows"])
        if target is not None:
            log(
                f"{r['backend']} {r['rows']} rows: host {r['host_us']:.0f} us, "
                f"{r['host_us'] / target:.2f} of the {target:.0f} us target"
            )
    paired: dict[str, float] = {}
    if "baseline" in results:
        log(
            f"\nhost time, ours ({names['ours']}) / baseline ({args.baseline}): best against "
            "best, and the median of each repeat's pair (the two children run back to back, so "
            "a machine whose speed drifts over minutes moves both alike)"
        )
        base = {(r["backend"], r["rows"]): r for r in results["baseline"]}
        for r in results["ours"]:
            key = (r["backend"], r["rows"])
            b = base.get(key)
            if b:
                pairs = [
                    o["host_us"] / q["host_us"]
                    for o, q in zip(runs["ours", *key], runs["baseline", *key], strict=True)
                ]
                paired[f"{key[0]} {key[1]}"] = statistics.median(pairs)
                log(
                    f"  {r['backend']} {r['rows']:>3} rows: {r['host_us']:.0f} / "
                    f"{b['host_us']:.0f} us = {r['host_us'] / b['host_us']:.2f}; paired "
                    f"median {statistics.median(pairs):.2f} (of {', '.join(f'{x:.2f}' for x in pairs)})"
                )
    log(f"({time.perf_counter() - t_start:.0f} s)")
    if args.json:
        summary = {
            "cpu": cpu_name(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "load_average": {"start": load_start, "end": load_end},
            "settings": {
                k: v for k, v in vars(args).items() if k not in ("json", "model_dir", "child")
            },
            "targets_us": TARGETS_US,
            "results": results,
            "paired_host_ratio": paired,
        }
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
