"""The `vllm serve` flags, through vLLM's own argument parser and EngineArgs."""

import pytest


@pytest.fixture(scope="module")
def parser():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    import vllm_kvevict

    vllm_kvevict.register()  # what the entry point does in every vLLM process
    return EngineArgs.add_cli_args(FlexibleArgumentParser())


def _engine_args(parser, *argv):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs.from_cli_args(parser.parse_args(["--model", "m", *argv]))


def test_flags_reach_additional_config(parser):
    args = _engine_args(parser, "--kv-eviction", "h2o", "--kv-budget", "256",
                        "--kv-recent", "64", "--additional-config", '{"other": 1}')
    assert args.additional_config == {"other": 1, "kv_eviction": "h2o",
                                      "kv_budget": "256", "kv_recent": "64"}


def test_unset_flags_leave_additional_config_alone(parser):
    args = _engine_args(parser, "--additional-config", '{"kv_eviction": "streaming"}')
    assert args.additional_config == {"kv_eviction": "streaming"}


def test_bad_values_fail_at_parse_time_naming_the_flag(parser):
    from vllm_kvevict.core.config.settings import EvictionConfigError

    with pytest.raises(EvictionConfigError, match="--kv-budget"):
        _engine_args(parser, "--kv-eviction", "h2o", "--kv-budget", "lots")
    with pytest.raises(SystemExit):  # argparse's own choices check
        parser.parse_args(["--model", "m", "--kv-eviction", "lru"])


def test_swap_space_reads_like_vllms_swap_space(parser, capsys):
    """`--kv-swap-space 0.25` is 256 MiB and `4` is 4 GiB (GiB, as vLLM's
    --swap-space); `abc` is refused naming the forms; --help says so."""
    from vllm_kvevict.core.config.settings import EvictionConfigError
    from vllm_kvevict.integration.settings import eviction_config

    for value, size in (("0.25", 256 << 20), ("4", 4 << 30), ("512MiB", 512 << 20)):
        args = _engine_args(parser, "--kv-eviction", "h2o", "--kv-swap-space", value)
        assert eviction_config(args.additional_config).swap_bytes == size
    with pytest.raises(EvictionConfigError, match=r"--kv-swap-space .*must be a number of GiB "
                                                  r"as in vLLM's --swap-space \(4, 0.25\) or "
                                                  r"a size with a unit \(512MiB, 8GiB"):
        _engine_args(parser, "--kv-eviction", "h2o", "--kv-swap-space", "abc")
    with pytest.raises(SystemExit):
        parser.parse_args(["--help=kv-swap-space"])
    assert "a number of GiB, as vLLM's --swap-space reads it (4, 0.25)" in " ".join(
        capsys.readouterr().out.split())


def test_help_shows_each_flag_with_its_default(parser, capsys):
    """`vllm serve --help=kv-` lists our flags with their real defaults."""
    with pytest.raises(SystemExit):
        parser.parse_args(["--help=kv-"])
    text = capsys.readouterr().out
    for flag, default in (("--kv-eviction", "Default: none."), ("--kv-budget", "Default: 1024."),
                          ("--kv-recent", "Default: half of what a compaction keeps"),
                          ("--kv-sink", "Default: 4."), ("--kv-window", "Default: 32."),
                          ("--kv-swap-space", "Default: 4GiB under infinigen"),
                          ("--kv-alpha", "Default: 4."), ("--kv-attend-cap", "Default: 0.2."),
                          ("--kv-partial", "Default: 0.3."),
                          ("--kv-host-victim", "Default: counter.")):
        start = text.index(f"\n  {flag} ")
        entry = " ".join(text[start:start + 1000].split("\n  --")[1].split())
        assert default in entry and "(default: None)" not in entry, entry


def test_help_is_the_flag_table(parser, capsys):
    """Each flag's --help entry is its help and default in core/config/flags.py, and
    the flags accept the table's choices."""
    from vllm_kvevict.core.config.flags import TABLE

    with pytest.raises(SystemExit):
        parser.parse_args(["--help=kv-"])
    text = "".join(capsys.readouterr().out.split())  # argparse wraps, at hyphens too
    for flag in TABLE:
        want = "".join(flag.help_text().replace("%%", "%").split())
        assert want in text, (flag.flag, want)
        for choice in flag.choices or ():
            assert parser.parse_args(["--model", "m", flag.flag, choice])
