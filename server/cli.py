"""`pagewalk serve [MODEL] ...` (the HTTP server) and `pagewalk loadtest ...` (forwarded to loadtest.cli).

Flag names follow `vllm serve` where vLLM has the concept; where pagewalk's meaning or default differs, the
flag's help says so.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import re
import signal
import sys
import threading
from decimal import Decimal
from typing import NoReturn

logger = logging.getLogger("pagewalk")

TOOL_CALL_PARSERS = ("hermes", "llama3_json")  # server/api/tool_calls.py PARSERS (cli imports no API module)
API_KEY_ENV = "PAGEWALK_API_KEY"
DTYPES = ["auto", "half", "float16", "bfloat16", "bf16", "float", "float32"]


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default unless it is None (the help then says what None means)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or isinstance(action, RetiredFlag):
            return action.help or ""
        return super()._get_help_string(action)


class RetiredFlag(argparse.Action):
    """A flag pagewalk no longer takes: using it is an error that names its replacement."""

    def __init__(self, option_strings, dest, replacement: str, **kwargs):
        self.replacement = replacement
        super().__init__(option_strings, dest, default=None, help=f"retired: use {replacement}", **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is retired: use {self.replacement}")


def fraction(value: str) -> float:
    x = float(value)
    if not 0.0 < x <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a fraction in (0, 1], got {value}")
    return x


def json_list(value: str) -> list[str]:
    """An argparse type: a JSON list of strings (vLLM's spelling of --allowed-origins and its kin)."""
    try:
        items = json.loads(value)
    except json.JSONDecodeError:
        items = None
    if not (isinstance(items, list) and all(isinstance(x, str) for x in items)):
        raise argparse.ArgumentTypeError(f'expected a JSON list of strings such as \'["*"]\', got {value!r}')
    return items


def positive_int(value: str) -> int:
    """An argparse type: an integer >= 1 (a 0 or a negative count would start a server that serves
    nothing: every request hangs, is refused or gets a 429)."""
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return n


_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kmgKMG]?)")
_HUMAN_SCALE = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def model_len(value: str) -> int:
    """An argparse type: --max-model-len, in vLLM's spellings (1k = 1000, 1K = 1024, 25.6k = 25,600), at
    least 2 tokens (a prompt of one token, BOS, and one generated: a length of 1 serves nothing)."""
    match = _HUMAN_INT.fullmatch(value.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"expected a token count such as 4096, 32k or 32K, got {value!r}")
    n = Decimal(match.group(1)) * _HUMAN_SCALE[match.group(2)]  # exact: 1.1k is 1,100
    if n != int(n) or n < 2:
        raise argparse.ArgumentTypeError(f"must be a whole number of tokens >= 2, got {value!r}")
    return int(n)


def model_name(value: str) -> str:
    """An argparse type: a --served-model-name, not empty (an id no client can send or fetch)."""
    if not value.strip():
        raise argparse.ArgumentTypeError("a served model name must not be empty")
    return value


MAX_NUM_SEQS = 65536  # per-row state on the device and the host: 10**8 rows never finished starting (review)


def batch_size(value: str) -> int:
    """An argparse type: --max-num-seqs, an integer in [1, MAX_NUM_SEQS]."""
    n = positive_int(value)
    if n > MAX_NUM_SEQS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_NUM_SEQS}, got {value}")
    return n


