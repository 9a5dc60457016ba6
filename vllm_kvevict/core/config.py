"""Eviction settings: one frozen value, parsed and validated once, vLLM-free.

The same keys serve both front doors:
  CLI      `vllm serve M --kv-eviction h2o --kv-budget 256 --kv-recent 64`
  offline  `LLM(M, additional_config={"kv_eviction": "h2o", "kv_budget": 256})`
Every error names the flag, so a bad value fails at startup, never mid-request.
One file because it is the one place every --kv-* setting is parsed and checked
(the server's and a request's), so no rule exists twice.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import asdict, dataclass, replace
from typing import Any

from vllm_kvevict.core.policies import POLICIES as POLICY_CLASSES
from vllm_kvevict.core.policies import EvictionPolicy

POLICIES = ("none", *POLICY_CLASSES)  # --kv-eviction choices
VICTIMS = ("counter", "lru", "fifo")  # host-pool victim policies (host_pool.py)
DEFAULT_SWAP_SPACE = 4 << 30  # host pool bytes under infinigen when not given

# key in additional_config -> CLI flag, for error messages and the CLI layer.
FLAGS = {
    "kv_eviction": "--kv-eviction",
    "kv_budget": "--kv-budget",
    "kv_recent": "--kv-recent",
    "kv_sink": "--kv-sink",
    "kv_window": "--kv-window",
    "kv_prefill_cap": "--kv-prefill-cap",
    "kv_swap_space": "--kv-swap-space",
    "kv_alpha": "--kv-alpha",
    "kv_attend_cap": "--kv-attend-cap",
    "kv_partial": "--kv-partial",
    "kv_host_victim": "--kv-host-victim",
    "kv_skewing": "--kv-skewing",
    "kv_max_schemas": "--kv-max-schemas",  # ModuleLimits: the prompt-module schema routes
    "kv_max_pinned": "--kv-max-pinned",
    "kv_max_pml_bytes": "--kv-max-pml-bytes",
    "kv_max_modules": "--kv-max-modules",
}


# Keys a single request may set (SamplingParams.extra_args; `vllm_xargs` in the
# OpenAI API). The policy is a server setting: it decides which score buffers
# every worker keeps.
REQUEST_KEYS = ("kv_budget", "kv_recent", "kv_prefill_cap")


class EvictionConfigError(ValueError):
    """A setting that cannot work; the message names the flag."""


def _flag(key: str) -> str:
    return f"{FLAGS[key]} (additional_config['{key}'])"


MAX_COUNT = 1 << 40  # no token count or size above this is a setting; parse no more digits


def _digits(text: str) -> int | None:
    """`text` as a count when it is plain ASCII digits, else None. Never raises:
    "²".isdigit() is True and int("²") raises, and int() of thousands of
    digits raises too (both came in client requests)."""
    text = text.strip()
    if text.isascii() and text.isdigit() and len(text) <= 15:
        return int(text)
    return None


def _number(key: str, value: Any) -> int | float:
    """An int (tokens) or a float in (0, 1] (fraction of the sequence)."""
    if isinstance(value, bool):
        raise EvictionConfigError(f"{_flag(key)} must be a number, got {value!r}")
    if isinstance(value, str):
        text = value.strip().rstrip("%")
        count = _digits(text[1:] if text[:1] in ("+", "-") else text)
        if count is not None and text.startswith("-"):
            count = -count
        try:
            value = float(text) / 100 if value.strip().endswith("%") else (
                count if count is not None else float(text))
        except (ValueError, OverflowError):
            raise EvictionConfigError(
                f"{_flag(key)} must be a token count (256) or a fraction (0.2), "
                f"got {value!r}") from None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer() and value > 1:
        value = int(value)
    if (not isinstance(value, (int, float))
            or isinstance(value, float) and not math.isfinite(value)):
        raise EvictionConfigError(f"{_flag(key)} must be a number, got {value!r}")
    if value <= 0:
        raise EvictionConfigError(f"{_flag(key)} must be > 0, got {value!r}")
    if isinstance(value, float) and value > 1:
        raise EvictionConfigError(
            f"{_flag(key)}: a fraction must be in (0, 1], got {value!r}")
    if value > MAX_COUNT:
        raise EvictionConfigError(f"{_flag(key)} must be at most {MAX_COUNT}, got {value!r}")
    return value


@dataclass(frozen=True)
class ModuleLimits:
    """What clients may pin through the prompt-module schema routes
    (integration/server_routes.py; offline `register_schema` is not limited).

    max_schemas: schemas registered at once in one API server process (each
                 has its own registry); 0 turns registration off.
    max_pinned:  share of the engine's KV block pool that module blocks may
                 hold, in (0, 1]; the rest stays free for requests.
    max_pml_bytes: largest PML text (a schema route's body, a prompt's
                 <prompt> element), in UTF-8 bytes, checked before parsing.
    max_modules: most elements (<module>, <union>, <param>) in one schema, and
                 most module imports in one prompt, checked while parsing.
    """

    max_schemas: int = 64
    max_pinned: float = 0.5
    max_pml_bytes: int = 1 << 20
    max_modules: int = 512



def _count(raw: dict[str, Any], key: str, default: int, least: int, what: str) -> int:
    """An integer setting >= least: an int, or a string of plain digits."""
    value = raw.get(key, default)
    if isinstance(value, str) and _digits(value) is not None:
        value = _digits(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise EvictionConfigError(f"{_flag(key)} must be {what} >= {least}, got {value!r}")
    return value


def _module_limits(raw: dict[str, Any]) -> ModuleLimits:
    """Parse `kv_max_schemas` / `kv_max_pinned` of `additional_config`."""
    count = _count(raw, "kv_max_schemas", ModuleLimits.max_schemas, 0, "a schema count")
    share = raw.get("kv_max_pinned", ModuleLimits.max_pinned)
    try:
        share = _number("kv_max_pinned", share)
        if share > 1:  # _number reads 2 as a token count
            raise EvictionConfigError
    except EvictionConfigError:
        raise EvictionConfigError(
            f"{_flag('kv_max_pinned')} must be a share of the KV pool in (0, 1] "
            f"(0.5 or 50%), got {share!r}") from None
    size = raw.get("kv_max_pml_bytes", ModuleLimits.max_pml_bytes)
    size = parse_bytes("kv_max_pml_bytes", size)
    modules = _count(raw, "kv_max_modules", ModuleLimits.max_modules, 1, "an element count")
    return ModuleLimits(max_schemas=count, max_pinned=float(share), max_pml_bytes=size,
                        max_modules=modules)


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

    Offload (InfiniGen): evicted KV goes to a host pool instead of being
    dropped, and each decode step fetches back the entries its query is
    predicted to need. On with policy "infinigen" (resident set: sinks + recent
    window) or with any other policy given a `swap_space` (that policy then
    chooses what stays resident).
    swap_space: host pool bytes per worker (None: 4 GiB under infinigen, else
             no offload).
    alpha:   fetch host entries whose partial logit is above max - alpha.
    attend_cap: cap on the tokens attended per step, as a fraction of the
             request's length (the paper's 20 %).
    partial: fraction of the head dimension in the partial query/key (30 %).
    host_victim: "counter" (the paper), "lru" or "fifo".
    limits:  what clients may pin through the prompt-module schema routes.
    skewing: the skewing file (absolute path); None: the one
             `python -m vllm_kvevict.calibrate MODEL` wrote to its cache.
    prefill_cap: resident tokens a request may hold while its prompt is
             prefilled in chunks before it compacts between chunks. None
             (default): the prompt stays whole while the pool can hold its
             next chunk, and is compacted once, after its last chunk, with
             every prompt query (the question too) scored; 0: compact before
             every chunk (before the question was read).
    """

    policy: str = "none"
    budget: int | float = 1024
    recent: int | float | None = None
    sink: int = 4
    window: int = 32
    swap_space: int | None = None
    alpha: float = 4.0
    attend_cap: float = 0.2
    partial: float = 0.3
    host_victim: str = "counter"
    skewing: str | None = None
    prefill_cap: int | None = None
    limits: ModuleLimits = ModuleLimits()  # what clients may pin (prompt modules)

    @property
    def enabled(self) -> bool:
        return self.policy != "none"

    @property
    def offload(self) -> bool:
        """Evicted KV goes to the host pool (InfiniGen) instead of being dropped."""
        return self.policy == "infinigen" or bool(self.swap_space)

    @property
    def swap_bytes(self) -> int:
        return self.swap_space or (DEFAULT_SWAP_SPACE if self.offload else 0)

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> "EvictionConfig":
        """Parse the `kv_*` keys of `additional_config`; other keys are ignored."""
        if raw is not None and not isinstance(raw, dict):
            raise EvictionConfigError(
                f"--additional-config must be a JSON object such as "
                f"'{{\"kv_eviction\": \"h2o\"}}', got {raw!r}")
        raw = dict(raw or {})
        unknown = sorted(k for k in raw if k.startswith("kv_") and k not in FLAGS)
        if unknown:
            renamed = {"kv_prefetch": "kv_attend_cap (--kv-attend-cap)"}
            hints = "".join(f"; {k} is now {renamed[k]}" for k in unknown if k in renamed)
            raise EvictionConfigError(
                f"additional_config: unknown setting(s) {', '.join(unknown)}{hints}; "
                f"known: {', '.join(FLAGS)}")
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
        cfg = cls(policy=policy, budget=budget, recent=recent, sink=sink, window=window,
                  prefill_cap=_prefill_cap(raw.get("kv_prefill_cap")),
                  limits=_module_limits(raw), **_offload_settings(raw))
        cfg._check()
        return cfg

    def _check(self) -> None:
        """The rules between settings (each one alone is checked as it is parsed)."""
        budget, recent = self.budget, self.recent
        if recent is not None:
            if isinstance(recent, int) != isinstance(budget, int):
                raise EvictionConfigError(
                    f"{_flag('kv_recent')} must use the same unit as --kv-budget "
                    f"(both token counts or both fractions), got {recent!r} and {budget!r}")
            if recent > budget:
                raise EvictionConfigError(
                    f"{_flag('kv_recent')} ({recent}) must not exceed --kv-budget ({budget})")
        if self.policy == "streaming" and isinstance(budget, int) and self.sink >= budget:
            raise EvictionConfigError(
                f"{_flag('kv_sink')} ({self.sink}) must be smaller than --kv-budget ({budget})")
        if self.swap_space and self.policy == "none":
            raise EvictionConfigError(
                f"{_flag('kv_swap_space')} needs an eviction policy: it holds what "
                f"--kv-eviction evicts (try --kv-eviction infinigen)")
        if self.skewing and not self.offload:
            raise EvictionConfigError(
                f"{_flag('kv_skewing')} is for KV offload: add --kv-eviction infinigen "
                f"or --kv-swap-space")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        out = {"kv_eviction": d["policy"], "kv_budget": d["budget"],
               "kv_recent": d["recent"], "kv_sink": d["sink"], "kv_window": d["window"]}
        if self.offload:  # keep the old keys (and spec hashes) for the other policies
            # With its unit: a bare number is GiB (parse_bytes).
            out.update(kv_swap_space=f"{self.swap_bytes}B", kv_alpha=self.alpha,
                       kv_attend_cap=self.attend_cap, kv_partial=self.partial,
                       kv_host_victim=self.host_victim)
            if self.skewing:
                out["kv_skewing"] = self.skewing
        if self.prefill_cap is not None:  # only when set: the default keeps spec hashes
            out["kv_prefill_cap"] = self.prefill_cap
        if self.limits != ModuleLimits():
            out.update(kv_max_schemas=self.limits.max_schemas,
                       kv_max_pinned=self.limits.max_pinned,
                       kv_max_pml_bytes=self.limits.max_pml_bytes,
                       kv_max_modules=self.limits.max_modules)
        return out

    def check_block_size(self, block_size: int) -> None:
        """Refuse budgets that cannot hold one whole block (known only at startup)."""
        if self.enabled and isinstance(self.budget, int) and self.budget < block_size:
            raise EvictionConfigError(
                f"{_flag('kv_budget')} ({self.budget}) is below one KV block "
                f"({block_size} tokens); raise it or lower --block-size")

    def for_request(self, extra_args: dict[str, Any] | None, block_size: int) -> "EvictionConfig":
        """This config with a request's own `kv_budget` / `kv_recent` applied.

        A request may ask for less cache than the server would keep, never
        more: the pool was sized (`max_memory_usage_bytes`) for the server's
        budget, and a client must not get around an operator's ratio. So a
        request's `kv_budget`, against the server's --kv-budget, is:
          server tokens B,     request tokens b:     b <= B.
          server fraction F,   request fraction f:   f <= F.
          server tokens B,     request fraction f:   refused: f of a long
                               enough request is more than B (the bound would
                               hang on max_model_len, which the scheduler side
                               does not see; both sides must agree).
          server fraction F,   request tokens b:     only if b is never more
                               than the server keeps at any length L, i.e.
                               min(L, b) <= min(L, budget_tokens(L)) for all L,
                               which holds iff budget_tokens(b) >= b (one
                               block, or F close enough to 1); else refused.
        `kv_recent` has no bound against the server's: the window lives inside
        the request's own budget (it decides which tokens stay, not how many),
        so it must use that budget's unit and not exceed it (from_dict).
        Raises EvictionConfigError naming the field, the value asked and the
        server's --kv-budget; nothing changes.
        """
        asked = {k: v for k, v in (extra_args or {}).items()
                 if isinstance(k, str) and k.startswith("kv_")}
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
        changes: dict[str, Any] = {}
        try:
            if "kv_budget" in asked:
                changes["budget"] = _number("kv_budget", asked["kv_budget"])
                changes["recent"] = None  # the server's window was sized for its own budget
            if asked.get("kv_recent") is not None:
                changes["recent"] = _number("kv_recent", asked["kv_recent"])
            elif "kv_recent" in asked:
                changes["recent"] = None
            if "kv_prefill_cap" in asked:
                changes["prefill_cap"] = _prefill_cap(asked["kv_prefill_cap"])
            cfg = replace(self, **changes)
            cfg._check()
        except (ValueError, TypeError, ArithmeticError) as e:  # EvictionConfigError too
            if not isinstance(e, EvictionConfigError):  # a parser bug must still be a 400
                e = EvictionConfigError(f"malformed value in {sorted(asked)}: {e}")
            # Name the request's field, not the server flag the parser names.
            msg = re.sub(r"--kv-[a-z]+ \(additional_config\['(kv_\w+)'\]\)", r"\1", str(e))
            raise EvictionConfigError(f"{where}: {msg}") from None
        if isinstance(cfg.budget, int) and cfg.budget < block_size:
            raise EvictionConfigError(
                f"{where}: kv_budget ({cfg.budget}) is below one KV block ({block_size} tokens)")
        if "kv_budget" in asked:
            self._check_request_budget(cfg.budget, asked["kv_budget"], where, block_size)
        if self.prefill_cap is not None and (cfg.prefill_cap is None
                                             or cfg.prefill_cap > self.prefill_cap):
            raise EvictionConfigError(
                f"{where}: kv_prefill_cap {asked.get('kv_prefill_cap')!r} holds more of the "
                f"prompt than the server's --kv-prefill-cap {self.prefill_cap}; ask for at most that")
        return cfg

    def _check_request_budget(self, got: int | float, raw: Any, where: str,
                              block_size: int) -> None:
        """Refuse a request budget `got` (parsed from `raw`) that could keep more
        tokens than the server's budget at some length (rules in for_request)."""
        server, asked = self.budget, f"kv_budget {raw!r}"
        if isinstance(server, int):
            tokens = f"ask for a token count between {block_size} and {server}"
            if not isinstance(got, int):
                raise EvictionConfigError(
                    f"{where}: {asked} is a fraction of the request's length, but the "
                    f"server's --kv-budget {server!r} is a token count: a long enough "
                    f"request would keep more than {server} tokens; {tokens}")
            if got > server:
                raise EvictionConfigError(
                    f"{where}: {asked} asks for more KV than the server's --kv-budget "
                    f"{server!r}; {tokens}")
            return
        fraction = f"ask for a fraction at most {server!r}"
        if not isinstance(got, int):
            if got > server:
                raise EvictionConfigError(
                    f"{where}: {asked} asks for more KV than the server's --kv-budget "
                    f"{server!r} (a fraction of each request's length); {fraction}")
            return
        # budget_tokens is nondecreasing in the length: the server keeps at least
        # min(L, b) at every length L iff it keeps all b tokens at length b.
        if self.budget_tokens(got, block_size) < got:
            raise EvictionConfigError(
                f"{where}: {asked} is a token count, but the server's --kv-budget "
                f"{server!r} is a fraction of each request's length: {got} tokens is more "
                f"than the server keeps of a request up to {math.floor((got - 1) / server)} "
                f"tokens long; {fraction}")

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
            # H2O splits the budget evenly; snapkv/andpro keep their observation
            # window (as the papers do) while it is at most half the budget.
            return POLICY_CLASSES.get(self.policy, EvictionPolicy).default_recent(
                budget, self.window)
        if isinstance(self.recent, int):
            return min(self.recent, budget)
        return min(budget, math.ceil(self.recent * length))

    def recent_in_force(self) -> str:
        """The recent window the policy keeps under these settings, --kv-recent
        given or not (the info gauge on /metrics)."""
        return POLICY_CLASSES.get(self.policy, EvictionPolicy).recent_in_force(
            self.budget, self.recent, self.sink, self.window)


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20,
          "mb": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30,
          "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}


