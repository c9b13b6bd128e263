"""The settings object (`drafttree.settings`): the DRAFTTREE_* variables parsed once, bad values
refused by name, shown by `drafttree graphs` and recorded in bench results."""
from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path

import pytest

from drafttree import settings
from drafttree.settings import Settings, current, install, using


def test_defaults_and_every_variable(tmp_path):
    assert Settings.from_env({}) == Settings()
    d = Settings()
    assert (d.attn_kernel, d.gemv, d.gemm, d.moe_kernel, d.pdl, d.deterministic, d.blocks, d.compile) == (
        True, True, True, True, True, False, None, "1")
    assert d.cache == Path.home() / ".cache" / "drafttree"
    blocks = tmp_path / "best.json"
    blocks.write_text("[]")
    env = {"DRAFTTREE_ATTN_KERNEL": "0", "DRAFTTREE_GEMV": "0", "DRAFTTREE_GEMM": "0", "DRAFTTREE_MOE_KERNEL": "0",
           "DRAFTTREE_PDL": "0", "DRAFTTREE_DETERMINISTIC": "1", "DRAFTTREE_BLOCKS": str(blocks),
           "DRAFTTREE_COMPILE": "cpu",
           "DRAFTTREE_CACHE": "~/elsewhere"}
    s = Settings.from_env(env)
    assert s == Settings(attn_kernel=False, gemv=False, gemm=False, moe_kernel=False, pdl=False, deterministic=True,
                         blocks=str(blocks), compile="cpu", cache=Path("~/elsewhere").expanduser())
    assert Settings.from_env({k: "" for k in env}) == Settings()   # empty: unset
    assert {settings.env_name(f.name) for f in dataclasses.fields(Settings)} == set(env)


@pytest.mark.parametrize("name,value,says", [
    ("DRAFTTREE_GEMV", "yes", "expected 0 (off) or 1 (on)"),
    ("DRAFTTREE_PDL", "2", "expected 0 (off) or 1 (on)"),
    ("DRAFTTREE_ATTN_KERNEL", "off", "expected 0 (off) or 1 (on)"),
    ("DRAFTTREE_COMPILE", "fast", "expected 0 (off), 1 (CUDA tensors) or cpu"),
    ("DRAFTTREE_BLOCKS", "/no/such/file.json", "no such file"),
])
def test_a_bad_value_is_refused_naming_the_variable(name, value, says):
    with pytest.raises(ValueError, match=f"^{name}=.*{re.escape(says)}"):
        Settings.from_env({name: value})


def test_bad_fields_refused_when_made_in_code():
    with pytest.raises(ValueError, match="DRAFTTREE_COMPILE"):
        Settings(compile="fast")
    with pytest.raises(ValueError, match="DRAFTTREE_GEMM"):
        Settings(gemm=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        Settings().gemv = False


def test_an_unknown_variable_is_logged_once(caplog):
    env = {"DRAFTTREE_FUSED_TREE_TYPO": "0"}
    with caplog.at_level(logging.WARNING, logger="drafttree.settings"):
        assert Settings.from_env(env) == Settings()
        Settings.from_env(env)
    assert caplog.text.count("DRAFTTREE_FUSED_TREE_TYPO") == 1 and "not a drafttree setting" in caplog.text


def test_describe_and_as_dict():
    s = Settings(gemm=False, compile="0", cache=Path("/tmp/c"))
    assert s.describe() == ("attn_kernel=on gemv=on gemm=off moe_kernel=on pdl=on deterministic=off blocks=- "
                            "compile=0 cache=/tmp/c")
    d = s.as_dict()
    assert d == {"attn_kernel": True, "gemv": True, "gemm": False, "moe_kernel": True, "pdl": True,
                 "deterministic": False, "blocks": None, "compile": "0", "cache": "/tmp/c"}
    assert json.loads(json.dumps(d)) == d


def test_current_reads_the_environment_once_and_install_replaces_it(monkeypatch):
    monkeypatch.setattr(settings, "_current", None)
    monkeypatch.setenv("DRAFTTREE_GEMM", "0")
    first = current()
    assert first.gemm is False
    monkeypatch.setenv("DRAFTTREE_GEMM", "1")
    assert current() is first   # read once: a later change of the environment is not seen
    mine = Settings(pdl=False)
    assert install(mine) is first and current() is mine
    with using(attn_kernel=False) as inside:
        assert current() is inside and inside == mine.replace(attn_kernel=False)
    assert current() is mine


def test_graph_plan_and_bench_results_show_the_settings(zoo, set_settings):
    from drafttree.bench.environment import environment
    from drafttree.engine.engine import EngineConfig
    from drafttree.engine.plan import describe_plan
    set_settings(gemm=False)
    text = describe_plan(EngineConfig(model=str(zoo("qwen3").target)))
    assert f"settings: {current().describe()}\n" in text and "gemm=off" in text
    # an engine config's deterministic choice is what its engine runs under
    assert "deterministic=on" in describe_plan(EngineConfig(model=str(zoo("qwen3").target), deterministic=True))
    env = environment()
    assert env["settings"] == current().as_dict() and env["kernels"]["few_row_projections"] is False