def positive_seconds(value: str) -> float:
    """An argparse type: a finite number of seconds > 0 (a deadline of 0 or less fires at once)."""
    x = float(value)
    if not (math.isfinite(x) and x > 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {value}")
    return x


def nonnegative_seconds(value: str) -> float:
    """An argparse type: a finite number of seconds >= 0."""
    x = float(value)
    if not (math.isfinite(x) and x >= 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {value}")
    return x


def int64(value: str) -> int:
    """An argparse type: an integer a 64-bit seed holds, as a request's seed (checked here, so that the
    error names the flag: the core's own refusal of a larger one does not)."""
    n = int(value)
    if not -2**63 <= n < 2**63:
        raise argparse.ArgumentTypeError(f"must be in [-2**63, 2**63), got {value}")
    return n


def port_number(value: str) -> int:
    n = int(value)
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number in [0, 65535], got {value}")
    return n


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagewalk", description="paged-KV decode inference microserver")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("loadtest", help="load generator (see `pagewalk loadtest --help`)", add_help=False)
    # no abbreviations: `--max-seqs 4` silently meant --max-seqs-per-request (a review)
    s = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API", formatter_class=HelpFormatter,
                       description="Serve a model over the OpenAI-compatible HTTP API "
                                   "(as `vllm serve MODEL`).", allow_abbrev=False)
    add_model_flags(s)
    add_engine_flags(s)
    add_server_flags(s)
    return parser


def add_model_flags(s: argparse.ArgumentParser) -> None:
    s.add_argument("model_tag", nargs="?", metavar="MODEL",
                   help="tiny | bench (presets with random weights) | PATH to a local Hugging Face "
                        "checkpoint directory; pagewalk does not download from the Hub (default: tiny)")
    s.add_argument("--model", default=None, help="the same as the positional MODEL")
    s.add_argument("--served-model-name", nargs="+", type=model_name, default=None, metavar="NAME",
                   help="model ids clients may send; the first is the one responses carry (default: the "
                        "preset or checkpoint directory name; the --model value as given is accepted too)")
    s.add_argument("--tokenizer", default=None,
                   help="directory holding tokenizer.json (+ tokenizer_config.json) to use instead of "
                        "the model's")
    s.add_argument("--chat-template", default=None,
                   help="chat template file, or the template text itself, overriding the tokenizer's; a "
                        "model without one serves no chat (400) unless this is given")
    s.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="weights and KV cache dtype; auto: bfloat16 on CUDA (float16 without bf16 support), "
                        "float32 on CPU (vLLM's auto takes the checkpoint's dtype)")
    s.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: cuda when available, else cpu")
    s.add_argument("--seed", type=int64, default=None,
                   help="seeds the sampling of requests that send no seed (default: not seeded; vLLM's is 0)")


def add_engine_flags(s: argparse.ArgumentParser) -> None:
    s.add_argument("--block-size", type=int, default=16, help="tokens per KV block (a power of two, 1-256)")
    kv = s.add_mutually_exclusive_group()
    kv.add_argument("--gpu-memory-utilization", type=fraction, default=None,
                    help="fraction of the GPU's total memory this server may use: weights, activations, CUDA "
                         "graphs and the KV cache, which gets the rest (vLLM's meaning; default 0.9; CPU: "
                         "a KV cache of 8192 tokens, one block of them the null block)")
    kv.add_argument("--num-blocks", type=int, default=None,
                    help="KV cache size in blocks, instead of sizing it from --gpu-memory-utilization "
                         "(vLLM: --num-gpu-blocks-override)")
    kv.add_argument("--kv-cache-memory", action=RetiredFlag, nargs=1,
                    replacement="--gpu-memory-utilization (a fraction of the GPU's total memory, as in vLLM)")
    s.add_argument("--max-num-seqs", type=batch_size, default=64,
                   help=f"sequences in one decode batch, at most {MAX_NUM_SEQS}")
    s.add_argument("--max-num-batched-tokens", type=positive_int, default=2048,
                   help="tokens in one engine step")
    s.add_argument("--max-waiting", type=positive_int, default=1024,
                   help="queued requests before new ones get 429 (vLLM queues without a bound)")
    s.add_argument("--max-model-len", type=model_len, default=None,
                   help="prompt + completion tokens per sequence, as vLLM spells it (4096, 32k = 32,000, "
                        "32K = 32,768; default: the model's max_position_embeddings, or what the KV cache "
                        "holds if that is less)")
    s.add_argument("--attention-backend", default="auto", choices=["auto", "triton", "torch"],
                   help="paged attention kernels: auto = triton on CUDA, the torch reference on CPU")
    s.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks of prompt prefixes seen before")
    s.add_argument("--enforce-eager", action="store_true", help="no CUDA-graph decode (eager kernels only)")
    s.add_argument("--no-async-scheduling", action="store_true",
                   help="post-process each engine step before planning the next (no CPU/GPU overlap; "
                        "overlap is on where the device runs asynchronously, i.e. CUDA)")
    s.add_argument("--engine-in-process", action="store_true",
                   help="run the engine core on a thread of the API process instead of its own process")


