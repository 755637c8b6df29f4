"""Tensor parallelism on a CPU (issue 56): what splitting a model over ranks costs where there
is nothing to gain: an engine of `--ranks` ranks (each on cores / ranks threads) against one
rank on every core, in the same run, decoding at batch 1 and batch 16, once with each
transport between the ranks (`--comms`: gloo on loopback, shared memory).

What is measured
----------------
The demo model (`--size`, float32), one engine per contender built in this process (the
tensor-parallel one starts its workers). Each batch: `--batch` greedy requests of an 8-token
prompt, EOS ignored, `--tokens` tokens each; decode tokens per second over the whole run (one
warm-up request first, not timed). The ratio is tensor parallel / one rank: on a machine whose
cores one rank already uses, below 1 is the price of the split (two all-reduces a layer and
the logits' gather a step, and the step's inputs broadcast to every worker). For each split
engine it also prints, per batch, each rank's share of its forward spent inside the
collectives (the engine's own figure: /admin/stats tensor_parallel, averaged over the last
steps) and rank 0's time a step to broadcast the step's inputs (the one pickled object).

    python -m benchmarks.tensor_parallel
    python -m benchmarks.tensor_parallel --size tiny --tokens 32   # smoke
    python -m benchmarks.tensor_parallel --comms shm               # one transport
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from controlplane.engine import Engine, SamplingParams
from controlplane.engine.demo_model import write_demo_model


class SendTimer:
    """Rank 0's time in Workers.send (the step's inputs, broadcast), wrapped around it."""

    def __init__(self, engine: Engine) -> None:
        workers = engine.runner.workers
        self.seconds, self.calls = 0.0, 0
        if workers is not None:
            send = workers.send

            def timed(*args: object) -> None:
                t0 = time.perf_counter()
                send(*args)
                self.seconds += time.perf_counter() - t0
                self.calls += 1

            workers.send = timed  # type: ignore[method-assign]

    def take_us(self) -> float:
        """Mean microseconds a send since the last call."""
        mean = self.seconds / self.calls * 1e6 if self.calls else 0.0
        self.seconds, self.calls = 0.0, 0
        return mean


def decode_rate(engine: Engine, batch: int, tokens: int) -> float:
    """Tokens per second generating `tokens` for each of `batch` requests at once."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    engine.add_request([5, 6, 7, 8, 9, 10, 11, 12], SamplingParams(max_tokens=4))  # warm
    while engine.has_unfinished_requests():
        engine.step()
    for i in range(batch):
        engine.add_request([5 + i, 6, 7, 8, 9, 10, 11, 12], params)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return batch * tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="small", help="demo model size (tiny, small)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64, help="tokens a request")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--comms", default="gloo,shm", help="engine.tensor_parallel_comm values")
    args = parser.parse_args()
    model = write_demo_model(Path(tempfile.mkdtemp(prefix="tp-bench-")) / "model", args.size)
    batches = [int(b) for b in args.batches.split(",")]
    common = dict(model=str(model), dtype="float32", compile="off", max_num_seqs=max(batches))
    comms = args.comms.split(",")
    rates: dict[tuple[str, int], float] = {}  # (contender, batch) -> tok/s
    split: dict[tuple[str, int], str] = {}  # the split engines' collective shares and send time
    contenders = [("1 rank", 1, "auto")] + [(c, args.ranks, c) for c in comms]
    for name, ranks, comm in contenders:
        engine = Engine(tensor_parallel_size=ranks, tensor_parallel_comm=comm, **common)
        timer = SendTimer(engine)
        try:
            for batch in batches:
                timer.take_us()  # the warm-up's sends are not this batch's
                rates[name, batch] = decode_rate(engine, batch, args.tokens)
                print(f"{name} batch {batch}: {rates[name, batch]:.1f} tok/s", flush=True)
                if (stats := engine.rank_stats()) is not None:
                    shares = " / ".join(f"{r.all_reduce_share:.0%}" for r in stats)
                    split[name, batch] = f"{shares:>14} {timer.take_us():>9.0f}"
        finally:
            engine.close()
    print(f"{args.size} model, float32, {args.tokens} tokens a request, eager steps")
    print(
        f"{'batch':>5} {'ranks':>6} {'comm':>5} {'tok/s':>9} {'ratio':>7} "
        f"{'collectives':>14} {'send us':>9}"
    )
    for batch in batches:
        one = rates["1 rank", batch]
        print(f"{batch:>5} {1:>6} {'-':>5} {one:>9.1f} {1:>6.2f}x")
        for comm in comms:
            many = rates[comm, batch]
            print(
                f"{batch:>5} {args.ranks:>6} {comm:>5} {many:>9.1f} {many / one:>6.2f}x "
                f"{split[comm, batch]}"
            )


if __name__ == "__main__":
    main()
