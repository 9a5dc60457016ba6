"""Bad settings fail fast, and the message names the flag."""

import pytest

from vllm_kvevict.core.config.settings import EvictionConfig, EvictionConfigError
from vllm_kvevict.core.policies import H2OPolicy, StreamingPolicy, make_policy


@pytest.mark.parametrize("raw, flag", [
    ({"kv_eviction": "lru"}, "--kv-eviction"),
    ({"kv_eviction": "h2o", "kv_budget": 0}, "--kv-budget"),
    ({"kv_eviction": "h2o", "kv_budget": -5}, "--kv-budget"),
    ({"kv_eviction": "h2o", "kv_budget": "lots"}, "--kv-budget"),
    ({"kv_eviction": "h2o", "kv_budget": 1.5}, "--kv-budget"),
    ({"kv_eviction": "h2o", "kv_budget": 256, "kv_recent": 300}, "--kv-recent"),
    ({"kv_eviction": "h2o", "kv_budget": 256, "kv_recent": 0.1}, "--kv-recent"),
    ({"kv_eviction": "h2o", "kv_budget": 256, "kv_recent": "x"}, "--kv-recent"),
    ({"kv_eviction": "streaming", "kv_budget": 4, "kv_sink": 4}, "--kv-sink"),
    ({"kv_swap_space": "4GiB"}, "--kv-swap-space.*needs an eviction policy"),
    ({"kv_eviction": "infinigen", "kv_swap_space": "lots"}, "--kv-swap-space"),
    ({"kv_eviction": "infinigen", "kv_swap_space": "4 parsecs"}, "--kv-swap-space"),
    ({"kv_eviction": "infinigen", "kv_swap_space": 0}, "--kv-swap-space"),
    ({"kv_eviction": "infinigen", "kv_alpha": 0}, "--kv-alpha"),
    ({"kv_eviction": "infinigen", "kv_alpha": "x"}, "--kv-alpha"),
    ({"kv_eviction": "infinigen", "kv_attend_cap": 1.5}, "--kv-attend-cap"),
    ({"kv_eviction": "h2o", "kv_prefetch": 0.2}, "kv_prefetch is now kv_attend_cap"),
    ({"kv_eviction": "h2o", "kv_budjet": 256}, "unknown setting.*kv_budjet"),
    ({"kv_eviction": "infinigen", "kv_partial": 0}, "--kv-partial"),
    ({"kv_eviction": "infinigen", "kv_host_victim": "random"}, "--kv-host-victim"),
])
def test_bad_values_name_their_flag(raw, flag):
    with pytest.raises(EvictionConfigError, match=flag):
        EvictionConfig.from_dict(raw)


def test_budget_below_one_block_is_refused():
    cfg = EvictionConfig.from_dict({"kv_eviction": "h2o", "kv_budget": 64})
    with pytest.raises(EvictionConfigError, match="--kv-budget.*below one KV block"):
        cfg.check_block_size(128)
    cfg.check_block_size(32)


def test_units_and_defaults():
    cfg = EvictionConfig.from_dict({"kv_eviction": "H2O", "kv_budget": "256"})
    assert (cfg.policy, cfg.budget, cfg.recent_tokens(256, 1000)) == ("h2o", 256, 128)
    frac = EvictionConfig.from_dict({"kv_eviction": "h2o", "kv_budget": "20%", "kv_recent": 0.1})
    assert frac.budget == pytest.approx(0.2)
    assert frac.budget_tokens(1000, 32) == 200 and frac.recent_tokens(200, 1000) == 100
    assert frac.budget_tokens(50, 32) == 64  # never below two blocks: a block of room
    assert not EvictionConfig.from_dict({}).enabled
    assert EvictionConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("raw, shown", [
    ({"kv_eviction": "h2o", "kv_budget": 96}, "32"),  # half of what a compaction keeps (64)
    ({"kv_eviction": "h2o", "kv_budget": 64, "kv_recent": 16}, "16"),
    ({"kv_eviction": "h2o", "kv_budget": 0.2}, "0.1"),
    ({"kv_eviction": "h2o", "kv_budget": 0.2, "kv_recent": 0.05}, "0.05"),
    ({"kv_eviction": "snapkv", "kv_budget": 256}, "32"),  # the window
    ({"kv_eviction": "andpro", "kv_budget": 64}, "16"),  # keeps 32: half of it
    ({"kv_eviction": "h2o", "kv_budget": 72}, "32"),  # fills 3 blocks, keeps 2: 64
    ({"kv_eviction": "snapkv", "kv_budget": 0.2}, "min(32, 0.1)"),
    ({"kv_eviction": "streaming", "kv_budget": 96, "kv_recent": 16}, "60"),  # all but sinks
    ({"kv_eviction": "infinigen", "kv_budget": 0.2}, "0.2 - 4"),
])
def test_recent_in_force_is_what_the_policy_keeps(raw, shown):
    """/metrics' info gauge shows the recent window in force, never None: under
    a token budget, what a compaction keeps (the whole blocks below the
    budget's last one)."""
    cfg = EvictionConfig.from_dict(raw)
    assert cfg.recent_in_force(32) == shown
    if isinstance(cfg.budget, int) and not isinstance(make_policy(cfg.policy), StreamingPolicy):
        kept = (cfg.budget - 1) // 32 * 32
        assert str(cfg.recent_tokens(kept, 1000)) == shown  # what plans carry