def add_server_flags(s: argparse.ArgumentParser) -> None:
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (vLLM listens on all interfaces by default)")
    s.add_argument("--port", type=port_number, default=8000, help="port to listen on")
    s.add_argument("--api-server-count", type=int, default=1,
                   help="API server processes sharing the port and one engine core (as vLLM's): each parses, "
                        "tokenizes, detokenizes and streams its own connections, so HTTP scales past one "
                        "core's worth of Python; --max-waiting is shared out among them")
    s.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV} if set)")
    s.add_argument("--allowed-origins", type=json_list, default=[],
                   help='origins browsers may call the API from, a JSON list (\'["*"]\': any); default none '
                        '(vLLM allows any)')
    s.add_argument("--allowed-hosts", type=json_list, default=[],
                   help='Host names a server on loopback answers besides localhost, a JSON list (\'["*"]\': '
                        "any): a reverse proxy's public name where it passes on the client's Host; other "
                        "names are refused against DNS rebinding (a server on other interfaces takes any)")
    s.add_argument("--debug-endpoints", action=argparse.BooleanOptionalAction, default=None,
                   help="serve /debug/kvcache (the playground's live KV block map: every client's request "
                        "names, lengths and shared prefixes); default on for a server on loopback only, "
                        "off for one on other interfaces")
    s.add_argument("--allow-credentials", action="store_true", help="CORS: allow cookies and credentials")
    s.add_argument("--allowed-methods", type=json_list, default=["*"], help="CORS: a JSON list of methods")
    s.add_argument("--allowed-headers", type=json_list, default=["*"], help="CORS: a JSON list of headers")
    s.add_argument("--max-body-bytes", type=positive_int, default=None,
                   help="request body limit in bytes, 413 above it (default: 1 MiB)")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="chat requests with tools and tool_choice \"auto\" get the tool calls their replies "
                        "write, parsed in --tool-call-parser's format (as vLLM's)")
    s.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                   help="the format the model writes tool calls in: hermes (<tool_call>{...}</tool_call>: "
                        "Qwen2.5, Hermes) or llama3_json (a JSON object: Llama 3.1 / 3.2)")
    s.add_argument("--shutdown-timeout", type=nonnegative_seconds, default=10.0,
                   help="seconds in-flight requests may take to finish on SIGTERM/SIGINT before they are "
                        "aborted; the process exits (0) at most ~2 s later whatever the clients do")
    add_limit_flags(s)
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="log verbosity; debug also prints the traceback of a start-up error")


