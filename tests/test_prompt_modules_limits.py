"""Limits on what clients may pin through the schema routes (issue 20, item 5):
the flags, their parsing, and the admission rule, without an engine."""

import pytest

from vllm_kvevict.core.config.settings import EvictionConfig, EvictionConfigError, ModuleLimits


def limits_of(raw: dict) -> ModuleLimits:
    """The limits as the engine parses them: part of the one EvictionConfig."""
    return EvictionConfig.from_dict(raw).limits


def test_defaults_and_parsing():
    assert limits_of({}) == ModuleLimits(max_schemas=64, max_pinned=0.5,
                                         max_pml_bytes=1 << 20, max_modules=512)
    assert limits_of({"kv_max_pml_bytes": "64KiB", "kv_max_modules": "8"}) == \
        ModuleLimits(max_pml_bytes=64 << 10, max_modules=8)
    assert limits_of({"kv_max_schemas": "3", "kv_max_pinned": "25%"}) == \
        ModuleLimits(max_schemas=3, max_pinned=0.25)
    assert limits_of({"kv_max_schemas": 0, "kv_max_pinned": 1}).max_schemas == 0
    assert limits_of({"kv_eviction": "h2o", "other": 1}) == ModuleLimits()


@pytest.mark.parametrize("raw, flag", [
    ({"kv_max_schemas": "-1"}, "--kv-max-schemas"),
    ({"kv_max_schemas": "many"}, "--kv-max-schemas"),
    ({"kv_max_schemas": 2.5}, "--kv-max-schemas"),
    ({"kv_max_schemas": True}, "--kv-max-schemas"),
    ({"kv_max_pinned": "0"}, "--kv-max-pinned"),
    ({"kv_max_pinned": 1.5}, "--kv-max-pinned"),
    ({"kv_max_pinned": "half"}, "--kv-max-pinned"),
    ({"kv_max_schemas": "²"}, "--kv-max-schemas"),  # issue 38: "²".isdigit(), int("²") raises
    ({"kv_max_pml_bytes": "lots"}, "--kv-max-pml-bytes"),
    ({"kv_max_pml_bytes": 0}, "--kv-max-pml-bytes"),
    ({"kv_max_modules": "0"}, "--kv-max-modules"),
    ({"kv_max_modules": "²"}, "--kv-max-modules"),
])
def test_bad_values_name_the_flag(raw, flag):
    with pytest.raises(EvictionConfigError, match=flag):
        limits_of(raw)


def check(limits=ModuleLimits(max_schemas=2, max_pinned=0.5), *, registered=0, pinned=0,
          new=10, pool=100):
    from vllm_kvevict.integration.prompt_modules import check_limits

    check_limits(limits, "s", registered=registered, pinned=pinned, new=new, pool=pool)


def test_admission_up_to_each_limit():
    check(registered=1, pinned=40, new=10)  # 2 schemas, 50 of 100 blocks: exactly at both


def test_the_schema_count_limit_is_403_and_says_its_value():
    from vllm_kvevict.integration.prompt_modules import SchemaLimitError

    with pytest.raises(SchemaLimitError) as e:
        check(registered=2, new=0)
    assert e.value.status == 403
    assert "--kv-max-schemas" in str(e.value) and "is 2" in str(e.value)


@pytest.mark.parametrize("pinned, new", [(41, 10), (0, 51)])
def test_the_pinned_share_limit_is_413_and_says_its_value(pinned, new):
    from vllm_kvevict.integration.prompt_modules import SchemaLimitError

    with pytest.raises(SchemaLimitError) as e:
        check(pinned=pinned, new=new)
    assert e.value.status == 413
    msg = str(e.value)
    assert "--kv-max-pinned 0.5" in msg and "50 of the pool's 100" in msg, msg
    assert f"would pin {new}" in msg, msg


# --- the flags, through vLLM's own parser (as tests/test_cli.py) ---------------------

@pytest.fixture(scope="module")
def parser():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    import vllm_kvevict

    vllm_kvevict.register()
    return EngineArgs.add_cli_args(FlexibleArgumentParser())


def test_flags_reach_additional_config_and_fail_early(parser):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs.from_cli_args(parser.parse_args(
        ["--model", "m", "--kv-max-schemas", "8", "--kv-max-pinned", "0.25"]))
    assert args.additional_config == {"kv_max_schemas": "8", "kv_max_pinned": "0.25"}
    with pytest.raises(EvictionConfigError, match="--kv-max-pinned"):
        EngineArgs.from_cli_args(parser.parse_args(["--model", "m", "--kv-max-pinned", "2"]))


def test_help_shows_the_limits_with_their_defaults(parser, capsys):
    with pytest.raises(SystemExit):
        parser.parse_args(["--help=kv-"])
    text = capsys.readouterr().out
    for flag, default in (("--kv-max-schemas", "Default: 64."),
                          ("--kv-max-pinned", "Default: 0.5."),
                          ("--kv-max-pml-bytes", "Default: 1MiB."),
                          ("--kv-max-modules", "Default: 512.")):
        start = text.index(f"\n  {flag} ")
        entry = " ".join(text[start:start + 1000].split("\n  --")[1].split())
        assert default in entry and "(default: None)" not in entry, entry
