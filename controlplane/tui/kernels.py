"""Whether the daemon runs our compiled kernels and its compiled decode step, as /admin/stats
says (pure functions, no Textual): shown in the header when the kernels fell back, and in the
batch panel always."""

from __future__ import annotations

from typing import Any

from rich.markup import escape

# cpu_kernels states (engine/kernels/cpu_ops.state) that mean the daemon serves without them.
FELL_BACK = ("failed", "lock_timeout", "stopped")


def kernels_status(stats: dict[str, Any] | None) -> tuple[str, str | None] | None:
    """("ok" | "fallback" | a state still on its way, the reason or None) from /admin/stats:
    its `kernels` field ({"status", "reason"}), or, from a daemon that predates it, its
    `cpu_kernels` ({"state", "reason"}); None when the daemon says neither (or never asked for
    the kernels: not a CPU engine)."""
    stats = stats or {}
    kernels = stats.get("kernels")
    if isinstance(kernels, dict) and kernels.get("status"):
        return str(kernels["status"]), kernels.get("reason") or None
    cpu = stats.get("cpu_kernels")
    if not isinstance(cpu, dict) or cpu.get("state") in (None, "unused"):
        return None
    state = str(cpu["state"])
    if state == "ready":
        return "ok", None
    if state in FELL_BACK:
        return "fallback", cpu.get("reason") or state
    return state, None  # building, waiting: the kernels are on their way


def kernels_line(stats: dict[str, Any] | None) -> str:
    """`kernels: ok` or `kernels: fallback: <reason>`, then, on a line of its own, the compiled
    decode step's state (`compiled_step`: off, warming, ready, failed), as Rich markup; empty
    when the daemon reports neither."""
    parts = []
    status = kernels_status(stats)
    if status is not None:
        word, reason = status
        style = {"ok": "green", "fallback": "bold yellow"}.get(word, "cyan")
        parts.append(f"kernels: [{style}]{word}[/]" + (f": {escape(reason)}" if reason else ""))
    stats = stats or {}
    step = stats.get("compiled_step")
    if step:
        style = {"ready": "green", "failed": "bold yellow", "warming": "cyan"}.get(step, "dim")
        line = f"compiled_step: [{style}]{escape(str(step))}[/]"
        rows, seqs = stats.get("compiled_max_rows"), stats.get("max_num_seqs")
        if isinstance(rows, int) and step in ("ready", "warming"):
            line += f", up to {rows} rows"
            if isinstance(seqs, int) and seqs > rows:
                # Raised live past the ceiling (restart-only): the larger steps run eagerly.
                line += f" [bold yellow](max_num_seqs {seqs}: larger steps eager)[/]"
        parts.append(line)
    return "\n".join(parts)