def add_limit_flags(s: argparse.ArgumentParser) -> None:
    """Bounds on one request's work and on connections (README "Reliability")."""
    from server.api import connections as c
    from server.api.admission import RequestLimits

    d = RequestLimits()
    g = s.add_argument_group("request limits (each refusal is a 400 naming the field and the limit)")
    g.add_argument("--max-stop-strings", type=positive_int, default=d.max_stop_strings,
                   help="stop strings per request")
    g.add_argument("--max-stop-string-length", type=positive_int, default=d.max_stop_string_length,
                   help="characters of one stop string")
    g.add_argument("--max-prompts", type=positive_int, default=d.max_prompts,
                   help="prompts of one /v1/completions request")
    g.add_argument("--max-choices", type=positive_int, default=d.max_choices,
                   help="prompts x n of one request")
    g.add_argument("--max-logprob-entries", type=positive_int, default=d.max_logprob_entries,
                   help="choices x tokens x (1 + logprobs) of one request (prompt logprobs of echo included)")
    g.add_argument("--max-request-tokens", type=positive_int, default=d.max_request_tokens,
                   help="n x (prompt + max_tokens) over all prompts of one request (also never more than "
                        "the whole KV cache)")
    g.add_argument("--max-seqs-per-request", type=positive_int, default=None,
                   help="choices one request has in the engine at once; its other prompts wait for them, so "
                        "a request of many prompts cannot starve small ones (default: max-num-seqs / 2)")
    g = s.add_argument_group("connections")
    g.add_argument("--header-timeout", type=positive_seconds, default=c.DEFAULT_HEADER_TIMEOUT_S,
                   help="seconds a client has to send a request's headers, from the connection's opening "
                   "(its first request) or the request's first byte (408 and close after)")
    g.add_argument("--timeout-keep-alive", type=positive_int, default=c.DEFAULT_TIMEOUT_KEEP_ALIVE_S,
                   help="seconds an idle keep-alive connection stays open (uvicorn's)")
    g.add_argument("--max-connections", type=positive_int, default=c.DEFAULT_MAX_CONNECTIONS,
                   help="open connections of each API server (--api-server-count); one more gets a 503 and "
                        "is closed")
    g.add_argument("--client-stall-timeout", type=positive_seconds, default=c.DEFAULT_STALL_TIMEOUT_S,
                   help="seconds a client may read nothing of its response before it is disconnected "
                        "(its requests aborted, their KV blocks freed)")


def request_limits(args: argparse.Namespace):
    from server.api.admission import RequestLimits

    return RequestLimits(
        max_stop_strings=args.max_stop_strings, max_stop_string_length=args.max_stop_string_length,
        max_prompts=args.max_prompts, max_choices=args.max_choices,
        max_logprob_entries=args.max_logprob_entries, max_request_tokens=args.max_request_tokens,
        max_seqs_per_request=args.max_seqs_per_request)


def parse_serve_args(argv: list[str]) -> argparse.Namespace:
    """Parses `serve ...` and resolves MODEL / --model and the API key's environment default."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.model_tag and args.model and args.model_tag != args.model:
        parser.error(f"MODEL {args.model_tag!r} and --model {args.model!r} disagree; give one")
    if not (args.model_tag or args.model) and args.served_model_name:
        from pathlib import Path

        from server.model.config import PRESETS

        swallowed = [n for n in args.served_model_name if n in PRESETS or Path(n).is_dir()]
        if swallowed:  # `--served-model-name NAME MODEL`: nargs="+" took MODEL for a name
            parser.error(f"--served-model-name took {swallowed[0]!r}, which looks like MODEL: put MODEL "
                         "first or give it as --model")
    args.model = args.model_tag or args.model or "tiny"
    if args.served_model_name:  # a name given twice is listed once
        args.served_model_name = list(dict.fromkeys(args.served_model_name))
    if args.api_server_count < 1:
        parser.error("--api-server-count must be at least 1")
    if args.max_waiting < args.api_server_count:
        parser.error(f"--max-waiting ({args.max_waiting}) is shared out among the API servers: it must be at "
                     f"least --api-server-count ({args.api_server_count})")
    if args.api_server_count > 1 and args.engine_in_process:
        parser.error("--engine-in-process (the core inside the one API process) excludes --api-server-count")
    if "*" in args.allowed_origins and args.allow_credentials:  # would reflect any origin, with cookies
        parser.error('--allow-credentials with --allowed-origins \'["*"]\' would let any site send a user\'s '
                     "credentials and read the answers: name the origins")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser (the format of the model's calls)")
    if args.api_key is None:
        args.api_key = os.environ.get(API_KEY_ENV)
    if args.api_key:
        args.api_key = _usable_api_key(args.api_key, parser)
    return args


def _usable_api_key(key: str, parser: argparse.ArgumentParser) -> str:
    """The key as a client can send it: without the whitespace around it (a secret file's newline: the
    client's token is stripped too), printable ASCII (Starlette reads headers as latin-1, so a key of other
    characters matched no request, a review)."""
    key = key.strip()
    if not key or not all(" " <= c <= "~" for c in key):
        parser.error(f"--api-key (or ${API_KEY_ENV}) must be printable ASCII, not only whitespace: an HTTP "
                     "header carries no other characters")
    return key


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["loadtest"]:
        from loadtest.cli import main as loadtest_main

        return loadtest_main(argv[1:]) or 0
    # until the server's own handlers replace them; put back after (main may run inside another program)
    main_thread = threading.current_thread() is threading.main_thread()  # (signals are set from it alone)
    held = HeldStops() if main_thread else None
    try:
        args = parse_serve_args(argv)
        logging.basicConfig(level=args.log_level.upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        import_serving()
        if held is not None:
            held.release()
        return serve(args)
    except (ValueError, OSError, ImportError) as e:  # a bad model, tokenizer, template, flag or library
        return startup_failed(e)
    except Terminated:  # a stop asked for before there was anything to drain
        print("pagewalk serve: stopped during start-up (SIGTERM)", file=sys.stderr)
        return 0
    except KeyboardInterrupt:  # Ctrl-C before the signal handlers are set: the model was still loading
        print("pagewalk serve: interrupted during start-up", file=sys.stderr)
        return 130
    finally:
        if held is not None:
            held.restore()


def import_serving() -> None:
    """torch, Triton and the server's modules (~3 s on a 2-core box), loaded while HeldStops holds stops."""
    import uvicorn  # noqa: F401

    import server.api.app  # noqa: F401
    import server.supervisor  # noqa: F401


