"""The --kv-* settings, declared once: key, flag, default, parser and help.

`TABLE` is the one list of the plugin's settings. Everything else reads it:
  - core/config/settings.py builds EvictionConfig from it (each value parsed by its
    flag's parser, in table order, a group at a time) and takes its defaults;
  - patches/engine_args.py adds one `vllm serve` flag per entry, with its help
    and default (`vllm serve --help=kv-`);
  - the flag tables in README.md, docs/offload.md and docs/prompt_modules.md
    are generated from it (`python -m vllm_kvevict.core.config.flags --markdown`), and
    tests/test_flags.py fails when a table there disagrees.
A key of `additional_config` is the flag's name with underscores
(`--kv-budget` <-> `kv_budget`). Every parser's error names the flag, so a bad
value stops startup, never a request. `ALIASES` are --kv-eviction names that
stand for a policy plus a mode (`infinigen`: streaming with offload on).
One file because it is the table and everything read off it (parsers, the
--help text, the docs' tables): a setting is added in one place.

    python -m vllm_kvevict.core.config.flags --markdown [GROUP ...]   # print the table
    python -m vllm_kvevict.core.config.flags --write FILE ...          # refresh marked tables
"""

from __future__ import annotations

import math
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable

from vllm_kvevict.core.policies import POLICIES as POLICY_CLASSES

# --kv-eviction names that stand for a policy with offload on (`EvictionConfig.offload`):
# InfiniGen keeps StreamingLLM's sinks + recent window resident and the rest on the host.
ALIASES: dict[str, tuple[str, bool]] = {"infinigen": ("streaming", True)}
POLICIES = ("none", *POLICY_CLASSES, *ALIASES)  # --kv-eviction choices
VICTIMS = ("counter", "lru", "fifo")  # host-pool victim policies (host_pool.py)
GROUPS = ("eviction", "offload", "modules")  # the config value each flag fills
MAX_COUNT = 1 << 40  # no token count or size above this is a setting; parse no more digits


class EvictionConfigError(ValueError):
    """A setting that cannot work; the message names the flag."""


def flag_name(key: str) -> str:
    """How an error names a setting: `--kv-budget (additional_config['kv_budget'])`."""
    return f"--{key.replace('_', '-')} (additional_config['{key}'])"


# --- value parsers: (key, value) -> parsed value, or EvictionConfigError -----


def _digits(text: str) -> int | None:
    """`text` as a count when it is plain ASCII digits, else None. Never raises:
    "²".isdigit() is True and int("²") raises, and int() of thousands of
    digits raises too (both came in client requests)."""
    text = text.strip()
    if text.isascii() and text.isdigit() and len(text) <= 15:
        return int(text)
    return None


def parse_number(key: str, value: Any) -> int | float:
    """An int (tokens) or a float in (0, 1] (fraction of the sequence)."""
    if isinstance(value, bool):
        raise EvictionConfigError(f"{flag_name(key)} must be a number, got {value!r}")
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
                f"{flag_name(key)} must be a token count (256) or a fraction (0.2), "
                f"got {value!r}") from None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer() and value > 1:
        value = int(value)
    if (not isinstance(value, (int, float))
            or isinstance(value, float) and not math.isfinite(value)):
        raise EvictionConfigError(f"{flag_name(key)} must be a number, got {value!r}")
    if value <= 0:
        raise EvictionConfigError(f"{flag_name(key)} must be > 0, got {value!r}")
    if isinstance(value, float) and value > 1:
        raise EvictionConfigError(
            f"{flag_name(key)}: a fraction must be in (0, 1], got {value!r}")
    if value > MAX_COUNT:
        raise EvictionConfigError(
            f"{flag_name(key)} must be at most {MAX_COUNT}, got {value!r}")
    return value


def _optional_number(key: str, value: Any) -> int | float | None:
    return None if value is None else parse_number(key, value)


def _tokens(key: str, value: Any) -> int:
    """A token count (a number that is not a fraction)."""
    count = parse_number(key, value)
    if not isinstance(count, int):
        raise EvictionConfigError(f"{flag_name(key)} must be a token count")
    return count


def _policy(key: str, value: Any) -> str:
    # The registry as it is now (a test may register a policy of its own).
    known = ("none", *POLICY_CLASSES, *ALIASES)
    policy = str(value or "none").strip().lower()
    if policy not in known:
        raise EvictionConfigError(
            f"{flag_name(key)}: unknown policy {value!r}; choose one of {', '.join(known)}")
    return policy


