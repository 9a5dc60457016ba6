"""Eviction settings: one frozen value, parsed and validated once, vLLM-free.

The same keys serve both front doors:
  CLI      `vllm serve M --kv-eviction h2o --kv-budget 256 --kv-recent 64`
  offline  `LLM(M, additional_config={"kv_eviction": "h2o", "kv_budget": 256})`
Every error names the flag, so a bad value fails at startup, never mid-request.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any

POLICIES = ("none", "h2o", "streaming", "snapkv", "andpro")
WINDOW_POLICIES = ("snapkv", "andpro")  # scored by their last `window` queries

# key in additional_config -> CLI flag, for error messages and the CLI layer.
FLAGS = {
    "kv_eviction": "--kv-eviction",
    "kv_budget": "--kv-budget",
    "kv_recent": "--kv-recent",
    "kv_sink": "--kv-sink",
    "kv_window": "--kv-window",
}


# Keys a single request may set (SamplingParams.extra_args; `vllm_xargs` in the
# OpenAI API). The policy is a server setting: it decides which score buffers
# every worker keeps.
REQUEST_KEYS = ("kv_budget", "kv_recent")


class EvictionConfigError(ValueError):
    """A setting that cannot work; the message names the flag."""


def _flag(key: str) -> str:
    return f"{FLAGS[key]} (additional_config['{key}'])"


def _number(key: str, value: Any) -> int | float:
    """An int (tokens) or a float in (0, 1] (fraction of the sequence)."""
    if isinstance(value, bool):
        raise EvictionConfigError(f"{_flag(key)} must be a number, got {value!r}")
    if isinstance(value, str):
        text = value.strip().rstrip("%")
        try:
            value = float(text) / 100 if value.strip().endswith("%") else (
                int(text) if text.lstrip("+-").isdigit() else float(text))
        except ValueError:
            raise EvictionConfigError(
                f"{_flag(key)} must be a token count (256) or a fraction (0.2), "
                f"got {value!r}") from None
    if isinstance(value, float) and value.is_integer() and value > 1:
        value = int(value)
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise EvictionConfigError(f"{_flag(key)} must be a number, got {value!r}")
    if value <= 0:
        raise EvictionConfigError(f"{_flag(key)} must be > 0, got {value!r}")
    if isinstance(value, float) and value > 1:
        raise EvictionConfigError(
            f"{_flag(key)}: a fraction must be in (0, 1], got {value!r}")
    return value


@dataclass(frozen=True)
class EvictionConfig:
    """What to keep per request.

    policy:  "none" | "h2o" (heavy hitters + recent window) | "streaming"
             (attention sinks + recent window, the control) | "snapkv" |
             "andpro" (scored by the attention / value projection of the last
             `window` queries at each compaction).
    budget:  resident tokens per request: an int (tokens) or a float in (0, 1]
             (fraction of the request's current length, as in H2O's ratios).
    recent:  the recent window inside the budget, same units as `budget`;
             default half the budget (H2O's equal heavy/recent split); for
             snapkv/andpro the observation window, at most half the budget.
    sink:    tokens always kept at the start (streaming only).
    window:  observation window of snapkv/andpro, in tokens (the papers' 32).
    """

    policy: str = "none"
    budget: int | float = 1024
    recent: int | float | None = None
    sink: int = 4
    window: int = 32

    @property
    def enabled(self) -> bool:
        return self.policy != "none"

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> "EvictionConfig":
        """Parse the `kv_*` keys of `additional_config`; other keys are ignored."""
        if raw is not None and not isinstance(raw, dict):
            raise EvictionConfigError(
                f"--additional-config must be a JSON object such as "
                f"'{{\"kv_eviction\": \"h2o\"}}', got {raw!r}")
        raw = dict(raw or {})
        policy = str(raw.get("kv_eviction") or "none").strip().lower()
        if policy not in POLICIES:
            raise EvictionConfigError(
                f"{_flag('kv_eviction')}: unknown policy {raw.get('kv_eviction')!r}; "
                f"choose one of {', '.join(POLICIES)}")
        budget = _number("kv_budget", raw.get("kv_budget", cls.budget))
        recent = raw.get("kv_recent")
        recent = None if recent is None else _number("kv_recent", recent)
        sink = _number("kv_sink", raw.get("kv_sink", cls.sink))
        if not isinstance(sink, int):
            raise EvictionConfigError(f"{_flag('kv_sink')} must be a token count")
        window = _number("kv_window", raw.get("kv_window", cls.window))
        if not isinstance(window, int):
            raise EvictionConfigError(f"{_flag('kv_window')} must be a token count")
        if recent is not None:
            if isinstance(recent, int) != isinstance(budget, int):
                raise EvictionConfigError(
                    f"{_flag('kv_recent')} must use the same unit as --kv-budget "
                    f"(both token counts or both fractions), got {recent!r} and {budget!r}")
            if recent > budget:
                raise EvictionConfigError(
                    f"{_flag('kv_recent')} ({recent}) must not exceed --kv-budget ({budget})")
        if policy == "streaming" and isinstance(budget, int) and sink >= budget:
            raise EvictionConfigError(
                f"{_flag('kv_sink')} ({sink}) must be smaller than --kv-budget ({budget})")
        return cls(policy=policy, budget=budget, recent=recent, sink=sink, window=window)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        return {"kv_eviction": d["policy"], "kv_budget": d["budget"],
                "kv_recent": d["recent"], "kv_sink": d["sink"], "kv_window": d["window"]}

    def check_block_size(self, block_size: int) -> None:
        """Refuse budgets that cannot hold one whole block (known only at startup)."""
        if self.enabled and isinstance(self.budget, int) and self.budget < block_size:
            raise EvictionConfigError(
                f"{_flag('kv_budget')} ({self.budget}) is below one KV block "
                f"({block_size} tokens); raise it or lower --block-size")

    def for_request(self, extra_args: dict[str, Any] | None, block_size: int) -> "EvictionConfig":
        """This config with a request's own `kv_budget` / `kv_recent` applied.

        A request may ask for less cache than the server's token budget, never
        more: the pool was sized (`max_memory_usage_bytes`) for the server's
        budget. Raises EvictionConfigError naming the field; nothing changes.
        """
        asked = {k: v for k, v in (extra_args or {}).items() if k.startswith("kv_")}
        if not asked:
            return self
        where = "request field vllm_xargs (SamplingParams.extra_args)"
        unknown = sorted(set(asked) - set(REQUEST_KEYS))
        if unknown:
            raise EvictionConfigError(
                f"{where}: {', '.join(unknown)} cannot be set per request; "
                f"allowed: {', '.join(REQUEST_KEYS)} (the policy is a server setting)")
        if not self.enabled:
            raise EvictionConfigError(
                f"{where}: {', '.join(sorted(asked))} given, but KV eviction is off on "
                f"this server (start it with --kv-eviction)")
        merged = self.to_dict()
        merged.update(asked)
        if "kv_budget" in asked and "kv_recent" not in asked:
            merged["kv_recent"] = None  # the server's window was sized for its own budget
        try:
            cfg = EvictionConfig.from_dict(merged)
        except EvictionConfigError as e:
            # Name the request's field, not the server flag the parser names.
            msg = re.sub(r"--kv-[a-z]+ \(additional_config\['(kv_\w+)'\]\)", r"\1", str(e))
            raise EvictionConfigError(f"{where}: {msg}") from None
        if isinstance(cfg.budget, int) and cfg.budget < block_size:
            raise EvictionConfigError(
                f"{where}: kv_budget ({cfg.budget}) is below one KV block ({block_size} tokens)")
        if isinstance(self.budget, int) and not (
                isinstance(cfg.budget, int) and cfg.budget <= self.budget):
            raise EvictionConfigError(
                f"{where}: kv_budget must be a token count between {block_size} and the "
                f"server's --kv-budget ({self.budget}), got {asked.get('kv_budget')!r}")
        return cfg

    # --- per-request arithmetic (tokens), used by scheduler and worker alike ---

    def budget_tokens(self, length: int, block_size: int) -> int:
        """Resident tokens allowed for a request of logical `length`."""
        if isinstance(self.budget, int):
            return self.budget
        # A fraction never goes below one block: evicting inside one block frees nothing.
        return max(block_size, math.ceil(self.budget * length))

    def recent_tokens(self, budget: int, length: int) -> int:
        """Size of the always-kept recent window for a given budget."""
        if self.recent is None:
            # snapkv/andpro keep their observation window (as the papers do)
            # while it is at most half the budget; H2O splits the budget evenly.
            if self.policy in WINDOW_POLICIES:
                return min(self.window, budget // 2)
            return budget // 2
        if isinstance(self.recent, int):
            return min(self.recent, budget)
        return min(budget, math.ceil(self.recent * length))