class HeldStops:
    """SIGTERM and SIGINT while the flags parse and the modules load: noted, not raised. Raised there, they
    interrupted a C extension's import halfway (under load: "cannot load module more than once per process",
    or an exit that hung: a review; and before this handler, SIGTERM ended the process by default).
    `release` sets the start-up's handlers and raises the stop noted, if any."""

    def __init__(self) -> None:
        self.noted: int | None = None
        self.previous = {sig: signal.signal(sig, self._note) for sig in (signal.SIGTERM, signal.SIGINT)}

    def _note(self, signum, frame) -> None:
        self.noted = self.noted or signum

    def release(self) -> None:
        signal.signal(signal.SIGTERM, _terminated)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if self.noted == signal.SIGTERM:
            raise Terminated
        if self.noted == signal.SIGINT:
            raise KeyboardInterrupt

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


class Terminated(KeyboardInterrupt):
    """SIGTERM during start-up, raised where Ctrl-C's KeyboardInterrupt would be: the same clean-up runs
    (the core starting is killed, its directory removed). Python's default would end the process on the
    spot, leaving both (a review)."""


def _terminated(signum, frame) -> None:
    raise Terminated


def startup_failed(error: Exception) -> int:
    """One line on stderr (the traceback only at --log-level debug); exit code 1."""
    logger.debug("start-up failed", exc_info=error)
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    print(f"pagewalk serve: error: {first_line}", file=sys.stderr)
    return 1


def engine_config(args: argparse.Namespace):
    import torch

    from server.engine.engine import EngineConfig

    if args.device.startswith("cuda") and not torch.cuda.is_available():  # else a raw assertion, later
        raise ValueError(f"--device {args.device}: no CUDA device is available to torch {torch.__version__}")
    return EngineConfig(
        model=args.model, device=args.device, dtype=None if args.dtype == "auto" else args.dtype,
        block_size=args.block_size, num_blocks=args.num_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_waiting=args.max_waiting, max_model_len=args.max_model_len,
        attention_backend=args.attention_backend, enable_prefix_caching=args.enable_prefix_caching,
        enforce_eager=args.enforce_eager, async_scheduling=False if args.no_async_scheduling else None,
        tokenizer=args.tokenizer, chat_template=args.chat_template,
        served_model_name=tuple(args.served_model_name or ()), seed=args.seed)