def test_window_policies_keep_their_window_while_it_fits():
    cfg = EvictionConfig.from_dict({"kv_eviction": "andpro", "kv_budget": 256})
    assert cfg.window == 32 and cfg.recent_tokens(256, 1000) == 32  # the papers' window
    assert cfg.recent_tokens(40, 1000) == 20  # never more than half the budget
    frac = EvictionConfig.from_dict({"kv_eviction": "snapkv", "kv_budget": 0.02,
                                     "kv_window": 48})
    assert frac.budget_tokens(1000, 32) == 64 and frac.recent_tokens(32, 1000) == 16
    with pytest.raises(EvictionConfigError, match="--kv-window"):
        EvictionConfig.from_dict({"kv_eviction": "snapkv", "kv_window": 0.5})
    # h2o is unaffected by the window setting.
    assert EvictionConfig.from_dict({"kv_eviction": "h2o", "kv_budget": 256}
                                    ).recent_tokens(256, 1000) == 128


def test_offload_settings():
    ig = EvictionConfig.from_dict({"kv_eviction": "infinigen"})
    assert ig.offload and ig.swap_bytes == 4 << 30 and type(make_policy(ig.policy)) is StreamingPolicy
    assert (ig.alpha, ig.attend_cap, ig.partial, ig.host_victim) == (4.0, 0.2, 0.3, "counter")
    h2o = EvictionConfig.from_dict({"kv_eviction": "h2o", "kv_swap_space": "512MiB",
                                    "kv_host_victim": "LRU", "kv_alpha": "5"})
    assert h2o.offload and h2o.swap_bytes == 512 << 20 and type(make_policy(h2o.policy)) is H2OPolicy
    assert (h2o.host_victim, h2o.alpha) == ("lru", 5.0)
    assert EvictionConfig.from_dict({"kv_eviction": "h2o", "kv_swap_space": "1.5g"}
                                    ).swap_bytes == 3 << 29
    assert not EvictionConfig.from_dict({"kv_eviction": "h2o"}).offload
    for cfg in (ig, h2o):
        assert EvictionConfig.from_dict(cfg.to_dict()) == EvictionConfig.from_dict(
            EvictionConfig.from_dict(cfg.to_dict()).to_dict())
    # Without offload the dict (and the spec hash) has the keys it always had.
    assert "kv_swap_space" not in EvictionConfig.from_dict({"kv_eviction": "h2o"}).to_dict()


def test_offload_is_a_mode_and_infinigen_spells_out_streaming_with_it():
    """--kv-offload turns offload on under any policy; --kv-eviction infinigen
    is streaming with it on, names itself so on /metrics and in messages, and
    round-trips through the canonical form."""
    ig = EvictionConfig.from_dict({"kv_eviction": "InfiniGen", "kv_sink": 2})
    explicit = EvictionConfig.from_dict({"kv_eviction": "streaming", "kv_offload": "on",
                                         "kv_sink": 2})
    assert ig == explicit and (ig.policy, ig.offload, ig.label) == ("streaming", True, "infinigen")
    assert ig.to_dict()["kv_eviction"] == "infinigen" and ig.to_dict()["kv_offload"] is True
    assert EvictionConfig.from_dict(ig.to_dict()).to_dict() == ig.to_dict()
    assert ig.as_flags() == "--kv-eviction infinigen"
    snap = EvictionConfig.from_dict({"kv_eviction": "snapkv", "kv_offload": True})
    assert snap.offload and snap.label == "snapkv" and snap.swap_bytes == 4 << 30
    assert snap.as_flags() == "--kv-eviction snapkv --kv-offload on"
    assert EvictionConfig.from_dict(snap.to_dict()).to_dict() == snap.to_dict()
    swap = EvictionConfig.from_dict({"kv_eviction": "streaming", "kv_swap_space": "1g"})
    assert swap.offload and swap.label == "streaming"  # as the user wrote it
    assert not EvictionConfig.from_dict({"kv_eviction": "h2o", "kv_offload": "off"}).offload
    with pytest.raises(EvictionConfigError, match="--kv-offload.*contradicts --kv-eviction"):
        EvictionConfig.from_dict({"kv_eviction": "infinigen", "kv_offload": False})
    with pytest.raises(EvictionConfigError, match="--kv-offload.*needs an eviction policy"):
        EvictionConfig.from_dict({"kv_offload": "on"})
    with pytest.raises(EvictionConfigError, match="--kv-offload.*must be on or off"):
        EvictionConfig.from_dict({"kv_eviction": "h2o", "kv_offload": "maybe"})


