"""The --kv-* settings are declared once (vllm_kvevict/core/config/flags.py) and the
docs say what that declaration says:

- each flag table in README.md, docs/offload.md and docs/prompt_modules.md is
  the one `python -m vllm_kvevict.core.config.flags --markdown GROUP` prints, and
  every flag is in one of them;
- the config's defaults are the table's, and each flag fills a config field;
- the help names every choice it offers, and fits a Markdown table cell.
(`vllm serve --help` shows the same text: tests/test_cli.py.)
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from vllm_kvevict.core.config import flags
from vllm_kvevict.core.config.settings import (
    EvictionConfig,
    EvictionConfigError,
    ModuleLimits,
    OffloadSettings,
)

ROOT = Path(__file__).resolve().parents[1]
DOCS = {"README.md": [("eviction",)], "docs/offload.md": [("offload",)],
        "docs/prompt_modules.md": [("modules",)]}
REFRESH = ("python -m vllm_kvevict.core.config.flags --write README.md docs/offload.md "
           "docs/prompt_modules.md")


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_docs_tables_are_the_declaration(doc):
    text = (ROOT / doc).read_text()
    assert flags.marked_groups(text) == DOCS[doc], f"{doc}: a flag table's markers moved"
    assert flags.refresh(text) == text, (
        f"{doc}'s flag table disagrees with vllm_kvevict/core/config/flags.py; "
        f"run `{REFRESH}` (or change the declaration)")


def _rows(text: str) -> dict[str, tuple[str, str]]:
    """flag -> (default, meaning) of every marked table, read as Markdown."""
    out = {}
    for block in re.findall(r"<!-- flags: [a-z ]+ -->\n(.*?)<!-- /flags -->", text, re.S):
        for line in block.splitlines()[2:]:
            name, default, meaning = (c.strip() for c in line.strip("|").split(" | "))
            out[name.split("`")[1]] = (default, meaning)
    return out


def test_every_flag_is_documented_once_with_its_default_and_help():
    rows: dict[str, tuple[str, str]] = {}
    for doc in DOCS:
        found = _rows((ROOT / doc).read_text())
        assert not set(found) & set(rows), f"{doc} repeats {sorted(set(found) & set(rows))}"
        rows.update(found)
    assert rows == {f.flag: (f.default, f.help) for f in flags.TABLE}
    readme = _rows((ROOT / "README.md").read_text())
    assert readme["--kv-eviction"][0] == "`none`" and readme["--kv-budget"][0] == "`1024`"


def test_markdown_command_prints_the_table(capsys):
    assert flags.main(["--markdown", "offload"]) == 0
    assert capsys.readouterr().out == flags.markdown(("offload",))
    assert flags.main([]) == 2  # usage
    with pytest.raises(ValueError, match="unknown group"):
        flags.markdown(("eviction", "nope"))


def test_config_defaults_and_fields_come_from_the_table():
    values = {"eviction": EvictionConfig(), "offload": OffloadSettings(),
              "modules": ModuleLimits()}
    fields = {g: {f.name for f in dataclasses.fields(v)} for g, v in values.items()}
    for f in flags.TABLE:
        assert f.group in flags.GROUPS and f.field in fields[f.group], f.key
        assert getattr(values[f.group], f.field) == f.value, f.key
    assert sum(len(flags.group(g)) for g in flags.GROUPS) == len(flags.TABLE)
    assert EvictionConfig.from_dict({}) == EvictionConfig()
    # every field of the three values is one flag's (host / limits hold the others)
    assert fields["eviction"] - {f.field for f in flags.group("eviction")} == {"host", "limits"}
    assert fields["offload"] == {f.field for f in flags.group("offload")}
    assert fields["modules"] == {f.field for f in flags.group("modules")}
    assert flags.REQUEST_KEYS == ("kv_budget", "kv_recent", "kv_prefill_cap")


def test_null_means_the_default_only_where_declared():
    """`{"kv_alpha": null}` is the default; `{"kv_budget": null}` is refused,
    as before the table (`null_is_default`)."""
    cfg = EvictionConfig.from_dict({f.key: None for f in flags.TABLE if f.null_is_default})
    assert cfg == EvictionConfig()
    for f in flags.TABLE:
        if not f.null_is_default and f.value is not None:
            with pytest.raises(EvictionConfigError, match=re.escape(f.flag)):
                EvictionConfig.from_dict({"kv_eviction": "h2o", f.key: None})


def test_help_names_every_choice_and_fits_a_table_cell():
    for f in flags.TABLE:
        for choice in f.choices or ():
            assert choice == "none" or f"`{choice}`" in f.help, (f.key, choice)
        for text in (f.help, f.default):
            assert "|" not in text and "\n" not in text and text.strip() == text, f.key
        assert f.help.endswith("."), f.key
        assert f.flag == "--" + f.key.replace("_", "-") and f.key.startswith("kv_")
