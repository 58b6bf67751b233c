"""The CPU-testable parts of the GPU check (docs/gpu.md, "Checking a GPU install"):
carrying a file in parts, the decode bandwidth script's byte accounting, and the tier
script's usage and dry run."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"


def load(name: str):
    sys.path.insert(0, str(REPO))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


carry = load("carry_parts")


def test_split_stash_join_round_trip(tmp_path):
    data = bytes(range(256)) * 1000 + b"tail"  # 256004 bytes: 3 parts of 100000 and a short one
    src = tmp_path / "model.tar"
    src.write_bytes(data)
    manifest = carry.split(src, tmp_path / "parts", 100_000)
    assert [p["size"] for p in manifest["parts"]] == [100_000, 100_000, 56_004]
    assert manifest["size"] == len(data)
    # Carried over two commands: the first brings parts 0 and 2, the second part 1.
    first, second, store = tmp_path / "c1", tmp_path / "c2", tmp_path / "store"
    for folder, parts in ((first, ("000", "002")), (second, ("001",))):
        folder.mkdir()
        (folder / "model.tar.parts.json").write_bytes(
            (tmp_path / "parts" / "model.tar.parts.json").read_bytes()
        )
        for p in parts:
            (folder / f"model.tar.{p}").write_bytes(
                (tmp_path / "parts" / f"model.tar.{p}").read_bytes()
            )
    assert carry.stash(first, store) == {"model.tar": ["model.tar.001"]}
    dest = tmp_path / "out" / "model.tar"
    assert carry.join(store, "model.tar", dest) == ["model.tar.001"]
    assert not dest.exists()
    assert carry.stash(second, store) == {"model.tar": []}
    assert carry.join(store, "model.tar", dest) == []
    assert dest.read_bytes() == data


def test_a_damaged_part_is_refused(tmp_path):
    src = tmp_path / "f.bin"
    src.write_bytes(b"x" * 1000)
    carry.split(src, tmp_path / "parts", 300)
    part = tmp_path / "parts" / "f.bin.001"
    part.write_bytes(b"y" * 300)
    with pytest.raises(ValueError, match="does not match"):
        carry.stash(tmp_path / "parts", tmp_path / "store")
    # A part that passed the stash but changed in the store: the whole-file hash catches it.
    carry.split(src, tmp_path / "good", 300)
    carry.stash(tmp_path / "good", tmp_path / "store2")
    (tmp_path / "store2" / "f.bin.003").write_bytes(b"z" * 100)
    with pytest.raises(ValueError, match="do not match"):
        carry.join(tmp_path / "store2", "f.bin", tmp_path / "f.out")
    assert not (tmp_path / "f.out").exists()
    assert list(tmp_path.glob("f.out*")) == []


def test_carry_parts_cli(tmp_path):
    src = tmp_path / "a.bin"
    src.write_bytes(b"abc" * 1000)
    run = [sys.executable, str(BENCH / "carry_parts.py")]
    subprocess.run([*run, "split", str(src), str(tmp_path / "p"), "--parts", "3"], check=True)
    manifest = json.loads((tmp_path / "p" / "a.bin.parts.json").read_text())
    assert [p["size"] for p in manifest["parts"]] == [1000, 1000, 1000]
    (tmp_path / "p" / "a.bin.002").rename(tmp_path / "later")
    subprocess.run([*run, "stash", str(tmp_path / "p"), str(tmp_path / "s")], check=True)
    got = subprocess.run([*run, "join", str(tmp_path / "s"), "a.bin", str(tmp_path / "a.out")])
    assert got.returncode == carry.MISSING
    (tmp_path / "later").rename(tmp_path / "p" / "a.bin.002")
    subprocess.run([*run, "stash", str(tmp_path / "p"), str(tmp_path / "s")], check=True)
    subprocess.run(
        [*run, "join", str(tmp_path / "s"), "a.bin", str(tmp_path / "a.out")], check=True
    )
    assert (tmp_path / "a.out").read_bytes() == src.read_bytes()


@pytest.mark.parametrize("tied", [False, True])
def test_decode_bw_counts_the_model_parameters(tied):
    import transformers

    bw = load("gpu_decode_bw")
    shape = bw.LlamaShape(**{**bw.TINY.__dict__, "tied": tied})
    model = transformers.AutoModelForCausalLM.from_config(shape.config())
    assert shape.parameters() == sum(p.numel() for p in model.parameters())
    got = bw.step_bytes(shape, [10, 20, 30], elem=2, kv_elem=1)
    table = shape.vocab * shape.hidden * 2
    rows = 3 * shape.hidden * 2
    assert got["weights"] == shape.parameters() * 2 - (0 if tied else table) + rows
    per_token = shape.layers * 2 * shape.kv_heads * shape.head_dim  # 1-byte KV
    assert got["kv_read"] == per_token * (11 + 21 + 31)
    assert got["kv_write"] == per_token * 3


def test_decode_bw_runs_on_cpu_tiny(capsys):
    bw = load("gpu_decode_bw")
    argv = ["--device", "cpu", "--tiny", "--dtype", "float32", "--batches", "2",
            "--contexts", "16", "--steps", "2", "--copy-mib", "8", "--sync-debug"]  # fmt: skip
    assert bw.main(argv) == 0
    out = capsys.readouterr().out
    row = re.search(r"^\|\s+2 \|\s+16 \|([^\n]*)$", out, re.M)
    assert row, out
    ms, weights_mb, kv_mb, _, share = (c.strip() for c in row.group(1).strip(" |").split("|"))
    s = bw.TINY
    weights = (s.parameters() - s.vocab * s.hidden + 2 * s.hidden) * 4
    per_token = s.layers * 2 * s.kv_heads * s.head_dim * 4
    # Two timed steps after a registering step, a warm step and three sync-checked ones:
    # each request holds 21, then 22 tokens before them (it reads one more, writes one).
    kv = per_token * ((22 + 22) + (23 + 23) + 2 * 2) / 2
    assert float(weights_mb) == pytest.approx(weights / 1e6, abs=1e-3)
    assert float(kv_mb) == pytest.approx(kv / 1e6, abs=1e-3)
    assert float(ms) > 0 and share.endswith("%")


def check_sh(*args: str, out: Path) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "OUT": str(out), "PYTHON": sys.executable}
    return subprocess.run(["bash", str(BENCH / "gpu_check.sh"), *args], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=60)  # fmt: skip


def tier_budgets(usage: str) -> dict[str, str]:
    """The usage table: tier -> budget cell."""
    return dict(re.findall(r"^([a-z0-9-]+)\s+(<?\d+ min|>\d+ h)\s", usage, re.M))


def test_every_tier_states_a_budget_within_one_command(tmp_path):
    got = check_sh("--help", out=tmp_path)
    assert got.returncode == 0
    budgets = tier_budgets(got.stdout)
    assert set(budgets) >= {"stage", "quick", "serve", "parity", "all"}
    for tier, budget in budgets.items():
        if tier != "all":
            assert re.fullmatch(r"<?\d+ min", budget) and int(budget.strip("<").split()[0]) <= 9
    docs = (REPO / "docs" / "gpu.md").read_text()
    for tier in budgets:
        assert f"bash bench/gpu_check.sh {tier}" in docs, tier
    bad = check_sh("nonsense", out=tmp_path)
    assert bad.returncode == 2 and "unknown tier" in bad.stderr


def test_dry_run_prints_the_tier_and_runs_nothing(tmp_path):
    got = check_sh("--dry-run", "quick", out=tmp_path)
    assert got.returncode == 0, got.stdout + got.stderr
    commands = [line for line in got.stdout.splitlines() if line.startswith("+ ")]
    for page in (1, 16):
        assert any("check_flashinfer" in c and f"--page-size {page} " in c for c in commands)
        decode = [c for c in commands if "gpu_decode_bw.py" in c and f"--page-size {page} " in c]
        assert len(decode) == 2 and all("--sync-debug" in c for c in decode)
        assert sum("--disable-cuda-graph" in c for c in decode) == 1
    assert "MAX_JOBS=16" in got.stdout and "FLASHINFER_CUDA_ARCH_LIST=" in got.stdout
    assert "dry run, nothing ran" in got.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_check_quick.log"]


COLLECT = """
import sys, pytest
from _pytest.mark import KeywordMatcher
from _pytest.mark.expression import Expression

