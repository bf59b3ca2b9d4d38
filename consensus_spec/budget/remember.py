"""Step costs remembered per machine: what the budget learned, kept in the
user's cache folder so the next start begins from it.

One JSON file per key (model, dtype, device, tensor/data parallel size,
vLLM version: whatever the caller says identifies the machine and the
engine), named by a hash of the key. It holds the prior model the fit was
relative to, the fit as a measured table (``MeasuredStepCosts.export``) and
where the guard had switched drafting off. Written atomically (a temporary
file in the same folder, then ``os.replace``), so a reader sees the old
file or the new one, never half of one. A file that cannot be read, is
malformed, was written for another key or format, or is older than
``MAX_AGE_S`` is not used; :func:`load` says why, and the caller logs it once.

Nothing here knows vLLM: the adapter builds the key.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time

from .cost_models import StepCostModel

FORMAT = 1
MAX_AGE_S = 30 * 86400     # a month: drivers and libraries change under a key that does not
MAX_BYTES = 1 << 20        # a remembered table is a few kB; anything larger is not one
MAX_ROWS = 2000
ENV_DIR = "CONSENSUS_SPEC_STEP_COSTS_DIR"


def default_dir() -> str:
    """``$CONSENSUS_SPEC_STEP_COSTS_DIR``, else ``$XDG_CACHE_HOME`` (or
    ``~/.cache``) ``/consensus_spec/step_costs``."""
    if os.environ.get(ENV_DIR):
        return os.environ[ENV_DIR]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "consensus_spec", "step_costs")


def path_for(key: dict, directory: str) -> str:
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    model = re.sub(r"[^A-Za-z0-9._-]+", "_", os.path.basename(str(key.get("model", ""))))[:40]
    return os.path.join(directory, f"{model or 'engine'}-{digest}.json")


def save(path: str, key: dict, prior: StepCostModel, rows: list[dict],
         drafting_off_at: list[int] = ()) -> None:
    """Write atomically; raises OSError (the caller decides how loud)."""
    payload = {"format": FORMAT, "key": key, "saved_at": time.time(),
               "prior": [prior.weights_ms, prior.ms_per_token, prior.attention_ms_per_row,
                         prior.sharpness],
               "rows": rows, "drafting_off_at_rows": sorted(int(b) for b in drafting_off_at)}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(payload, f, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load(path: str, key: dict, now: float | None = None) -> tuple[dict | None, str | None]:
    """(table, None) for a usable file; (None, None) where there is none;
    (None, why) for one that is corrupt or stale. A table is
    ``{"prior": StepCostModel, "rows": [...], "drafting_off_at_rows": [...], "saved_at"}``."""
    try:
        if os.path.getsize(path) > MAX_BYTES:
            return None, f"larger than {MAX_BYTES} bytes"
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (FileNotFoundError, NotADirectoryError):  # nothing remembered there
        return None, None
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return None, f"unreadable ({type(e).__name__}: {e})"
    try:
        return _check(data, key, time.time() if now is None else now), None
    except (KeyError, TypeError, ValueError) as e:
        return None, str(e) or type(e).__name__


def _finite(x, low: float = 0.0) -> float:
    x = float(x)
    if not (math.isfinite(x) and x >= low):
        raise ValueError(f"bad number {x!r}")
    return x


def _check(data, key: dict, now: float) -> dict:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"not a format-{FORMAT} step-cost file")
    if data.get("key") != key:
        raise ValueError(f"written for another engine ({data.get('key')!r})")
    saved = _finite(data["saved_at"])
    if now - saved > MAX_AGE_S:
        raise ValueError(f"stale: saved {(now - saved) / 86400:.0f} days ago")
    if saved - now > 86400:
        raise ValueError("saved in the future")
    prior = [_finite(x) for x in data["prior"]]
    if len(prior) != 4 or prior[0] <= 0 or prior[1] <= 0 or not 1.0 <= prior[3] <= 16.0:
        raise ValueError(f"bad prior {prior!r}")
    rows = data["rows"]
    if not isinstance(rows, list) or not 0 < len(rows) <= MAX_ROWS:
        raise ValueError("no rows")
    clean = []
    for r in rows:
        row = {"B": int(r["B"]), "q": _finite(r["q"], 1.0), "ms": _finite(r["ms"]),
               "noise": _finite(r.get("noise", 0.0)), "drafter_ms": _finite(r.get("drafter_ms", 0.0))}
        if row["B"] < 1 or row["ms"] <= 0 or row["noise"] >= 1.0:
            raise ValueError(f"bad row {r!r}")
        clean.append(row)
    off = [int(b) for b in data.get("drafting_off_at_rows", [])]
    return {"prior": StepCostModel(*prior), "rows": clean, "drafting_off_at_rows": off,
            "saved_at": saved}
