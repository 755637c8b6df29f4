"""What a step costs, as a function of what the scheduler put in it, fit from the engine's own
timings: the simulator's clock (planning/simulate.py).

    step_s = base + per_prefill_token x P + per_decode_row x D + per_context_kilotoken x C

P: prompt tokens computed in the step (prefill chunks); D: single-token rows (decodes); C: the
tokens every scheduled row attends to (its context after the step), in thousands. A linear
model: a step's matmuls cost per token (P + D), attention costs per token of context, and the
host's work and the weights' read are the base. It is fit by least squares on a calibration run
(`calibrate`): the real engine, built from the config, stepping a designed mix of prompt
lengths and batch sizes, each step's scheduler output and duration recorded.

A cost model belongs to one machine and one model: it records both (`Fingerprint`), and
`check` refuses one fit elsewhere, naming what differs.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from controlplane.common import cpu_name
from controlplane.planning.window import PlanningError

if TYPE_CHECKING:
    import torch

    from controlplane.engine import Engine
    from controlplane.engine.settings import EngineSettings

# The calibration's workload: (prompt tokens, completion tokens, requests at once). Prefill-
# heavy rows, decode at growing batch sizes, long contexts; together they vary P, D and C
# independently enough for the fit.
CALIBRATION = (
    (512, 2, 4),
    (64, 64, 1),
    (64, 64, 4),
    (64, 64, 16),
    (1024, 32, 2),
    (256, 32, 8),
    (16, 128, 8),
)


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """What the step times depend on besides the step itself."""

    machine: str  # CPU model (and GPU name on CUDA)
    cores: int  # torch's threads
    device: str
    model: str  # the model's directory or file name
    dtype: str
    quantization: str
    torch: str

    def differences(self, other: Fingerprint) -> list[str]:
        mine, theirs = asdict(self), asdict(other)
        return [
            f"{k}: fit on {mine[k]!r}, here {theirs[k]!r}" for k in mine if mine[k] != theirs[k]
        ]


@dataclass(frozen=True, slots=True)
class CostModel:
    base_s: float
    per_prefill_token_s: float
    per_decode_row_s: float
    per_context_kilotoken_s: float
    fingerprint: Fingerprint
    num_kv_blocks: int  # of the engine it was fit on (the simulator's KV budget by default)
    block_size: int
    kv_bytes_per_block: int
    samples: int  # steps the fit used
    rms_error_s: float  # of the fit on its own samples

    def step_s(self, prefill_tokens: int, decode_rows: int, context_tokens: int) -> float:
        return (
            self.base_s
            + self.per_prefill_token_s * prefill_tokens
            + self.per_decode_row_s * decode_rows
            + self.per_context_kilotoken_s * context_tokens / 1000
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        try:
            raw = json.loads(Path(path).read_text())
            raw["fingerprint"] = Fingerprint(**raw["fingerprint"])
            return cls(**raw)
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise PlanningError(f"{path}: not a cost model ({exc})") from None

    def check(self, here: Fingerprint) -> None:
        """PlanningError naming every difference between where it was fit and `here`."""
        diff = self.fingerprint.differences(here)
        if diff:
            raise PlanningError(
                "the cost model was fit on another machine or model ("
                + "; ".join(diff)
                + "): calibrate here (controlplane plan calibrate)"
            )


def fingerprint_of_settings(settings: EngineSettings) -> Fingerprint:
    """This machine's fingerprint for `settings`' engine, without building it: dtype and
    quantization as the settings give them ("auto" when they leave them to the engine, which
    matches a model fit under "auto" on the same machine and model)."""
    import torch

    from controlplane.engine.simulation import model_shape

    shape = model_shape(settings)
    machine = cpu_name()
    if shape.device == "cuda":
        machine += " / " + torch.cuda.get_device_name()
    return Fingerprint(
        machine=machine,
        cores=torch.get_num_threads(),
        device=shape.device,
        model=shape.name,
        dtype=settings.dtype,
        quantization=settings.quantization,
        torch=torch.__version__,
    )


@dataclass(frozen=True, slots=True)
class StepSample:
    prefill_tokens: int
    decode_rows: int
    context_tokens: int
    seconds: float


def calibrate(engine: Engine, rounds: int = 2) -> CostModel:
    """Serve CALIBRATION `rounds` times through an AsyncEngine over `engine` (the serving path:
    the step thread, the event loop taking the outputs), timing each scheduler call with what
    it scheduled; a step's cost is the time to the next call (the whole loop around the step,
    which is what a request waits for). The first round warms up and is not used; a phase's
    last step (followed by idle time) falls to the fit's outlier rule."""
    import asyncio

    from controlplane.engine import AsyncEngine, SamplingParams
    from controlplane.engine.simulation import timed_schedule

    starts: list[int] = []  # where each round's calls begin

    async def serve(calls: list[tuple[float, int, int, int]]) -> None:
        aeng = AsyncEngine(engine)
        aeng.start()
        try:
            for r in range(rounds):
                starts.append(len(calls))
                for prompt, completion, at_once in CALIBRATION:
                    params = SamplingParams(max_tokens=completion, ignore_eos=True)

                    async def one(
                        i: int, r: int = r, prompt: int = prompt, params: SamplingParams = params
                    ) -> None:
                        ids = [3 + (r * 7919 + i * 104729 + j * 31) % 200 for j in range(prompt)]
                        async for _ in aeng.add_request(ids, params):
                            pass

                    await asyncio.gather(*(one(i) for i in range(at_once)))
                    await asyncio.sleep(0.05)
        finally:
            await aeng.shutdown()

    with timed_schedule(engine) as calls:
        asyncio.run(serve(calls))
    warm = starts[1] if len(starts) > 1 else len(calls)
    samples = [
        StepSample(p, d, c, nxt[0] - t) for (t, p, d, c), nxt in itertools.pairwise(calls[warm:])
    ]
    return fit(samples, engine)