@pytest.mark.parametrize("value, size", [
    ("4", 4 << 30), (4, 4 << 30), ("0.25", 256 << 20), (0.25, 256 << 20), (" 2 ", 2 << 30),
    ("512MiB", 512 << 20), ("8GiB", 8 << 30), ("8g", 8 << 30), ("1073741824B", 1 << 30),
    ("1073741824 b", 1 << 30), ("4096KiB", 4 << 20),
])
def test_swap_space_bare_number_is_gib_as_in_vllm_swap_space(value, size):
    """--kv-swap-space 4 is 4 GiB and 0.25 is 256 MiB, as vLLM's --swap-space
    reads them; a size with a unit (bytes included: `B`) means what it says, and
    the canonical form every process re-reads keeps the size."""
    cfg = EvictionConfig.from_dict({"kv_eviction": "h2o", "kv_swap_space": value})
    assert cfg.swap_bytes == size
    assert EvictionConfig.from_dict(cfg.to_dict()).swap_bytes == size


@pytest.mark.parametrize("value", ["abc", "4 parsecs", "", "-1", "0", "0.0", 0, "1e3", True])
def test_swap_space_bad_value_names_the_accepted_forms(value):
    with pytest.raises(EvictionConfigError) as err:
        EvictionConfig.from_dict({"kv_eviction": "h2o", "kv_swap_space": value})
    said = str(err.value)
    assert said.startswith("--kv-swap-space") and " must be " in said, said
    for form in ("GiB", "--swap-space", "0.25", "512MiB", "8GiB", "B)"):
        assert form in said, said


def test_max_pml_bytes_bare_number_stays_bytes():
    cfg = EvictionConfig.from_dict({"kv_eviction": "h2o", "kv_max_pml_bytes": "4096"})
    assert cfg.limits.max_pml_bytes == 4096


# --- per-request kv_budget / kv_recent against the server's (issue 20 #6) ---
# A request may keep less KV than the server would, never more, whatever the
# units: a fraction at most the server's fraction; a token count at most the
# server's token count. Across units only what is sound at every length passes:
# against a fractional server, a token count no larger than what the server keeps
# at that length (two blocks, or nearly everything when the fraction is ~1);
# against a token server, no fraction (a long request would pass the count).
BLOCK = 32


def _server(budget, **extra):
    return EvictionConfig.from_dict({"kv_eviction": "h2o", "kv_budget": budget, **extra})


@pytest.mark.parametrize("server, asked, budget", [
    (0.2, {"kv_budget": 0.1}, 0.1),
    (0.2, {"kv_budget": 0.2}, 0.2),
    (0.2, {"kv_budget": "20%"}, 0.2),
    (0.2, {"kv_budget": "0.05"}, 0.05),
    (0.2, {"kv_budget": BLOCK}, BLOCK),  # one block: under the least the server keeps (two)
    (0.2, {"kv_budget": 2 * BLOCK}, 2 * BLOCK),  # two blocks: the least it ever keeps
    (0.2, {"kv_recent": 0.1}, 0.2),
    (0.2, {"kv_budget": 0.1, "kv_recent": 0.05}, 0.1),
    (1.0, {"kv_budget": 4096}, 4096),  # the server keeps every token: any count is less
    (0.999, {"kv_budget": 999}, 999),  # ceil(0.999 * L) >= min(L, 999) at every length L
    (256, {"kv_budget": 64}, 64),
    (256, {"kv_budget": 256}, 256),
    (256, {"kv_budget": 64, "kv_recent": 16}, 64),
    (256, {"kv_recent": 200}, 256),  # the window lives inside the budget: no bound of its own
])
def test_request_may_ask_for_less_than_the_server(server, asked, budget):
    cfg = _server(server).for_request(asked, BLOCK)
    assert cfg.budget == pytest.approx(budget) and type(cfg.budget) is type(budget)
    # Never more resident tokens than the server at any length.
    srv = _server(server)
    for length in (1, 31, 32, 33, 100, 320, 999, 1000, 4096, 100_000):
        mine = min(length, cfg.budget_tokens(length, BLOCK))
        assert mine <= min(length, srv.budget_tokens(length, BLOCK)), length


