"""Decode peers of ``bench/decode.py`` that run in processes of their own, and the plumbing that runs them.

Module level imports the standard library only, so that the same file serves two sides:

* the parent (``bench/decode.py``) calls :func:`hf_peer`, :func:`vllm_peer` or :func:`run_peer`: each
  starts a child, waits for it up to a timeout, and returns its rows per batch and any error (a missing
  vLLM site, a non-zero exit, a timeout: the last lines of its stderr). A peer that fails is a result,
  never a crashed bench; a CUDA device-side assert kills only the child's CUDA context.
* the child, ``python -P bench/decode_peers.py hf|vllm --model DIR ...``, prints one JSON line per batch
  on stdout: ``{"peer", "batch", "step_s", "t1_s", "t65_s"}`` or ``{"peer", "batch", "error"}``.
  ``-P`` keeps ``bench/`` off ``sys.path`` (its ``engine.py``, ``common.py``... shadow nothing then).

Per-token decode time of a peer = (t(65 new tokens) - t(1 new token)) / 64 for ``b`` prompts of
``context`` random token ids (ids 10..vocab, never all zero): the prefill and per-call costs cancel,
what is left is one decode step of batch ``b`` with the peer's own sampling (greedy) and loop.
Each t is the median of ``--repeats`` pairs (1 then 65 tokens, interleaved) after one warm-up pair.

* ``hf``: HF transformers ``model.generate(..., cache_implementation="static", disable_compile=True)``,
  bf16 on ``--device``, sdpa attention (transformers' default); ``--compile`` leaves transformers'
  automatic ``torch.compile`` of a static-cache forward on (what a plain ``generate`` does on CUDA).
  The warm-up asks for 65 tokens first: transformers sizes each call's static cache to the longest
  call so far, so both timed lengths use the same cache. Runs with our environment (PYTHONPATH too).
* ``vllm``: vLLM's offline ``LLM`` (CUDA graphs on, ``enforce_eager=False``; prefix caching off, so
  every call prefills; ``max_num_batched_tokens`` >= b x context, so the prompts prefill in one step and
  the 64 steps that follow are pure batch-b decode steps). Runs with ``PYTHONPATH=<--vllm-site>`` only
  (its pins differ from ours) and imports vllm and the standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

NEW_TOKENS = 65
VLLM_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0"}
STDERR_LINES = 15


# ---------------------------------------------------------------- parent side


def run_peer(name: str, cmd: list[str], env: dict[str, str], timeout_s: float, batches: list[int]) -> dict:
    """Run a peer child (asked for ``batches``) in a session of its own: ``{"batches", "rows": {batch: row},
    "error": str | None, "wall_s"}``.

    On a timeout the child's whole process group is killed (vLLM's engine core is a grandchild that
    would otherwise keep its GPU memory); what it printed before still counts."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    error = None
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # a process outside the group still holds the pipes
            proc.kill()
            out, err = "", ""
        error = f"{name}: timed out after {timeout_s:g} s"
    _kill_group(proc.pid)  # stragglers of a child that exited
    if error is None and proc.returncode != 0:
        error = f"{name}: exit status {proc.returncode}"
    if error:
        tail = [line.strip()[:300] for line in err.strip().splitlines()[-STDERR_LINES:]] or ["(no stderr)"]
        error += f": {tail[-1]} (stderr tail: {' | '.join(tail)})"
        print(error, file=sys.stderr)
    rows = {r["batch"]: r for r in parse_rows(out)}
    if error is None and not rows:
        error = f"{name}: no rows on stdout"
    return {"batches": batches, "rows": rows, "error": error, "wall_s": time.monotonic() - t0}


def merge_results(name: str, results: list[dict]) -> dict:
    """One result of several children of ``name`` (each asked for its own batches, in order): a child
    that gave no row for a batch makes that batch's row its error; the merged ``error`` is set only
    when no child gave a row."""
    rows: dict[int, dict] = {}
    for result in results:
        for b in result["batches"]:
            rows[b] = result["rows"].get(b) or {"peer": name, "batch": b, "error": result["error"] or "no row"}
    errors = [r["error"] for r in results if r["error"]]
    return {"batches": [b for r in results for b in r["batches"]], "rows": rows,
            "error": errors[0] if errors and not any("step_s" in r for r in rows.values()) else None,
            "wall_s": sum(r["wall_s"] for r in results)}


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def parse_rows(stdout: str) -> list[dict]:
    """The JSON rows a child printed (lines of other output are skipped)."""
    rows = []
    for line in stdout.splitlines():
        if not line.startswith("{"):
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and "peer" in row and "batch" in row:
            rows.append(row)
    return rows


def step_or_error(result: dict | None, batch: int) -> tuple[float | None, str | None]:
    """A peer's seconds per decode step at ``batch``, or why there is none (None, None: not asked for)."""
    if result is None or batch not in result["batches"]:
        return None, None
    row = result["rows"].get(batch)
    if row is not None and "step_s" in row:
        return row["step_s"], None
    if row is not None:
        return None, row.get("error", "no step_s")
    return None, result["error"]