def resolve_alias(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` (additional_config) with an aliased --kv-eviction spelled out:
    `infinigen` is `streaming` with `kv_offload` on. Its kv_offload may be
    given only as on; other values are left to the parsers."""
    if raw.get("kv_eviction") is None:
        return raw
    name = _policy("kv_eviction", raw["kv_eviction"])
    if name not in ALIASES:
        return raw
    policy, offload = ALIASES[name]
    if raw.get("kv_offload") is not None and _switch("kv_offload", raw["kv_offload"]) != offload:
        raise EvictionConfigError(
            f"{flag_name('kv_offload')} {raw['kv_offload']!r} contradicts --kv-eviction {name} "
            f"({policy} with offload {'on' if offload else 'off'}); drop one of them")
    return {**raw, "kv_eviction": policy, "kv_offload": offload}


def policy_label(policy: str, offload: bool) -> str:
    """How --kv-eviction names a policy with offload on or off: the alias it
    spells out, else the policy (to_dict's form, /metrics' policy label)."""
    return next((name for name, meaning in ALIASES.items() if meaning == (policy, offload)),
                policy)


_SWITCH = {"1": True, "true": True, "on": True, "yes": True,
           "0": False, "false": False, "off": False, "no": False}


def _switch(key: str, value: Any) -> bool:
    """on / off (also true / false, yes / no, 1 / 0, or a JSON bool)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text not in _SWITCH:
        raise EvictionConfigError(f"{flag_name(key)} must be on or off, got {value!r}")
    return _SWITCH[text]


def parse_prefill_cap(key: str, cap: Any) -> int | None:
    """A token count >= 0, or None / 'auto' (the default)."""
    given = cap
    if isinstance(cap, str):
        text = cap.strip().lower()
        cap = None if text in ("", "none", "auto") else _digits(text) if _digits(text) is not None \
            else cap
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0
                            or cap > MAX_COUNT):
        raise EvictionConfigError(
            f"{flag_name(key)} must be a token count >= 0 or 'auto', got {given!r}")
    return cap


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
        raise EvictionConfigError(f"{flag_name(key)} must be {forms}, got {value!r}")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if m is None or m.group(2).lower() not in _UNITS:
            raise EvictionConfigError(f"{flag_name(key)} must be {forms}, got {value!r}")
        number, unit = float(m.group(1)), m.group(2).lower()
    scale = _UNITS[unit or bare]
    size = int(number * scale) if math.isfinite(number * scale) else 0
    if size <= 0:
        raise EvictionConfigError(
            f"{flag_name(key)} must be > 0 bytes ({forms}), got {value!r}")
    return size


def _swap_space(key: str, value: Any) -> int | None:
    return None if value is None else parse_bytes(key, value, bare="g")


def _in(lo: float, hi: float) -> Callable[[str, Any], float]:
    """A float in (lo, hi]."""
    def parse(key: str, value: Any) -> float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise EvictionConfigError(
                f"{flag_name(key)} must be a number, got {value!r}") from None
        if isinstance(value, bool) or not (lo < number <= hi) or math.isnan(number):
            raise EvictionConfigError(
                f"{flag_name(key)} must be in ({lo:g}, {hi:g}], got {value!r}")
        return number
    return parse


def _victim(key: str, value: Any) -> str:
    victim = str(value).strip().lower()
    if victim not in VICTIMS:
        raise EvictionConfigError(
            f"{flag_name(key)}: unknown victim policy {value!r}; "
            f"choose one of {', '.join(VICTIMS)}")
    return victim


def _path(key: str, value: Any) -> str | None:
    # Absolute: workers may run with another working directory.
    return None if value in (None, "") else os.path.abspath(os.path.expanduser(str(value)))


def _at_least(least: int, what: str) -> Callable[[str, Any], int]:
    """An integer >= least: an int, or a string of plain digits."""
    def parse(key: str, value: Any) -> int:
        if isinstance(value, str) and _digits(value) is not None:
            value = _digits(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise EvictionConfigError(
                f"{flag_name(key)} must be {what} >= {least}, got {value!r}")
        return value
    return parse


def _share(key: str, share: Any) -> float:
    """A share in (0, 1]: 0.5 or 50%."""
    try:
        share = parse_number(key, share)
        if share > 1:  # parse_number reads 2 as a token count
            raise EvictionConfigError
    except EvictionConfigError:
        raise EvictionConfigError(
            f"{flag_name(key)} must be a share of the KV pool in (0, 1] "
            f"(0.5 or 50%), got {share!r}") from None
    return float(share)


# --- the table ----------------------------------------------------------------


@dataclass(frozen=True)
class Flag:
    """One setting. `help` is one paragraph (Markdown code spans allowed): the
    README's meaning column and, without backticks, the `--help` text."""

    key: str                 # additional_config key; the flag is this with dashes
    group: str               # GROUPS: eviction | offload | modules
    value: Any               # the default, as parsed
    parse: Callable[[str, Any], Any]  # (key, given value or the default) -> value
    help: str
    shown: str = ""          # the default as the docs say it, where `value` does not
    choices: tuple[str, ...] | None = None  # what argparse accepts (else any text)
    null_is_default: bool = False  # a null (None) value means the default
    request: bool = False    # a request may set it too (vllm_xargs / extra_args)
    attr: str = ""           # the config field, where it is not the key without kv_

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")

    @property
    def field(self) -> str:
        return self.attr or self.key.removeprefix("kv_")

    @property
    def default(self) -> str:
        """The default, in Markdown."""
        if self.shown:
            return self.shown
        return f"`{self.value:g}`" if isinstance(self.value, float) else f"`{self.value}`"

    def read(self, raw: dict[str, Any]) -> Any:
        """This setting's parsed value in `raw` (additional_config), or its default."""
        value = raw.get(self.key, self.value)
        if value is None and self.null_is_default:
            value = self.value
        return self.parse(self.key, value)

    def help_text(self) -> str:
        """The `--help` entry (argparse formats %, so it is escaped)."""
        text = f"{self.help} Default: {self.default}."
        return text.replace("`", "").replace("%", "%%")


TABLE: tuple[Flag, ...] = (
    Flag("kv_eviction", "eviction", "none", _policy, choices=POLICIES, attr="policy",
         null_is_default=True,
         help="KV cache eviction policy: `h2o` (heavy hitters by accumulated attention + "
              "recent window), `streaming` (attention sinks + recent window), `snapkv` or "
              "`andpro` (tokens scored by the attention, or the value projection on the "
              "output, of the last `--kv-window` queries), `infinigen` (`streaming` with "
              "`--kv-offload on`: sinks + recent window resident, the rest offloaded to a "
              "host pool and fetched back when a decode query is predicted to need it)."),
    Flag("kv_budget", "eviction", 1024, parse_number, request=True,
         help="Resident KV tokens per request: a token count (`256`) or a fraction of the "
              "request's length (`0.2`, never below two KV blocks). It caps blocks: a request "
              "fills the KV blocks the budget needs, then is compacted to the whole blocks "
              "below the last one (`101` at 32-token blocks: 128 resident at most, 96 kept), "
              "so it compacts once per block of new tokens."),
    Flag("kv_recent", "eviction", None, _optional_number, request=True,
         shown="half of what a compaction keeps (the budget's blocks less one); for `snapkv` and "
               "`andpro`, the observation window",
         help="Recent window inside the budget (H2O's recent ratio), in the budget's unit."),
    Flag("kv_sink", "eviction", 4, _tokens,
         help="Attention-sink tokens always kept by `streaming`."),
    Flag("kv_window", "eviction", 32, _tokens,
         help="Observation window of `snapkv` and `andpro`: how many of the latest "
              "queries score the cache at each compaction."),
    Flag("kv_prefill_cap", "eviction", None, parse_prefill_cap, request=True, shown="`auto`",
         help="Resident tokens a request may hold while its prompt is prefilled in chunks, "
              "before it is compressed between chunks. `auto`: the prompt stays whole "
              "while the KV pool can hold its next chunk, and is compressed once, after its "
              "last chunk, so the policy sees the question at its end; when the pool is "
              "short it is compressed between chunks instead (counted in "
              "`vllm_kvevict_prefill_fallbacks_total`). "
              "`0`: always between chunks."),
    Flag("kv_offload", "offload", False, _switch, null_is_default=True, attr="enabled",
         shown="`off`; on with `--kv-swap-space` or `--kv-eviction infinigen`",
         help="Offload (InfiniGen): what the policy evicts goes to a host pool instead of being "
              "dropped, and each decode step fetches back the entries its query is predicted "
              "to need; the policy still chooses what stays resident. `on` or `off`. "
              "`--kv-eviction infinigen` is `streaming` with offload on."),
    Flag("kv_swap_space", "offload", None, _swap_space, null_is_default=True,
         shown="`4GiB` under `infinigen` or `--kv-offload on`, else no offload",
         help="Host memory pool for offloaded KV per worker: a number of GiB, as vLLM's "
              "`--swap-space` reads it (`4`, `0.25`), `0.25` being 256 MiB, or a size "
              "with a unit (`8GiB`, `512MiB`, `1073741824B`). Under any policy it "
              "turns offload on: evicted KV goes to the pool instead of being dropped."),
    Flag("kv_alpha", "offload", 4.0, _in(0.0, math.inf), null_is_default=True,
         help="Offload: fetch the host entries whose partial attention logit is above "
              "`max - alpha` (InfiniGen's threshold)."),
    Flag("kv_attend_cap", "offload", 0.2, _in(0.0, 1.0), null_is_default=True,
         help="Offload: at most this fraction of a request's tokens attended per decode "
              "step, resident and fetched (InfiniGen's 20% cap)."),
    Flag("kv_partial", "offload", 0.3, _in(0.0, 1.0), null_is_default=True,
         help="Offload: fraction of the head dimension in the skewed partial query/key "
              "that predicts attention."),
    Flag("kv_host_victim", "offload", "counter", _victim, choices=VICTIMS,
         null_is_default=True,
         help="Offload: which block the full host pool drops: `counter` (InfiniGen), "
              "`lru` or `fifo`."),
    Flag("kv_skewing", "offload", None, _path, null_is_default=True,
         shown="the file `python -m vllm_kvevict.calibrate MODEL` wrote to its cache",
         help="Offload: the InfiniGen skewing file to use (checked at startup against the "
              "model's layers, KV heads and head size); startup stops, naming the "
              "calibrate command, when there is none."),
    Flag("kv_max_schemas", "modules", 64, _at_least(0, "a schema count"),
         help="Prompt modules: schemas that clients may register at once through "
              "`/v1/kvevict/schemas`, per API server process, all tenants together; "
              "`0` turns registration off; past it, 403."),
    Flag("kv_max_pinned", "modules", 0.5, _share,
         help="Prompt modules: share of the KV block pool that registered schemas' module "
              "blocks may pin (`0.5` or `50%`), counted in the engine core; a schema past "
              "it is refused with 413."),
    Flag("kv_max_pml_bytes", "modules", 1 << 20, parse_bytes, shown="`1MiB`",
         help="Prompt modules: largest PML text a client may send (a schema route's body, "
              "a prompt's `<prompt>` element), e.g. `1MiB`; checked before parsing (413 "
              "for a schema body, read no further; 400 for a prompt)."),
    Flag("kv_max_modules", "modules", 512, _at_least(1, "an element count"),
         help="Prompt modules: most `<module>`, `<union>` and `<param>` elements in one "
              "schema, and most module imports in one prompt; counted while parsing, 400 "
              "past it."),
)

FLAGS: dict[str, Flag] = {f.key: f for f in TABLE}
REQUEST_KEYS = tuple(f.key for f in TABLE if f.request)


def group(name: str) -> tuple[Flag, ...]:
    return tuple(f for f in TABLE if f.group == name)


def default(key: str) -> Any:
    """A setting's default, for the config dataclasses' fields."""
    return FLAGS[key].value


# --- the docs' tables -----------------------------------------------------------

# A generated table sits between `<!-- flags: GROUP [GROUP ...] -->` and
# `<!-- /flags -->` lines.
_MARKED = re.compile(r"(<!-- flags: ([a-z ]+) -->\n)(.*?)(<!-- /flags -->)", re.S)


def markdown(groups: tuple[str, ...] = GROUPS) -> str:
    """The flag table of `groups`, as README.md and the docs show it."""
    unknown = set(groups) - set(GROUPS)
    if unknown:
        raise ValueError(f"unknown group(s) {sorted(unknown)}; known: {', '.join(GROUPS)}")
    rows = ["| flag / key | default | meaning |", "|---|---|---|"]
    rows += [f"| `{f.flag}` / `{f.key}` | {f.default} | {f.help} |"
             for f in TABLE if f.group in groups]
    return "\n".join(rows) + "\n"


def marked_groups(text: str) -> list[tuple[str, ...]]:
    """The groups of each generated table in a document, in order."""
    return [tuple(m.group(2).split()) for m in _MARKED.finditer(text)]


def refresh(text: str) -> str:
    """`text` with every marked table regenerated from TABLE."""
    return _MARKED.sub(lambda m: m.group(1) + markdown(tuple(m.group(2).split())) + m.group(4),
                       text)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--markdown"]:
        print(markdown(tuple(argv[1:]) or GROUPS), end="")
        return 0
    if argv[:1] == ["--write"] and argv[1:]:
        for path in argv[1:]:
            with open(path, encoding="utf-8") as f:
                text = f.read()
            new = refresh(text)
            if new != text:
                with open(path, "w", encoding="utf-8") as f:
                    f.write(new)
                print(f"rewrote the flag table(s) in {path}")
        return 0
    print("usage: python -m vllm_kvevict.core.config.flags --markdown [GROUP ...]\n"
          "       python -m vllm_kvevict.core.config.flags --write FILE ...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