class Items:
    def pytest_collection_modifyitems(self, items):
        self.items = list(items)

c = Items()
pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", sys.argv[1]], plugins=[c])
for expr in sys.argv[2:]:
    e = Expression.compile(expr)
    print("TIER", expr, "|".join(i.nodeid for i in c.items if e.evaluate(KeywordMatcher.from_item(i))))
print("ALL", "|".join(i.nodeid for i in c.items))
"""


def test_each_gpu_test_is_in_exactly_one_tier(tmp_path):
    got = check_sh("--dry-run", "all", out=tmp_path)
    exprs = re.findall(r"test_flashinfer_gpu\.py .* -k (.*)$", got.stdout, re.M)
    assert len(exprs) >= 7
    run = subprocess.run([sys.executable, "-c", COLLECT, "tests/worker/test_flashinfer_gpu.py",
                          *exprs], capture_output=True, text=True, cwd=REPO, timeout=120)  # fmt: skip
    lines = run.stdout.splitlines()
    every = next(line for line in lines if line.startswith("ALL ")).split(" ", 1)[1].split("|")
    chosen = [line.rsplit(" ", 1)[1].split("|") for line in lines if line.startswith("TIER ")]
    assert len(chosen) == len(exprs) and all(c != [""] for c in chosen)
    flat = [node for c in chosen for node in c]
    assert sorted(flat) == sorted(every) and len(every) > 50


def test_stage_tier_stashes_the_parts_carried_over_two_commands(tmp_path):
    """The device's flow: each command's checkout copy brings one part; the store keeps
    them across commands until the file can be joined."""
    import shutil

    data = bytes(range(256)) * 600
    (tmp_path / "model.tar").write_bytes(data)
    carry.split(tmp_path / "model.tar", tmp_path / "parts", 60_000)  # 3 parts
    store = tmp_path / "store"
    for part in ("000", "001"):
        checkout = tmp_path / f"checkout{part}"
        (checkout / "bench").mkdir(parents=True)
        (checkout / ".carry").mkdir()
        for name in ("gpu_check.sh", "carry_parts.py"):
            shutil.copy(BENCH / name, checkout / "bench" / name)
        for name in ("model.tar.parts.json", f"model.tar.{part}"):
            shutil.copy(tmp_path / "parts" / name, checkout / ".carry" / name)
        env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"), "PYTHON": sys.executable,
               "GPU_CHECK_SITE": str(tmp_path / "site"), "GPU_CHECK_STORE": str(store)}  # fmt: skip
        got = subprocess.run(["bash", str(checkout / "bench" / "gpu_check.sh"), "stage"],
                             capture_output=True, text=True, env=env, timeout=60)  # fmt: skip
        assert got.returncode == 0, got.stdout + got.stderr
        assert "tier stage: PASS" in got.stdout
    assert "model.tar: missing model.tar.002" in got.stdout
    assert carry.join(store, "model.tar", tmp_path / "joined") == ["model.tar.002"]
    shutil.copy(tmp_path / "parts" / "model.tar.002", store / "model.tar.002")
    assert carry.join(store, "model.tar", tmp_path / "joined") == []
    assert (tmp_path / "joined").read_bytes() == data
