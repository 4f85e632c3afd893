"""`pagewalk serve ...` (the HTTP server) and `pagewalk loadtest ...` (forwarded to loadtest.cli)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

logger = logging.getLogger("pagewalk")

API_KEY_ENV = "PAGEWALK_API_KEY"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagewalk", description="paged-KV decode inference microserver")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("loadtest", help="load generator (see `pagewalk loadtest --help`)", add_help=False)
    s = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    s.add_argument("--model", default="tiny", help="tiny | bench | PATH to a checkpoint directory")
    s.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    s.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    s.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    kv = s.add_mutually_exclusive_group()
    kv.add_argument("--num-blocks", type=int, default=None, help="KV cache size in blocks")
    kv.add_argument("--kv-cache-memory", type=float, default=None,
                    help="KV cache size as a fraction of free device memory (e.g. 0.9)")
    s.add_argument("--max-num-seqs", type=int, default=64, help="sequences in one decode batch")
    s.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens in one engine step")
    s.add_argument("--max-waiting", type=int, default=1024, help="queued requests before 429")
    s.add_argument("--max-model-len", type=int, default=None, help="prompt + completion tokens per sequence")
    s.add_argument("--attention-backend", default="auto", choices=["auto", "triton", "torch"])
    s.add_argument("--no-prefix-caching", action="store_true", help="disable prefix-cache block reuse")
    s.add_argument("--enforce-eager", action="store_true", help="no CUDA-graph decode (eager kernels only)")
    s.add_argument("--engine-in-process", action="store_true",
                   help="run the engine core on a thread of the API process instead of its own process")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV})")
    s.add_argument("--max-body-bytes", type=int, default=None, help="request body limit (413 above it)")
    s.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds in-flight requests may take to finish on SIGTERM before they are aborted")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["loadtest"]:
        from loadtest.cli import main as loadtest_main

        return loadtest_main(argv[1:]) or 0
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return serve(args)


def engine_config(args: argparse.Namespace):
    from server.engine.engine import EngineConfig

    return EngineConfig(
        model=args.model, device=args.device, dtype=None if args.dtype == "auto" else args.dtype,
        block_size=args.block_size, num_blocks=args.num_blocks, kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_waiting=args.max_waiting, max_model_len=args.max_model_len,
        attention_backend=args.attention_backend, enable_prefix_caching=not args.no_prefix_caching,
        enforce_eager=args.enforce_eager)


def startup_line(engine, url: str) -> str:
    kv = engine.health()["kv_cache"]
    capacity = (kv["free_blocks"] + kv["used_blocks"]) * kv["block_size"]
    dtype = str(engine.dtype).removeprefix("torch.")
    return (f"pagewalk serving model={engine.model_name} device={engine.device} dtype={dtype} "
            f"attention_backend={engine.attention_backend} max_model_len={engine.max_model_len} "
            f"kv_cache={capacity} tokens ({kv['num_blocks']} blocks x {kv['block_size']}) url={url}")


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from server.api.app import create_app, stop_engine
    from server.api.limits import DEFAULT_MAX_BODY_BYTES
    from server.api.async_engine import AsyncEngine
    from server.engine.core_client import CoreStartupError

    class GracefulServer(uvicorn.Server):
        """On SIGTERM/SIGINT the engine drains first (in-flight requests finish, or are aborted with
        finish_reason "abort" after --shutdown-timeout), then uvicorn closes connections and exits."""

        async def shutdown(self, sockets=None) -> None:
            await stop_engine(self.config.app)
            await super().shutdown(sockets)

    try:
        engine = AsyncEngine(engine_config(args), in_process=args.engine_in_process, log_level=args.log_level)
    except CoreStartupError as e:
        logger.error("%s", e)
        return 1
    max_body_bytes = args.max_body_bytes or DEFAULT_MAX_BODY_BYTES
    app = create_app(engine, api_key=args.api_key, max_body_bytes=max_body_bytes,
                     shutdown_timeout_s=args.shutdown_timeout)
    logger.info(startup_line(engine, f"http://{args.host}:{args.port}"))
    logger.info("prefix caching %s; bearer-token auth on /v1/* %s",
                "off" if args.no_prefix_caching else "on", "required" if args.api_key else "off")
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=int(args.shutdown_timeout) + 5, access_log=False)
    # uvicorn re-raises the signal it shut down on once it is done; a graceful stop is a clean exit (0)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server = GracefulServer(config)

    def core_died(reason: str) -> None:  # in-flight requests have their error; a supervisor restarts us
        logger.error("%s: stopping the server", reason)
        server.should_exit = True

    engine.on_core_death = core_died
    server.run()
    return 1 if engine.dead is not None else 0


if __name__ == "__main__":
    sys.exit(main())
