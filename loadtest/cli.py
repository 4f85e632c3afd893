"""`python -m loadtest` / `pagewalk loadtest`: measure a server; `... compare A.json B.json`: diff two runs.

Exit status: 0 when the run finished and at least one request succeeded, 1 when none did (or on a usage
problem such as an unreachable server during chat calibration, or when a `--processes` worker died), 130
when interrupted (Ctrl-C prints and saves the partial results first).
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import signal
import sys

import httpx
from rich.console import Console

from loadtest.metrics import SLO
from loadtest.plot import plot_run, plot_sweep
from loadtest.processes import STREAMS_PER_PROCESS, WorkerError
from loadtest.report import failed_share, load_report, print_compare, print_report, save_report
from loadtest.session import RunSettings, SetupError, discover, measure, warm_up
from loadtest.sweep import parse_levels, run_sweep, sweep_table, sweep_warnings
from loadtest.workload import LengthRange, check_arrivals


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtest",
        description="Load-test an OpenAI-compatible server: throughput, TTFT, TPOT, ITL, E2EL "
        "(vLLM bench-serve definitions). `python -m loadtest compare A.json B.json` diffs two reports.",
    )
    a = p.add_argument
    a("--base-url", default="http://127.0.0.1:8000")
    a("--endpoint", choices=("completions", "chat"), default="completions")
    a("--model", default=None, help="model id to send (default: the first id of GET /v1/models)")
    a("--num-requests", type=int, default=64)
    a("--concurrency", type=int, default=None, help="max requests in flight (default: no limit)")
    a("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf = all at once")
    a("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps (1 = Poisson)")
    a("--input-len", type=int, default=128, help="prompt tokens per request")
    a("--output-len", type=int, default=128, help="output tokens per request (max_tokens with ignore_eos)")
    a("--input-len-range", default=None, metavar="LOW,HIGH", help="uniform prompt lengths")
    a("--output-len-range", default=None, metavar="LOW,HIGH", help="uniform output lengths")
    a("--seed", type=int, default=0)
    a("--no-stream", action="store_true", help="non-streaming requests (TTFT = E2EL; no ITL/TPOT)")
    a("--api-key", default=None)
    a("--slo-ttft-ms", type=float, default=None, help="goodput SLO on TTFT")
    a("--slo-tpot-ms", type=float, default=None, help="goodput SLO on TPOT")
    a("--out", default=None, metavar="REPORT.json")
    a("--plot", default=None, metavar="PNG")
    a("--warmup", type=int, default=0, metavar="K", help="unmeasured requests sent first")
    a("--sweep-concurrency", default=None, metavar="C1,C2,...", help="run once per concurrency level")
    a("--vocab-range", default="32,126", metavar="LOW,HIGH",
      help="token ids for completions prompts (default: printable ASCII of byte-level tokenizers)")
    a("--temperature", type=float, default=0.0)
    a("--top-p", type=float, default=1.0, help="nucleus mass kept (sampled decoding)")
    a("--request-timeout", type=float, default=600.0, metavar="S",
      help="longest wait for any next piece of a response (httpx's timeout per read, not a deadline for "
           "the whole request; the connection's at most 30 s): past it the request fails as timeout")
    a("--no-return-token-ids", action="store_true",
      help="do not ask for per-chunk token_ids (for servers that reject unknown fields)")
    a("--save-detailed", action="store_true", help="also store every chunk's timestamp in the JSON")
    a("--no-progress", action="store_true")
    a("--max-failed-frac", type=float, default=0.0, metavar="F",
      help="exit 1 when more than this share of a level's measured requests failed (default 0: any; the "
           "report is written either way)")
    a("--processes", type=parse_processes, default=1, metavar="N|auto",
      help="worker processes sharing the requests and the concurrency (default 1: this process); auto = "
      f"max(1, min(ceil(concurrency / {STREAMS_PER_PROCESS}), CPUs // 2)) at each level")
    return p


def parse_processes(text: str) -> int | None:
    """'auto' -> None (chosen per concurrency level), else a count >= 1."""
    if text == "auto":
        return None
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a count >= 1 or 'auto', got {text!r}")
    return int(text)


def settings_from_args(args: argparse.Namespace, argv: list[str]) -> RunSettings:
    vocab = LengthRange.parse(args.vocab_range)
    return RunSettings(
        base_url=args.base_url, endpoint=args.endpoint, model=args.model, num_requests=args.num_requests,
        concurrency=args.concurrency, request_rate=args.request_rate, burstiness=args.burstiness,
        input_lens=LengthRange.parse(args.input_len_range or str(args.input_len)),
        output_lens=LengthRange.parse(args.output_len_range or str(args.output_len)),
        seed=args.seed, stream=not args.no_stream, api_key=args.api_key,
        slo=SLO(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms), warmup=args.warmup,
        vocab_range=(vocab.low, vocab.high), temperature=args.temperature, top_p=args.top_p,
        timeout_s=args.request_timeout,
        return_token_ids=not args.no_return_token_ids, detailed=args.save_detailed,
        progress=not args.no_progress, processes=args.processes,
        command=shlex.join(["python", "-m", "loadtest", *argv]),
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["compare"]:
        return compare_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = settings_from_args(args, argv)
        levels = parse_levels(args.sweep_concurrency) if args.sweep_concurrency else None
    except ValueError as e:
        parser.error(str(e))
    if settings.num_requests < 1 or (settings.concurrency is not None and settings.concurrency < 1):
        parser.error("--num-requests and --concurrency must be >= 1")
    if not 0 <= args.max_failed_frac <= 1:
        parser.error(f"--max-failed-frac must be in [0, 1], got {args.max_failed_frac}")
    if settings.seed < 0:  # numpy's seeds are >= 0: a traceback from the workload before (a review)
        parser.error(f"--seed must be >= 0, got {settings.seed}")
    try:  # before any request: the arrival schedule is built only once the warm-up has run
        check_arrivals(settings.request_rate, settings.burstiness)
    except ValueError as e:
        parser.error(f"--{str(e).replace('_', '-')}")
    if not settings.stream and settings.slo.tpot_ms is not None:
        parser.error("--slo-tpot-ms needs streamed responses (--no-stream measures no TPOT)")
    try:
        return asyncio.run(_run(settings, levels, args.out, args.plot, args.max_failed_frac))
    except KeyboardInterrupt:
        return 130
    except WorkerError as e:
        Console(stderr=True).print(f"[red]load generator failed:[/] {e}")
        return 1


async def _run(settings: RunSettings, levels: list[int] | None, out: str | None, plot: str | None,
               max_failed_frac: float) -> int:
    stop = _install_sigint(asyncio.Event())
    console, err = stdout_console(), Console(stderr=True)
    try:
        server = await discover(settings)
    except SetupError as e:
        err.print(f"[red]cannot run this workload:[/] {e}")
        return 2
    except (httpx.HTTPError, RuntimeError) as e:
        err.print(f"[red]server discovery failed:[/] {e}")
        return 1
    first_level = levels[0] if levels else settings.concurrency or settings.num_requests
    warm = await warm_up(settings, server, first_level, stop)
    if stop.is_set():  # Ctrl-C during the warm-up: nothing was measured
        err.print("[yellow]interrupted during the warm-up: nothing measured[/]")
        return 130
    if any(not r.success for r in warm):
        err.print(f"[yellow]warmup: {sum(not r.success for r in warm)}/{len(warm)} requests failed[/]")
    if levels is not None:
        reports = await run_sweep(settings, server, levels, stop, err)
        console.print(sweep_table(reports))
        for line in sweep_warnings(reports):
            console.print(f"[yellow]{line}[/]", soft_wrap=True)
        if out:
            save_report({"command": settings.command, "sweep": reports}, out)
        if plot and reports:
            plot_sweep(reports, plot)
    else:
        run, report = await measure(settings, server, settings.concurrency, stop, err)
        reports = [report]
        print_report(report, console)
        if out:
            save_report(report, out)
        if plot:
            plot_run(run, plot)
    if any(r["interrupted"] for r in reports):
        return 130
    ok = all(r["completed"] > 0 and failed_share(r) <= max_failed_frac for r in reports)
    return 0 if ok else 1


def stdout_console() -> Console:
    """Tables to stdout; when it is a pipe or file, wide enough that no column is cut (rich assumes 80)."""
    return Console() if sys.stdout.isatty() else Console(width=160)


def _install_sigint(stop: asyncio.Event) -> asyncio.Event:
    """First Ctrl-C: stop measuring and report what finished; a second one aborts."""
    loop = asyncio.get_running_loop()

    def on_sigint() -> None:
        Console(stderr=True).print("[yellow]interrupted: reporting the requests that finished[/]")
        stop.set()
        loop.remove_signal_handler(signal.SIGINT)

    try:
        loop.add_signal_handler(signal.SIGINT, on_sigint)
    except (NotImplementedError, RuntimeError, ValueError):
        pass  # not the main thread, or no signal support: Ctrl-C aborts without a report
    return stop


def compare_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest compare", description="Two reports side by side.")
    p.add_argument("a", metavar="A.json")
    p.add_argument("b", metavar="B.json")
    args = p.parse_args(argv)
    a, b = load_report(args.a), load_report(args.b)
    if "sweep" in a or "sweep" in b:
        p.error("compare takes single-run reports, not sweeps")
    print_compare(a, b, (args.a, args.b), stdout_console())
    return 0
