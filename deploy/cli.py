"""The ``graphfleet`` command line: ``make-checkpoint``, ``generate``, ``demo``, ``profile export``, ``serve``,
``drain``.

No work happens at import time; every subcommand imports what it needs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time

from deploy.ray_cluster import (
    check_reachable,
    direct_ingress_env,
    init_ray,
    join,
    proxy_port,
    ray_address,
)


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML config file (default: the packaged default.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set graphs.decode.backend=eager (repeatable)")


def _load_config(args: argparse.Namespace, extra: list[str]):
    from deploy.config import load_config

    return load_config(args.config, [*extra, *args.set])


def _token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise SystemExit(f"--prompt-ids expects comma-separated integers, got {text!r}") from None


def cmd_make_checkpoint(args: argparse.Namespace) -> int:
    from worker.checkpoint import PRESETS, write_checkpoint

    if args.preset not in PRESETS:
        raise SystemExit(f"unknown preset {args.preset!r}; available: {', '.join(sorted(PRESETS))}")
    if args.train_steps < 0:
        raise SystemExit(f"--train-steps must be >= 0, got {args.train_steps}")
    if not args.train_lr > 0:
        raise SystemExit(f"--train-lr must be > 0, got {args.train_lr}")
    start = time.perf_counter()
    if not args.train_steps:
        out = write_checkpoint(args.preset, args.out, seed=args.seed, dtype=args.dtype)
        print(f"wrote {args.preset} to {out} in {time.perf_counter() - start:.1f}s")
        return 0
    import shutil
    from pathlib import Path

    import torch

    from worker.checkpoint.train import train_checkpoint

    dst = Path(args.out)
    if (dst / "config.json").is_file():
        raise SystemExit(f"{dst} holds a checkpoint already; give another --out")
    random_dir = dst.with_name(dst.name + ".random")
    shutil.rmtree(random_dir, ignore_errors=True)
    write_checkpoint(args.preset, random_dir, seed=args.seed, dtype=args.dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"training {args.preset} on the bundled corpus for {args.train_steps} steps on {device} ...", flush=True)
    try:
        out = train_checkpoint(random_dir, dst, steps=args.train_steps, device=device, seed=args.seed,
                               lr=args.train_lr)
    except RuntimeError as e:
        raise SystemExit(str(e)) from None
    finally:
        shutil.rmtree(random_dir, ignore_errors=True)
    print(f"wrote {args.preset}, trained for {args.train_steps} steps, to {out} in {time.perf_counter() - start:.1f}s")
    return 0


def _sampling_params(args: argparse.Namespace):
    from worker.sampling.params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, seed=args.seed, ignore_eos=args.ignore_eos,
                          stop=tuple(args.stop))


def cmd_generate(args: argparse.Namespace) -> int:
    from worker.engine import Engine

    prompts: list = list(args.prompt) + [_token_ids(t) for t in args.prompt_ids]
    if not prompts:
        raise SystemExit("give at least one --prompt TEXT or --prompt-ids 1,2,3")
    params = _sampling_params(args)
    engine = Engine(_load_config(args, [f"model.path={args.model}"]))
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    for out in outputs:
        if args.output == "json":
            print(json.dumps({"request_id": out.request_id, "prompt_token_ids": out.prompt_token_ids,
                              "token_ids": out.token_ids, "text": out.text,
                              "finish_reason": out.finish_reason}))
        else:
            print(f"[{out.request_id}] {out.text!r} ({len(out.token_ids)} tokens, {out.finish_reason})")
    if args.output != "json":
        n = sum(len(o.token_ids) for o in outputs)
        print(f"{n} tokens in {elapsed:.2f}s: {n / elapsed:.1f} tokens/s")
    if args.profile_out:
        engine.worker.profile().save(args.profile_out)
    return 0


def cmd_profile_export(args: argparse.Namespace) -> int:
    """Replay a request trace (or the built-in skewed one) and write the batch-shape profile."""
    from worker.engine import Engine
    from worker.traces import load_trace, run_trace, skewed_trace

    trace = load_trace(args.trace) if args.trace else skewed_trace(args.requests, seed=args.seed)
    engine = Engine(_load_config(args, [f"model.path={args.model}"]))
    steps = run_trace(engine, trace, seed=args.seed)
    profile = engine.worker.profile()
    profile.save(args.out)
    print(f"replayed {len(trace)} requests in {steps} steps; wrote {profile.decode_steps} decode and "
          f"{profile.prefill_steps} prefill step shapes to {args.out}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """A small batch generation in this process (one local engine: no Ray, no server) that prints
    throughput; ``make run`` serves instead (:func:`cmd_serve`)."""
    import torch

    from worker.engine import Engine
    from worker.sampling.params import SamplingParams

    engine = Engine(_load_config(args, [f"model.path={args.model}"]))
    if engine.worker.device.type == "cpu":
        logging.getLogger("graphfleet").info(
            "no CUDA device: CUDA graphs are off, running eager on CPU (torch %s)", torch.__version__)
    prompts = [f"Request {i}: the fleet of graphs sails at dawn and" for i in range(args.batch)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.8, top_p=0.95, seed=1, ignore_eos=True)
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    for out in outputs[:3]:
        print(f"[{out.request_id}] {out.text[:80]!r}")
    n = sum(len(o.token_ids) for o in outputs)
    print(f"{len(outputs)} requests, {n} tokens in {elapsed:.2f}s: {n / elapsed:.1f} tokens/s "
          f"on {engine.worker.device} ({engine.worker.attention.name} attention)")
    return 0


def _wait_healthy(url: str, timeout_s: float) -> None:
    """Poll the app's ``/health`` until 200; SystemExit with its body if the fleet died or time ran out."""
    import urllib.error
    import urllib.request

    end, body = time.monotonic() + timeout_s, ""
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(url, timeout=10):
                return
        except urllib.error.HTTPError as e:
            body = e.read().decode(errors="replace")
            if '"dead"' in body:
                raise SystemExit(f"graphfleet serve: the fleet failed to start: {body}") from None
        except OSError as e:
            body = str(e)
        time.sleep(0.5)
    raise SystemExit(f"graphfleet serve: not healthy after {timeout_s:g}s: {body}")