def startup_line(engine, url: str) -> str:
    kv = engine.health()["kv_cache"]
    capacity = (kv["free_blocks"] + kv["used_blocks"]) * kv["block_size"]
    dtype = str(engine.dtype).removeprefix("torch.")
    server = engine.api_server
    servers = f" api_server={server.index + 1}/{server.count}" if server.count > 1 else ""
    return (f"pagewalk serving model={engine.model_name} device={engine.device} dtype={dtype} "
            f"attention_backend={engine.attention_backend} engine_core={engine.client.mode}{servers} "
            f"max_model_len={engine.max_model_len} "
            f"kv_cache={capacity} tokens ({kv['num_blocks']} blocks x {kv['block_size']}) url={url}")


# descriptors an API process needs beyond its connections: the core's sockets, pipes, files, the log
FILE_MARGIN = 64


def raise_open_file_limit(max_connections: int) -> None:
    """The soft RLIMIT_NOFILE up to the hard one, as vLLM raises it: at a common soft limit of 1024 the API
    process ran out of descriptors below --max-connections, new clients hung instead of getting the cap's
    503, and asyncio logged a traceback per refused accept (250 MB in 100 s: a review). A warning if the
    connections still do not fit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    if soft != resource.RLIM_INFINITY and soft < max_connections + FILE_MARGIN:
        logger.warning("the open-file limit (%d) is below --max-connections %d + %d: raise it (ulimit -n) or "
                       "lower --max-connections", soft, max_connections, FILE_MARGIN)


def serve(args: argparse.Namespace) -> int:
    raise_open_file_limit(args.max_connections)
    if args.api_server_count > 1:
        from server.supervisor import supervise

        return supervise(args)
    return serve_api(args)


def run_api_server(args: argparse.Namespace, api_server, sock) -> None:
    """Spawn target of one of --api-server-count servers: serve_api on the supervisor's listening socket."""
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        code = serve_api(args, api_server, sock)
    except (ValueError, OSError) as e:
        code = startup_failed(e)
    exit_now(code)


def debug_endpoints(args: argparse.Namespace) -> bool:
    """--debug-endpoints, or by default whether the server listens on loopback alone: the block map names
    every client's requests and shows which share prefixes (across cache salts: a review), for the operator
    of a local server, not the clients of a shared one."""
    from server.api.browser_guard import listens_on_loopback_only

    return listens_on_loopback_only(args.host) if args.debug_endpoints is None else args.debug_endpoints