@pytest.mark.parametrize("server, asked", [
    (0.2, 0.99),
    (0.2, 1.0),
    (0.2, 0.21),
    (0.2, "50%"),
    (0.2, 10**9),
    (0.2, 65),  # the server keeps 64 (two blocks) of a request 65 tokens long
    (0.2, 321),
    (0.999, 1001),
    (256, 257),
    (256, 10**9),
    (256, 0.1),
    (256, 1.0),
])
def test_request_asking_more_than_the_server_is_refused_naming_both(server, asked):
    with pytest.raises(EvictionConfigError) as err:
        _server(server).for_request({"kv_budget": asked}, BLOCK)
    msg = str(err.value)
    assert msg.startswith("request field vllm_xargs"), msg
    assert f"kv_budget {asked!r}" in msg and f"server's --kv-budget {server!r}" in msg, msg


@pytest.mark.parametrize("server, asked, match", [
    (0.2, {"kv_recent": 0.5}, "kv_recent.*must not exceed"),
    (0.2, {"kv_recent": 16}, "kv_recent must use the same unit"),
    (0.2, {"kv_budget": 0.1, "kv_recent": 0.2}, "kv_recent.*must not exceed"),
    (256, {"kv_recent": 0.1}, "kv_recent must use the same unit"),
    (256, {"kv_recent": 300}, "kv_recent.*must not exceed"),
    (256, {"kv_budget": 64, "kv_recent": 128}, "kv_recent.*must not exceed"),
])
def test_request_recent_window_stays_inside_its_budget(server, asked, match):
    with pytest.raises(EvictionConfigError, match=match):
        _server(server).for_request(asked, BLOCK)


def test_prefill_cap_parses_and_a_request_may_only_lower_it():
    """--kv-prefill-cap: 'auto' (default, None: the pool decides) or a token
    count >= 0; per request at most the server's (a request holding more of its
    prompt than the operator allowed could starve the pool)."""
    auto = EvictionConfig.from_dict({"kv_eviction": "h2o"})
    assert auto.prefill_cap is None and "kv_prefill_cap" not in auto.to_dict()
    for raw, want in (("auto", None), ("0", 0), (0, 0), (2048, 2048), ("4096", 4096)):
        cfg = EvictionConfig.from_dict({"kv_eviction": "h2o", "kv_prefill_cap": raw})
        assert cfg.prefill_cap == want, raw
    for bad in (-1, "-5", 0.5, "lots", True):
        with pytest.raises(EvictionConfigError, match="--kv-prefill-cap"):
            EvictionConfig.from_dict({"kv_eviction": "h2o", "kv_prefill_cap": bad})
    assert auto.for_request({"kv_prefill_cap": 0}, BLOCK).prefill_cap == 0
    assert auto.for_request({"kv_prefill_cap": 10**9}, BLOCK).prefill_cap == 10**9
    capped = EvictionConfig.from_dict({"kv_eviction": "h2o", "kv_prefill_cap": 512})
    assert capped.for_request({"kv_prefill_cap": 256}, BLOCK).prefill_cap == 256
    assert capped.for_request({"kv_budget": 128}, BLOCK).prefill_cap == 512
    for more in (513, "auto"):
        with pytest.raises(EvictionConfigError, match="kv_prefill_cap .* --kv-prefill-cap 512"):
            capped.for_request({"kv_prefill_cap": more}, BLOCK)


def test_settings_parse_each_dict_once_and_canonicalise():
    """integration/settings.py: one parse per distinct dict, the same frozen
    value after that; the canonical dict parses to the same config."""
    from vllm_kvevict.integration.settings import canonical, eviction_config

    raw = {"kv_eviction": "H2O", "kv_budget": "20%", "kv_max_pinned": "25%", "other": [1]}
    cfg = eviction_config(raw)
    assert eviction_config(dict(raw)) is cfg  # other keys do not matter, even unhashable
    assert (cfg.policy, cfg.budget, cfg.limits.max_pinned) == ("h2o", 0.2, 0.25)
    canon = canonical(raw)
    assert canon["other"] == [1] and canon["kv_budget"] == 0.2
    assert eviction_config(canon) == cfg
    assert canonical({"other": 1}) == {"other": 1}  # no kv_* key: left alone
    with pytest.raises(EvictionConfigError, match="--kv-budget"):
        eviction_config({"kv_eviction": "h2o", "kv_budget": "lots"})