#: The Serve application name of ``graphfleet serve`` (and of the Helm chart's serveConfigV2).
APP_NAME = "graphfleet"


class _Stop(BaseException):
    """Raised in the main thread by SIGTERM or SIGINT: stop serving (a BaseException, like KeyboardInterrupt,
    so no ``except Exception`` swallows it)."""


def _raise_stop(signum, frame) -> None:
    raise _Stop(signal.Signals(signum).name)


def _on_stop_signals(handler) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)


def _drain_app(timeout_s: float | None, wait_s: float) -> dict:
    """Drain the app's replica (:meth:`deploy.serve_app.OpenAIIngress.drain`) and wait for it, at most ``wait_s``."""
    from ray import serve

    handle = serve.get_deployment_handle("OpenAIIngress", app_name=APP_NAME)
    return handle.drain.remote(timeout_s).result(timeout_s=wait_s)


def cmd_serve(args: argparse.Namespace) -> int:
    """Start a local Ray (or join ``--ray-address``/``RAY_ADDRESS``), the fleet and the OpenAI-compatible
    API; serve until SIGTERM or Ctrl-C, then drain (:meth:`deploy.serve_app.OpenAIIngress.drain`: new
    requests 503, in-flight ones get ``serve.drain_timeout_s``, the rest aborted, every rank released),
    shut Serve and Ray down and return 0. A second signal stops without waiting for the drain."""
    address = ray_address(args.ray_address)
    if address is not None:
        check_reachable(address)  # first: in seconds, before the slow imports below
    import ray
    from ray import serve

    from deploy.serve_app import SHUTDOWN_MARGIN_S, build_config, deployment

    config = build_config({"config": args.config, "model": args.model, "overrides": args.set, "host": args.host,
                           "port": args.port, "api_key": args.api_key})
    if config.model.path is None:
        raise SystemExit("give --model DIR (or model.path in --config)")
    host, port = config.serve.host, config.serve.port
    log = logging.getLogger("graphfleet")
    _on_stop_signals(_raise_stop)
    deployed = False
    direct = config.serve.direct_ingress and address is None
    if config.serve.direct_ingress and address is not None:
        log.info("serve.direct_ingress is for a Ray this command starts; the cluster at %s decides it in its "
                 "own environment (RAY_SERVE_ENABLE_DIRECT_INGRESS)", address)
    if direct:
        os.environ.update(direct_ingress_env(port))
    try:
        try:
            context = init_ray(address, host)
            _on_stop_signals(_raise_stop)  # ray.init installs its own SIGTERM handler (sys.exit)
            log.info("%s Ray (GCS %s)", "joined the" if address else "started a local",
                     context.address_info.get("gcs_address"))
            if not ray.cluster_resources().get("GPU", 0):
                log.info("no CUDA device in the Ray cluster: CUDA graphs are off and the model runs eagerly on "
                         "CPU (graphs.*.backend full/breakable need CUDA; graphs.debug=true runs the runner path "
                         "on CPU)")
            log.info("starting the fleet: load %s, size the KV cache, capture graphs, then serve on %s:%d",
                     config.model.path, host, port)
            # With direct ingress the replica takes host:port and Serve's proxy a free loopback port.
            serve.start(http_options={"host": "127.0.0.1", "port": proxy_port(port)} if direct else
                        {"host": host, "port": port})
            serve.run(deployment(config).bind(config.to_dict(), {}), name=APP_NAME, route_prefix="/",
                      blocking=False)
            deployed = True
            from pathlib import Path

            shown = "127.0.0.1" if host == "0.0.0.0" else host
            _wait_healthy(f"http://{shown}:{port}/health", config.cluster.start_timeout_s + 60)
            name = config.serve.model_name or Path(config.model.path).name
            auth = f" -H 'Authorization: Bearer {config.serve.api_key}'" if config.serve.api_key else ""
            from worker.checkpoint.train import try_prompt

            body = json.dumps({"model": name, "prompt": try_prompt(Path(config.model.path)) or "Hello",
                               "max_tokens": 16, "temperature": 0})
            print(f"graphfleet serving {name!r} at http://{shown}:{port}/v1 (Ctrl-C stops). Try:\n"
                  f"  curl http://{shown}:{port}/v1/completions -H 'Content-Type: application/json'{auth} "
                  f"-d '{body}'", flush=True)
            while True:
                time.sleep(3600)
        except _Stop as stop:
            if not deployed:
                log.info("%s: stopping", stop)
                return 0
            log.info("%s: draining (at most %gs for requests in flight; a second signal stops at once)", stop,
                     config.serve.drain_timeout_s)
            try:
                log.info("drained: %s", _drain_app(None, config.serve.drain_timeout_s + SHUTDOWN_MARGIN_S))
            except _Stop:
                log.warning("second signal: stopping without waiting for the drain")
            except Exception as e:  # noqa: BLE001 - reported, then Serve and Ray are shut down all the same
                log.error("the drain failed: %s: %s", type(e).__name__, e)
                return 1
        return 0
    finally:
        _on_stop_signals(signal.SIG_IGN)  # the shutdown below is bounded; a signal now would only cut it short
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()