def serve_api(args: argparse.Namespace, api_server=None, sock=None) -> int:
    """One API process: its own engine core, or (`api_server`) the supervisor's, on `sock` if given."""
    import uvicorn

    from server.api.app import create_app, stop_engine
    from server.api.async_engine import AsyncEngine
    from server.api.browser_guard import listens_on_loopback_only
    from server.api.connections import drop_stalled, guarded_protocol
    from server.api.cors import CorsPolicy
    from server.api.limits import DEFAULT_MAX_BODY_BYTES
    from server.engine.core_client import CoreStartupError

    class GracefulServer(uvicorn.Server):
        """On SIGTERM/SIGINT clients that are not reading are dropped (their requests abort), the engine
        drains (in-flight requests finish, or are aborted with finish_reason "abort" after
        --shutdown-timeout), then uvicorn closes connections and exits."""

        async def shutdown(self, sockets=None) -> None:
            drop_stalled(self.server_state.connections)
            await stop_engine(self.config.app)
            await super().shutdown(sockets)
            if self.force_exit:  # a second Ctrl-C skips the lifespan's shutdown, and the lifespan task, left
                # waiting, is cancelled at exit: an ERROR traceback (a review). The engine has stopped, so the
                # lifespan's own stop returns at once
                await self.lifespan.shutdown()

    config = engine_config(args)
    tokenizer = None
    if sock is None:  # bound before the model loads: a port in use is one line (uvicorn exited 3 after it)
        from server.model.loader import load_tokenizer
        from server.supervisor import listen

        # a bad model, tokenizer or template is its own line, before the port
        tokenizer = load_tokenizer(config.model, config.tokenizer, config.chat_template)
        sock = listen(args.host, args.port)  # OSError: main's one line
    try:
        engine = AsyncEngine(config, in_process=args.engine_in_process, log_level=args.log_level,
                             api_server=api_server, tokenizer=tokenizer)
    except CoreStartupError as e:
        return startup_failed(e)

    def build() -> GracefulServer:
        """The app and its uvicorn server around the engine; the core is running meanwhile."""
        max_body_bytes = args.max_body_bytes or DEFAULT_MAX_BODY_BYTES
        app = create_app(engine, api_key=args.api_key, max_body_bytes=max_body_bytes,
                         tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
                         shutdown_timeout_s=args.shutdown_timeout, limits=request_limits(args),
                         cors=CorsPolicy(tuple(args.allowed_origins), args.allow_credentials,
                                         tuple(args.allowed_methods), tuple(args.allowed_headers)),
                         loopback_only=listens_on_loopback_only(args.host),
                         allowed_hosts=tuple(args.allowed_hosts), debug_endpoints=debug_endpoints(args))
        logger.info(startup_line(engine, http_url(args.host, sock.getsockname()[1])))
        if engine.sampling_defaults:  # as vLLM says it: the model's own values replace OpenAI's defaults
            logger.info("sampling defaults from the model's generation_config.json (for fields a request "
                        "leaves out): %s", ", ".join(f"{k}={v}" for k, v in engine.sampling_defaults.items()))
        logger.info("prefix caching %s; bearer-token auth on /v1/* %s; tool calls %s; debug endpoints %s",
                    "on" if args.enable_prefix_caching else "off", "required" if args.api_key else "off",
                    f"parsed ({args.tool_call_parser})" if args.enable_auto_tool_choice else "off",
                    "on" if debug_endpoints(args) else "off")
        # the engine has drained (or aborted what was left) before uvicorn's own graceful shutdown starts,
        # and GuardedHttpProtocol drops clients that are not reading: what remains finishes in a second or
        # is cut
        protocol = guarded_protocol(args.header_timeout, args.client_stall_timeout, args.max_connections,
                                    max_body_bytes)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, http=protocol,
                                timeout_keep_alive=args.timeout_keep_alive, timeout_graceful_shutdown=0.5,
                                access_log=False)
        server = GracefulServer(config)
        # until uvicorn's own handlers (in server.run), a signal asks the server to stop, as theirs do; after
        # them it is harmless: uvicorn re-raises the signal it shut down on once it is done, and a graceful
        # stop is a clean exit (0)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: setattr(server, "should_exit", True))

        def core_died(reason: str) -> None:  # in-flight requests have their error; a supervisor restarts us
            logger.error("%s: stopping the server", reason)
            server.should_exit = True

        engine.on_core_death = core_died
        return server

    try:
        server = build()
    except BaseException:  # a signal (Terminated, Ctrl-C) before uvicorn's own handlers, or an error: the
        # core stops now (at exit Python would wait for it without end: it ignores SIGTERM)
        engine.shutdown(timeout=0)
        raise
    server.run(sockets=[sock])
    engine.shutdown(timeout=0)  # stopped by the app's shutdown already, unless uvicorn never started
    # a core that died, hung or had to be killed at shutdown: non-zero, so a supervisor sees the failure
    exit_now(1 if engine.dead is not None or engine.client.stopped_by_force else 0)


def http_url(host: str, port: int) -> str:
    """The URL a client uses: an IPv6 host in brackets; "" (every interface, as 0.0.0.0) as 0.0.0.0."""
    host = host or "0.0.0.0"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def exit_now(code: int) -> NoReturn:
    """The server has stopped: the engine is closed, connections are closed, logs are flushed below. The
    interpreter's teardown (torch, tokenizers, the app's modules) has nothing left to do and costs ~0.6 s of
    the --shutdown-timeout + 2 s a supervisor is promised (2-core machine); skip it."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
