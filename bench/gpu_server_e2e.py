"""The server end to end on one device: launch, health, concurrent greedy completions,
a prefix hit, stop by PID.

    python bench/gpu_server_e2e.py                       # CUDA, bf16, page sizes 1 and 16
    python bench/gpu_server_e2e.py --device cpu          # the same on a CPU (float32)

A tiny random Llama (4 heads of 128, 2 KV heads: the head_dim FlashInfer's quick
check builds kernels for) with a tokenizer is made on the spot. For each page size,
``radixserve launch`` starts on a free port; the script then checks:
1. health: ``ok``, with the page size asked for (and on CUDA the backend it chose);
2. eight greedy completions sent at once (48-200 token prompts, 16 new tokens, EOS
   ignored) each give 16 tokens, equal to the same prompts sent one at a time, or
   parting from them only at a near tie: where the lone run's two best tokens are the
   two chosen and their log-probabilities are within 0.125 (bf16, fp16; 1e-3 in
   float32): a batch changes how the kernels split the work, so logits differ by
   rounding, about 2^-8 of their size in bf16;
3. a prompt sharing a 96-token prefix with an earlier one reports cached tokens > 0
   (a whole number of pages, at most the prefix);
4. SIGTERM to the launcher's PID: it exits 0 and its children (scheduler, tokenizer,
   worker) are gone within 30 s.
Exit status 0 when every check passes; each check prints one line.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from radixserve import SamplingParams  # noqa: E402
from radixserve.client import AsyncClient, Client  # noqa: E402

NEW_TOKENS = 16
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
# Greedy runs of one prompt, alone and in a batch, may part only where the top two
# tokens are this close (log-probabilities): a batch changes the kernels' split of
# the work, so the logits differ by rounding, about 2^-8 of their size in bf16.
NEAR_TIE = {"float32": 1e-3, "float64": 1e-9}


def parts_at_near_tie(batched, alone, tie: float) -> bool:
    """Whether ``batched``'s tokens equal ``alone``'s up to a position where ``alone``'s
    two best tokens, the two that were chosen, are within ``tie``."""
    differ = [k for k, (a, b) in enumerate(zip(batched.token_ids, alone.token_ids)) if a != b]
    if not differ:
        return True
    k = differ[0]
    top = alone.logprobs[k].top
    chosen = {batched.token_ids[k], alone.token_ids[k]}
    return {t.token_id for t in top[:2]} == chosen and top[0].logprob - top[1].logprob < tie


def make_model(folder: Path) -> Path:
    from tests.helpers.tiny_models import make_tiny_model

    return make_tiny_model(folder, "llama", seed=3, hidden_size=512, intermediate_size=512,
                           num_attention_heads=4, num_key_value_heads=2)  # fmt: skip


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class Launched:
    """``radixserve launch`` in a child process; its endpoint and pids from its stdout."""

    def __init__(self, model: Path, args: list[str], log: Path) -> None:
        cmd = [sys.executable, "-m", "radixserve.cli", "launch", "--model", str(model),
               "--port", "0", "--log-level", "warning", "--exit-with-parent", *args]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}  # fmt: skip
        with open(log, "w") as err:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                                         env=env, cwd=REPO)  # fmt: skip
        self.endpoint, self.summary, self.pids = "", "", {}
        for line in self.proc.stdout:  # type: ignore[union-attr]
            print("  " + line.rstrip())
            if m := re.search(r"serving on (\S+)", line):
                self.endpoint = m.group(1)
            elif "processes" in line:
                self.pids = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", line)}
                break
            else:
                self.summary = line.strip()
        if not self.endpoint:
            code = self.proc.wait()
            raise RuntimeError(f"the server did not start (exit code {code}); see {log}")

    def stop(self, timeout: float = 30.0) -> tuple[int, list[str]]:
        """SIGTERM to the launcher's PID; its exit code and the children still alive."""
        os.kill(self.proc.pid, signal.SIGTERM)
        code = self.proc.wait(timeout)
        deadline = time.monotonic() + timeout
        while (
            left := [k for k, p in self.pids.items() if alive(p)]
        ) and time.monotonic() < deadline:
            time.sleep(0.1)
        return code, left

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