def hf_peer(path: Path, batches: list[int], context: int, repeats: int, timeout_s: float, device: str = "cuda",
            compile_: bool = False) -> dict:
    """HF ``generate`` with a static cache, in a child with our environment (see the module docstring)."""
    cmd = [sys.executable, "-P", str(Path(__file__).resolve()), "hf", "--model", str(path), "--batches",
           ",".join(map(str, batches)), "--context", str(context), "--repeats", str(repeats), "--device", device]
    return run_peer("hf_compile" if compile_ else "hf", cmd + (["--compile"] if compile_ else []), dict(os.environ),
                    timeout_s, batches)


def vllm_peer(path: Path, batches: list[int], context: int, repeats: int, timeout_s: float, site: str,
              gpu_memory_utilization: float = 0.5) -> dict:
    """vLLM offline in a child whose PYTHONPATH is ``site`` alone; an error result if vLLM is not there."""
    if not (Path(site) / "vllm").is_dir():
        return {"batches": batches, "rows": {}, "wall_s": 0.0,
                "error": f"vllm: not installed in {site} (stage it with stage-wheels --set vllm)"}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | VLLM_ENV | {"PYTHONPATH": site}
    cmd = [sys.executable, "-P", str(Path(__file__).resolve()), "vllm", "--model", str(path), "--batches",
           ",".join(map(str, batches)), "--context", str(context), "--repeats", str(repeats),
           "--gpu-memory-utilization", str(gpu_memory_utilization)]
    return run_peer("vllm", cmd, env, timeout_s, batches)


# ---------------------------------------------------------------- child side


def emit(peer: str, batch: int, **fields) -> None:
    print(json.dumps({"peer": peer, "batch": batch, **fields}), flush=True)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300] if text else ''}"


def error_text(e: BaseException) -> str:
    """``Type: first line`` of ``e``, then of its root cause when it has one (a compiler's wrapper
    error, ``BackendCompilerFailed: backend='inductor' raised:``, says nothing by itself). The walk is
    ``graphs.capture_failures.root_cause``'s, written here because this module imports the standard
    library only (the vLLM child cannot import ours)."""
    root, seen = e, {id(e)}
    while root.__context__ is not None and id(root.__context__) not in seen:
        root = root.__context__
        seen.add(id(root))
    return _first_line(e) if root is e else f"{_first_line(e)} <- {_first_line(root)}"


def per_token(gen: Callable[[int], None], repeats: int, sync: Callable[[], None]) -> dict:
    """``step_s`` = (median t(65) - median t(1)) / 64 of ``gen(n)`` (generate n new tokens), after a
    warm-up of 65 then 1."""
    gen(NEW_TOKENS)
    gen(1)
    times: dict[int, list[float]] = {1: [], NEW_TOKENS: []}
    for _ in range(repeats):
        for n in times:
            sync()
            t = time.perf_counter()
            gen(n)
            sync()
            times[n].append(time.perf_counter() - t)
    t1, t65 = statistics.median(times[1]), statistics.median(times[NEW_TOKENS])
    return {"step_s": (t65 - t1) / (NEW_TOKENS - 1), "t1_s": t1, "t65_s": t65}


def random_prompts(b: int, context: int, vocab: int) -> list[list[int]]:
    g = random.Random(b)
    return [[g.randrange(10, vocab) for _ in range(context)] for _ in range(b)]


def hf_child(args: argparse.Namespace) -> None:
    import torch
    import transformers

    peer = "hf_compile" if args.compile else "hf"
    device = torch.device(args.device)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).to(device).eval()
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    for b in args.batches:
        try:
            ids = torch.tensor(random_prompts(b, args.context, model.config.vocab_size), device=device)

            def gen(n: int) -> None:
                with torch.no_grad():
                    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                         do_sample=False, cache_implementation="static",
                                         disable_compile=not args.compile, pad_token_id=0)
                assert out.shape == (b, args.context + n), out.shape

            emit(peer, b, **per_token(gen, args.repeats, sync), attn=getattr(model.config, "_attn_implementation", ""))
            if device.type == "cuda":
                torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001 - a failing batch is a row (an OOM at 256 on 8B, say)
            emit(peer, b, error=error_text(e))


def vllm_child(args: argparse.Namespace) -> None:
    from vllm import LLM, SamplingParams

    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    llm = LLM(model=args.model, skip_tokenizer_init=True, dtype="bfloat16",
              gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.context + 128 + 16,
              enforce_eager=False, enable_prefix_caching=False, max_num_seqs=max(256, *args.batches),
              max_num_batched_tokens=max(8192, max(args.batches) * (args.context + 1)))
    for b in args.batches:
        try:
            prompts = [{"prompt_token_ids": ids} for ids in random_prompts(b, args.context, vocab)]

            def gen(n: int) -> None:
                params = SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0)
                outs = llm.generate(prompts, params, use_tqdm=False)
                assert [len(o.outputs[0].token_ids) for o in outs] == [n] * b

            emit("vllm", b, **per_token(gen, args.repeats, lambda: None))
        except Exception as e:  # noqa: BLE001
            emit("vllm", b, error=error_text(e))


def main() -> None:
    ap = argparse.ArgumentParser(description="one decode peer in a process of its own (run by bench/decode.py)")
    ap.add_argument("peer", choices=["hf", "vllm"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], required=True)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda", help="hf only")
    ap.add_argument("--compile", action="store_true", help="hf only: leave transformers' auto torch.compile on")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5, help="vllm only")
    args = ap.parse_args()
    hf_child(args) if args.peer == "hf" else vllm_child(args)


if __name__ == "__main__":
    main()