def parse_bytes(key: str, value: Any, bare: str = "b") -> int:
    """`8GiB`, `512MiB`, `1.5g`, `4096B` -> bytes (binary units). A number
    without a unit counts in `bare`: bytes by default; "g" for --kv-swap-space,
    whose bare number is GiB as in vLLM's --swap-space (4 -> 4 GiB, 0.25 -> 256 MiB)."""
    forms = (f"a number of GiB as in vLLM's --swap-space (4, 0.25) or a size with a unit "
             f"(512MiB, 8GiB, 1073741824B)" if bare == "g" else
             "a size such as 8GiB, 512MiB or a byte count")
    if isinstance(value, bool):
        raise EvictionConfigError(f"{_flag(key)} must be {forms}, got {value!r}")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if m is None or m.group(2).lower() not in _UNITS:
            raise EvictionConfigError(f"{_flag(key)} must be {forms}, got {value!r}")
        number, unit = float(m.group(1)), m.group(2).lower()
    scale = _UNITS[unit or bare]
    size = int(number * scale) if math.isfinite(number * scale) else 0
    if size <= 0:
        raise EvictionConfigError(
            f"{_flag(key)} must be > 0 bytes ({forms}), got {value!r}")
    return size


def _prefill_cap(cap: Any) -> int | None:
    """--kv-prefill-cap: a token count >= 0, or None / 'auto' (the default)."""
    given = cap
    if isinstance(cap, str):
        text = cap.strip().lower()
        cap = None if text in ("", "none", "auto") else _digits(text) if _digits(text) is not None \
            else cap
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0
                            or cap > MAX_COUNT):
        raise EvictionConfigError(
            f"{_flag('kv_prefill_cap')} must be a token count >= 0 or 'auto', got {given!r}")
    return cap