async def at_once(endpoint: str, prompts: list[list[int]]) -> list:
    async with AsyncClient(endpoint, timeout=300) as client:
        return await asyncio.gather(
            *(client.generate(input_ids=p, sampling_params=GREEDY) for p in prompts)
        )


def check_server(model: Path, args: argparse.Namespace, page_size: int, log: Path) -> list[str]:
    """Run the checks on one server; return the failures."""
    failures: list[str] = []

    def expect(ok: bool, what: str) -> None:
        print(("ok   " if ok else "FAIL ") + what)
        if not ok:
            failures.append(what)

    flags = ["--device", args.device, "--dtype", args.dtype, "--page-size", str(page_size),
             "--num-pages", str(args.num_tokens // page_size), "--max-running-requests", "16",
             "--attention-backend", args.attention_backend]  # fmt: skip
    print(f"\n== page size {page_size}: radixserve launch {' '.join(flags)}")
    t = time.perf_counter()
    server = Launched(model, flags, log)
    print(f"started in {time.perf_counter() - t:.1f} s")
    try:
        with Client(server.endpoint, timeout=300) as client:
            health = client.health()
            expect(health.get("status") == "ok" and health.get("page_size") == page_size,
                   f"health ok, page_size {health.get('page_size')}")  # fmt: skip
            if args.device.startswith("cuda") and args.attention_backend == "auto":
                expect("backend=flashinfer" in server.summary, "backend flashinfer chosen")
            rng = np.random.default_rng(page_size)
            prompts = [rng.integers(4, 500, int(n)).tolist() for n in rng.integers(48, 200, 8)]
            t = time.perf_counter()
            together = asyncio.run(at_once(server.endpoint, prompts))
            dt = time.perf_counter() - t
            expect(all(len(r.token_ids) == NEW_TOKENS for r in together),
                   f"8 concurrent greedy completions of {NEW_TOKENS} tokens in {dt:.2f} s")  # fmt: skip
            client.flush_cache()
            alone = [client.generate(input_ids=p, sampling_params=GREEDY) for p in prompts]
            same = sum(a.token_ids == b.token_ids for a, b in zip(together, alone))
            tie = NEAR_TIE.get(args.dtype, 0.125)
            ties = sum(parts_at_near_tie(a, b, tie) for a, b in zip(together, alone)) - same
            expect(same + ties == len(prompts),
                   f"{same}/{len(prompts)} equal to one at a time, {ties} parting at a near tie"
                   f" (top-2 log-probabilities within {tie})")  # fmt: skip
            prefix = rng.integers(4, 500, 96).tolist()
            first = client.generate(input_ids=prefix + [7, 8, 9], sampling_params=GREEDY)
            second = client.generate(input_ids=prefix + [10, 11], sampling_params=GREEDY)
            hit = second.usage.cached_tokens
            expect(first.usage.cached_tokens == 0 and 0 < hit <= 96 and hit % page_size == 0,
                   f"prefix hit: {hit} cached tokens of a 96-token prefix")  # fmt: skip
    except BaseException:
        server.kill()
        raise
    code, left = server.stop()
    expect(code == 0 and not left, f"stopped by PID {server.proc.pid}: exit {code}, left {left}")
    return failures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on a CPU")
    ap.add_argument("--page-sizes", default="1,16")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--num-tokens", type=int, default=16384, help="KV pool size in tokens")
    ap.add_argument("--log-dir", type=Path, default=None, help="the servers' stderr (default: tmp)")
    args = ap.parse_args(argv)
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    work = Path(tempfile.mkdtemp(prefix="rs-server-e2e-"))
    logs = args.log_dir or work
    logs.mkdir(parents=True, exist_ok=True)
    model = make_model(work / "model")
    failures = []
    for p in (int(x) for x in args.page_sizes.split(",")):
        failures += check_server(model, args, p, logs / f"server_page{p}.log")
    print(f"\nserver end to end: {'PASS' if not failures else f'FAIL ({len(failures)})'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
