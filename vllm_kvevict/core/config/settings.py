"""Eviction settings: one frozen value, parsed and validated once, vLLM-free.

The same keys serve both front doors:
  CLI      `vllm serve M --kv-eviction h2o --kv-budget 256 --kv-recent 64`
  offline  `LLM(M, additional_config={"kv_eviction": "h2o", "kv_budget": 256})`
What each setting means, its flag, default and parser: core/config/flags.py, the one
table. Here: the values it fills, one per subsystem (EvictionConfig with its
OffloadSettings and ModuleLimits), and the rules between settings. Every
error names the flag, so a bad value fails at startup, never mid-request.
One file because it is the one place every --kv-* setting is checked (the
server's and a request's), so no rule exists twice.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any

from vllm_kvevict.core.config.flags import (  # noqa: F401  (MAX_COUNT..VICTIMS: re-exported)
    FLAGS,
    MAX_COUNT,
    POLICIES,
    REQUEST_KEYS,
    VICTIMS,
    EvictionConfigError,
    default,
    flag_name,
    group,
    parse_bytes,
    parse_number,
    parse_prefill_cap,
    policy_label,
    resolve_alias,
)
from vllm_kvevict.core.policies import POLICIES as POLICY_CLASSES
from vllm_kvevict.core.policies import EvictionPolicy, PolicySettingError

DEFAULT_SWAP_SPACE = 4 << 30  # host pool bytes with offload on, when not given


@dataclass(frozen=True)
class ModuleLimits:
    """What clients may pin and send through the prompt-module schema routes
    (integration/server_routes.py; offline `register_schema` is not limited):
    the `modules` group of core/config/flags.py (--kv-max-schemas, --kv-max-pinned,
    --kv-max-pml-bytes, --kv-max-modules)."""

    max_schemas: int = default("kv_max_schemas")
    max_pinned: float = default("kv_max_pinned")
    max_pml_bytes: int = default("kv_max_pml_bytes")
    max_modules: int = default("kv_max_modules")


@dataclass(frozen=True)
class OffloadSettings:
    """InfiniGen offload's settings: the `offload` group of core/config/flags.py.
    Offload is on with `enabled` (--kv-offload, or --kv-eviction infinigen) or
    a `swap_space` (EvictionConfig.offload)."""

    enabled: bool = default("kv_offload")
    swap_space: int | None = default("kv_swap_space")  # bytes; None: see swap_bytes
    alpha: float = default("kv_alpha")
    attend_cap: float = default("kv_attend_cap")
    partial: float = default("kv_partial")
    host_victim: str = default("kv_host_victim")
    skewing: str | None = default("kv_skewing")  # absolute path; None: calibrate's cache


def _parsed(raw: dict[str, Any], name: str) -> dict[str, Any]:
    """The settings of one group of core/config/flags.py, parsed, by config field."""
    return {f.field: f.read(raw) for f in group(name)}


@dataclass(frozen=True)
class EvictionConfig:
    """What to keep per request: the `eviction` group of core/config/flags.py (policy
    is --kv-eviction; budget, recent, sink, window and prefill_cap are the
    flags of the same name), with offload's settings in `host` and the
    prompt-module limits in `limits`.

    budget and recent are an int (tokens) or a float in (0, 1] (a fraction of
    the request's current length, as in H2O's ratios); recent None: the
    policy's own default (recent_tokens). prefill_cap None: `auto`.

    Offload (InfiniGen) is a mode, not a policy: evicted KV goes to a host
    pool instead of being dropped, and each decode step fetches back the
    entries its query is predicted to need; the policy still chooses what
    stays resident. On with --kv-offload or a --kv-swap-space;
    `--kv-eviction infinigen` is policy streaming with --kv-offload on
    (flags.ALIASES).
    """

    policy: str = default("kv_eviction")
    budget: int | float = default("kv_budget")
    recent: int | float | None = default("kv_recent")
    sink: int = default("kv_sink")
    window: int = default("kv_window")
    prefill_cap: int | None = default("kv_prefill_cap")
    host: OffloadSettings = OffloadSettings()  # offload (InfiniGen)
    limits: ModuleLimits = ModuleLimits()  # what clients may pin (prompt modules)

    @property
    def enabled(self) -> bool:
        return self.policy != "none"

    @property
    def offload(self) -> bool:
        """Evicted KV goes to the host pool (InfiniGen) instead of being dropped."""
        return self.host.enabled or bool(self.host.swap_space)

    @property
    def label(self) -> str:
        """The policy as --kv-eviction names it (`infinigen` for streaming with
        --kv-offload on): to_dict's kv_eviction, /metrics' policy label."""
        return policy_label(self.policy, self.host.enabled)

    def as_flags(self) -> str:
        """The flags that turned eviction (and offload) on, as a user writes them."""
        offload = self.host.enabled and self.label == self.policy
        return (f"--kv-eviction {self.label}" + (" --kv-offload on" if offload else "")
                + (" --kv-swap-space" if self.swap_space else ""))

    @property
    def swap_bytes(self) -> int:
        return self.host.swap_space or (DEFAULT_SWAP_SPACE if self.offload else 0)

    # The offload settings read through, as before they had a value of their own.
    swap_space = property(lambda self: self.host.swap_space)
    alpha = property(lambda self: self.host.alpha)
    attend_cap = property(lambda self: self.host.attend_cap)
    partial = property(lambda self: self.host.partial)
    host_victim = property(lambda self: self.host.host_victim)
    skewing = property(lambda self: self.host.skewing)

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> "EvictionConfig":
        """Parse the `kv_*` keys of `additional_config`; other keys are ignored."""
        if raw is not None and not isinstance(raw, dict):
            raise EvictionConfigError(
                f"--additional-config must be a JSON object such as "
                f"'{{\"kv_eviction\": \"h2o\"}}', got {raw!r}")
        raw = resolve_alias(dict(raw or {}))
        unknown = sorted(k for k in raw if k.startswith("kv_") and k not in FLAGS)
        if unknown:
            renamed = {"kv_prefetch": "kv_attend_cap (--kv-attend-cap)"}
            hints = "".join(f"; {k} is now {renamed[k]}" for k in unknown if k in renamed)
            raise EvictionConfigError(
                f"additional_config: unknown setting(s) {', '.join(unknown)}{hints}; "
                f"known: {', '.join(FLAGS)}")
        # Parsed in this order (eviction, modules, offload), so the first bad
        # value named is the same as before the table.
        eviction = _parsed(raw, "eviction")
        limits = ModuleLimits(**_parsed(raw, "modules"))
        cfg = cls(**eviction, host=OffloadSettings(**_parsed(raw, "offload")), limits=limits)
        cfg._check()
        return cfg

    def _check(self) -> None:
        """The rules between settings (each one alone is checked as it is parsed)."""
        budget, recent = self.budget, self.recent
        if recent is not None:
            if isinstance(recent, int) != isinstance(budget, int):
                raise EvictionConfigError(
                    f"{flag_name('kv_recent')} must use the same unit as --kv-budget "
                    f"(both token counts or both fractions), got {recent!r} and {budget!r}")
            if recent > budget:
                raise EvictionConfigError(
                    f"{flag_name('kv_recent')} ({recent}) must not exceed --kv-budget ({budget})")
        if self.enabled:
            try:
                POLICY_CLASSES[self.policy].check(budget, self.sink, self.window)
            except PolicySettingError as e:
                raise EvictionConfigError(f"{flag_name(e.key)} {e.text}") from None
        for key, given in (("kv_swap_space", self.host.swap_space),
                           ("kv_offload", self.host.enabled)):
            if given and not self.enabled:
                raise EvictionConfigError(
                    f"{flag_name(key)} needs an eviction policy: it holds what "
                    f"--kv-eviction evicts (try --kv-eviction infinigen)")
        if self.host.skewing and not self.offload:
            raise EvictionConfigError(
                f"{flag_name('kv_skewing')} is for KV offload: add --kv-offload on, "
                f"--kv-eviction infinigen or --kv-swap-space")

    def to_dict(self) -> dict[str, Any]:
        """The canonical `additional_config` form: from_dict(to_dict()) == self."""
        out = {f.key: getattr(self, f.field) for f in group("eviction")
               if f.key != "kv_prefill_cap"}
        out["kv_eviction"] = self.label  # infinigen (with kv_offload) reads back the same
        if self.offload:  # keep the old keys (and spec hashes) for the other policies
            out.update({f.key: getattr(self.host, f.field) for f in group("offload")
                        if f.key != "kv_skewing" or self.host.skewing})
            out["kv_swap_space"] = f"{self.swap_bytes}B"  # with its unit: bare is GiB
        if self.prefill_cap is not None:  # only when set: the default keeps spec hashes
            out["kv_prefill_cap"] = self.prefill_cap
        if self.limits != ModuleLimits():
            out.update({f.key: getattr(self.limits, f.field) for f in group("modules")})
        return out

    def check_block_size(self, block_size: int) -> None:
        """Refuse budgets that cannot hold one whole block (known only at startup)."""
        if self.enabled and isinstance(self.budget, int) and self.budget < block_size:
            raise EvictionConfigError(
                f"{flag_name('kv_budget')} ({self.budget}) is below one KV block "
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
                changes["budget"] = parse_number("kv_budget", asked["kv_budget"])
                changes["recent"] = None  # the server's window was sized for its own budget
            if asked.get("kv_recent") is not None:
                changes["recent"] = parse_number("kv_recent", asked["kv_recent"])
            elif "kv_recent" in asked:
                changes["recent"] = None
            if "kv_prefill_cap" in asked:
                changes["prefill_cap"] = parse_prefill_cap("kv_prefill_cap",
                                                           asked["kv_prefill_cap"])
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
        # A fraction never goes below two blocks: the cap then always leaves a
        # block of room (compaction_room), so a short request compacts once per
        # block, not every step, and holds 32-64 tokens at 32-token blocks.
        return max(2 * block_size, math.ceil(self.budget * length))

    @staticmethod
    def block_cap(budget: int, block_size: int) -> int:
        """Tokens the budget's blocks hold, ceil(budget / block_size) blocks of
        block_size: what a request may fill before it compacts. The budget caps
        blocks, not tokens: the slots of the budget's last block that a token
        cap would leave empty hold kept tokens instead, at the same memory."""
        return -(-budget // block_size) * block_size

    @classmethod
    def compaction_room(cls, budget: int, block_size: int) -> int:
        """How far below the block cap a compaction goes: one block, so that
        the block it leaves free holds the next block_size tokens and compaction
        runs once per block. A one-block cap leaves one token (a compaction
        every step)."""
        cap = cls.block_cap(budget, block_size)
        return block_size if cap >= 2 * block_size else 1

    def compaction_keep(self, budget: int, block_size: int) -> int:
        """Tokens a compaction under `budget` keeps: its block cap less the room,
        i.e. the whole blocks below the budget's last one (budget 101 at 32-token
        blocks: 96; budget 160: 128)."""
        return self.block_cap(budget, block_size) - self.compaction_room(budget, block_size)

    def recent_tokens(self, budget: int, length: int) -> int:
        """Size of the always-kept recent window when a compaction keeps `budget`
        tokens (plans carry it with the compaction's new length)."""
        if self.recent is None:
            # H2O splits the budget evenly; snapkv/andpro keep their observation
            # window (as the papers do) while it is at most half the budget.
            return POLICY_CLASSES.get(self.policy, EvictionPolicy).default_recent(
                budget, self.window)
        if isinstance(self.recent, int):
            return min(self.recent, budget)
        return min(budget, math.ceil(self.recent * length))

    def recent_in_force(self, block_size: int) -> str:
        """The recent window a compaction keeps under these settings, --kv-recent
        given or not (the info gauge on /metrics): under a token budget, what
        plans carry; under a fractional one, the fraction it is taken from."""
        kept = self.budget
        if isinstance(kept, int):
            kept = self.compaction_keep(kept, block_size)
        return POLICY_CLASSES.get(self.policy, EvictionPolicy).recent_in_force(
            kept, self.recent, self.sink, self.window)