def fit(samples: list[StepSample], engine: Engine) -> CostModel:
    import torch

    if len(samples) < 8:
        raise PlanningError(f"{len(samples)} calibration steps are too few to fit a cost model")
    x = torch.tensor(
        [[1.0, s.prefill_tokens, s.decode_rows, s.context_tokens / 1000] for s in samples],
        dtype=torch.float64,
    )
    y = torch.tensor([s.seconds for s in samples], dtype=torch.float64)
    # Least absolute deviations first (iteratively reweighted least squares), then least
    # squares without the steps far off that fit (> 4 median absolute residuals): a step the
    # host interrupted (a page fault storm, a neighbour's burst, the first step of a new shape)
    # would otherwise pull every coefficient. Least squares alone could not drop them: a few
    # 28 ms steps among hundreds of 0.6 ms ones moved its fit so far that every residual was
    # large and none stood out.
    weight = torch.ones_like(y)
    for _ in range(_IRLS_ROUNDS):
        root = weight.sqrt()
        coef = _nonnegative_lstsq(x * root.unsqueeze(1), y * root)
        weight = 1.0 / (x @ coef - y).abs().clamp(min=1e-6)
    residual = (x @ coef - y).abs()
    keep = residual <= 4 * residual.median().clamp(min=1e-6)
    coef = _nonnegative_lstsq(x[keep], y[keep])
    rms = float(((x[keep] @ coef - y[keep]) ** 2).mean().sqrt())
    spec = engine.kv_cache.spec
    return CostModel(
        base_s=float(coef[0]),
        per_prefill_token_s=float(coef[1]),
        per_decode_row_s=float(coef[2]),
        per_context_kilotoken_s=float(coef[3]),
        fingerprint=fingerprint_of_settings(engine.settings),
        num_kv_blocks=engine.block_pool.num_blocks,
        block_size=engine.settings.block_size,
        kv_bytes_per_block=spec.bytes_per_block,
        samples=len(samples),
        rms_error_s=rms,
    )


_IRLS_ROUNDS = 20  # reweightings toward the least-absolute-deviations fit
# The pull of each per-token coefficient toward 0, relative to its column's energy: it decides
# between fits the data cannot tell apart (steps that all decode 8 rows price as 0.9 ms of base
# or as 0.11 ms a row alike; the first says a 1-row step costs 0.9 ms, the second 0.11 ms) in
# favour of the base (a step's fixed costs: weights read, host work), and moves a fit the data
# does determine by about this fraction at most.
_RIDGE = 1e-3


def _nonnegative_lstsq(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The least-squares coefficients under coefficient >= 0 (no cost is negative), the
    per-token ones (columns 1..) pulled slightly toward 0 (_RIDGE), exactly: the best of the
    unconstrained fits on every subset of the columns whose coefficients come out non-negative
    (16 subsets of 4 columns). Clamping one unconstrained fit instead is wrong where the
    columns move together: a live daemon decoding 8 rows at every step gave base -26 ms and
    3.4 ms a row, which clamped to a 28 ms base for 1 ms steps."""
    import torch

    cols = x.shape[1]
    pull = (_RIDGE * (x**2).sum(0)).sqrt()
    pull[0] = 0.0  # the base is not pulled
    x = torch.cat([x, torch.diag(pull)])
    y = torch.cat([y, torch.zeros(cols, dtype=y.dtype)])
    best, best_err = torch.zeros(cols, dtype=x.dtype), float((y**2).sum())
    for subset in itertools.chain.from_iterable(
        itertools.combinations(range(cols), k) for k in range(1, cols + 1)
    ):
        sub = list(subset)
        sol = torch.linalg.lstsq(x[:, sub], y.unsqueeze(1)).solution.squeeze(1)
        if bool((sol < 0).any()):
            continue
        coef = torch.zeros(cols, dtype=x.dtype)
        coef[sub] = sol
        err = float(((x @ coef - y) ** 2).sum())
        if err < best_err:
            best, best_err = coef, err
    return best
