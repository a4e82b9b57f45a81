"""``metrics.json``: the run's metrics of the final weights, as strict JSON, and its log line."""

from __future__ import annotations

import json
import logging
import math
from datetime import datetime
from pathlib import Path
from typing import Any

from dpddp.report.curves import drawable, write_plot

log = logging.getLogger(__name__)

METRIC_KEYS = ("train/loss", "val/loss", "val/acc", "test/loss", "test/acc")

MISSING: dict[str | tuple[str, ...], str] = {  # by the key's prefix
    ("train/", "peak_mem_mib"): "no training step ran",
    "val/": "no validation ran on the final weights (trainer.limit_val_batches=0, or an empty split)",
    "test/": "no test ran",
    "samples_per_sec": "fewer than two training steps: no steady state to measure",
    "allreduce_share": "not timed: no ddp training step",
    ("compute_s_", "allreduce_wait_s_", "slowest_"): "not timed: no ddp training epoch finished",
}


def _shown(key: str, value: Any) -> str:
    """``key=value`` for the log line (large floats grouped, others to 4 digits, the first step's time ISO)."""
    if key == "first_step_unix_s":
        return f"first_step={datetime.fromtimestamp(value).isoformat(timespec='seconds')}" if value else "first_step=-"
    if isinstance(value, float) and math.isfinite(value):
        return f"{key}={value:,.0f}" if abs(value) >= 1000 else f"{key}={value:.4g}"
    return f"{key}={value}"


def write_metrics(
    output_dir: Path, result: dict[str, Any], reasons: dict[str, str], unshown: tuple[str, ...], draw: bool
) -> None:
    """Write ``<output_dir>/metrics.json`` (a non-finite value ``null``, ``"missing"`` saying why: ``reasons``, else
    ``MISSING``), log its line without ``unshown`` and (``draw``) draw the curves."""
    missing = {
        key: reasons.get(key) or next((why for pre, why in MISSING.items() if key.startswith(pre)), "not measured")
        for key, value in result.items()
        if isinstance(value, float) and not math.isfinite(value)
    }
    out = {key: None if key in missing else value for key, value in result.items()}
    output_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps({**out, "missing": missing} if missing else out, indent=2, allow_nan=False)
    (output_dir / "metrics.json").write_text(text + "\n")
    log.info("metrics: " + ", ".join(_shown(k, v) for k, v in result.items() if k not in unshown))
    if draw and drawable(output_dir):  # epochs of a fit: not an evaluation run's
        log.info(f"curves: {write_plot(output_dir)}")