def cmd_drain(args: argparse.Namespace) -> int:
    """Drain a running app's replica (the Helm chart's preStop): connect to the Ray cluster, call
    :meth:`deploy.serve_app.OpenAIIngress.drain` through a deployment handle, print what it did."""
    import ray

    address = ray_address(args.ray_address) or "auto"
    check_reachable(address)
    join(address, log_to_driver=False)
    try:
        print(json.dumps(_drain_app(args.timeout, args.wait_s)), flush=True)
    finally:
        ray.shutdown()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="graphfleet", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-checkpoint", help="write an HF-format checkpoint: random weights, or trained on the "
                                               "bundled corpus (--train-steps)")
    p.add_argument("--preset", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--train-steps", type=int, default=0,
                   help="train on the bundled corpus for this many steps of 32 windows of 128 tokens (HF "
                        "transformers, fp32; for small presets: tiny-llama continues the corpus's lines after "
                        "about 300, three minutes on 2 CPU cores)")
    p.add_argument("--train-lr", type=float, default=8e-3, help="peak learning rate (one-cycle schedule)")
    p.set_defaults(func=cmd_make_checkpoint)

    p = sub.add_parser("generate", help="one-shot batched generation")
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    p.add_argument("--prompt-ids", action="append", default=[], help="prompt token ids, e.g. 1,2,3 (repeatable)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--output", choices=["text", "json"], default="text")
    p.add_argument("--profile-out", help="write the batch-shape profile of this run (JSON) for graphs.profile")
    _config_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("profile", help="batch-shape profiles for profile-guided graph ladders")
    psub = p.add_subparsers(dest="profile_command", required=True)
    e = psub.add_parser("export", help="replay a request trace and write its batch-shape profile (JSON)")
    e.add_argument("--model", required=True)
    e.add_argument("--trace", help="JSONL rows {prompt_len, max_tokens, arrival_step}; default: a skewed synthetic one")
    e.add_argument("--requests", type=int, default=400, help="size of the synthetic trace")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--out", required=True)
    _config_args(e)
    e.set_defaults(func=cmd_profile_export)

    p = sub.add_parser("demo", help="small batch generation printing tokens/s")
    p.add_argument("--model", required=True)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    _config_args(p)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP API on Ray Serve (a local Ray of its own by default)")
    p.add_argument("--model", help="checkpoint directory (default: model.path of --config)")
    p.add_argument("--host", help="listen address (default: serve.host, 127.0.0.1)")
    p.add_argument("--port", type=int, help="listen port (default: serve.port, 8000)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: serve.api_key)")
    p.add_argument("--ray-address", help="join the Ray cluster at HOST:PORT (or 'auto') instead of starting a "
                                         "local one (default: $RAY_ADDRESS, else a local Ray of its own)")
    _config_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("drain", help="drain the running app's replica: new requests 503, in-flight ones finish "
                                     "(up to serve.drain_timeout_s), every rank released (a preStop hook)")
    p.add_argument("--ray-address", help="the Ray cluster (default: $RAY_ADDRESS, else 'auto': the one on this "
                                         "machine)")
    p.add_argument("--timeout", type=float, help="seconds requests in flight get (default: the app's "
                                                 "serve.drain_timeout_s)")
    p.add_argument("--wait-s", type=float, default=600.0, help="give up waiting for the drain after this long")
    p.set_defaults(func=cmd_drain)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from deploy.config import ConfigError
    from graphs.profile import ProfileError
    from worker.model.arch import CheckpointError
    from worker.request import RequestRejected
    from worker.sampling.params import SamplingParamsError

    try:
        return args.func(args)
    except (ConfigError, CheckpointError, RequestRejected, SamplingParamsError, ProfileError) as e:
        print(f"graphfleet {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