def _offload_settings(raw: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if raw.get("kv_swap_space") is not None:
        out["swap_space"] = parse_bytes("kv_swap_space", raw["kv_swap_space"], bare="g")
    for key, lo, hi in (("kv_alpha", 0.0, math.inf), ("kv_attend_cap", 0.0, 1.0),
                        ("kv_partial", 0.0, 1.0)):
        if raw.get(key) is None:
            continue
        try:
            value = float(raw[key])
        except (TypeError, ValueError):
            raise EvictionConfigError(f"{_flag(key)} must be a number, got {raw[key]!r}") from None
        if isinstance(raw[key], bool) or not (lo < value <= hi) or math.isnan(value):
            raise EvictionConfigError(
                f"{_flag(key)} must be in ({lo:g}, {hi:g}], got {raw[key]!r}")
        out[key.removeprefix("kv_")] = value
    victim = raw.get("kv_host_victim")
    if victim is not None:
        victim = str(victim).strip().lower()
        if victim not in VICTIMS:
            raise EvictionConfigError(
                f"{_flag('kv_host_victim')}: unknown victim policy {raw['kv_host_victim']!r}; "
                f"choose one of {', '.join(VICTIMS)}")
        out["host_victim"] = victim
    if raw.get("kv_skewing") not in (None, ""):
        # Absolute: workers may run with another working directory.
        out["skewing"] = os.path.abspath(os.path.expanduser(str(raw["kv_skewing"])))
    return out
