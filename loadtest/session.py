"""One measured run from settings: discover the server, build the workload, warm up, run, report."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from loadtest.benchmark import BenchmarkRun
from loadtest.client import ClientConfig, RequestRecord, calibrate_chat, fetch_json, fetch_text
from loadtest.metrics import SLO, compute_metrics
from loadtest.prefix_cache import hit_rate, parse_counters
from loadtest.processes import auto_processes, run_workload
from loadtest.report import build_report
from loadtest.server_steps import parse_steps, step_fields
from loadtest.workload import ChatCalibration, LengthRange, arrival_offsets, build_workload


@dataclass
class RunSettings:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "completions"
    model: str | None = None  # None: the first id of GET /v1/models
    num_requests: int = 64
    concurrency: int | None = None  # None: no limit (all requests may be in flight)
    request_rate: float = math.inf
    burstiness: float = 1.0
    input_lens: LengthRange = field(default_factory=lambda: LengthRange(128, 128))
    output_lens: LengthRange = field(default_factory=lambda: LengthRange(128, 128))
    seed: int = 0
    stream: bool = True
    api_key: str | None = None
    slo: SLO = field(default_factory=SLO)
    warmup: int = 0
    vocab_range: tuple[int, int] = (32, 126)
    temperature: float = 0.0
    top_p: float = 1.0
    timeout_s: float = 600.0
    return_token_ids: bool = True
    detailed: bool = False
    progress: bool = True
    processes: int | None = 1  # None: auto_processes(concurrency) at each level
    command: str = ""

    def processes_for(self, concurrency: int) -> int:
        return auto_processes(concurrency) if self.processes is None else self.processes

    def config_dict(self, concurrency: int) -> dict:
        lens = lambda r: r.low if r.low == r.high else f"{r.low}-{r.high}"
        return {
            "base_url": self.base_url, "endpoint": self.endpoint, "model": self.model,
            "num_requests": self.num_requests, "concurrency": concurrency,
            "request_rate": "inf" if math.isinf(self.request_rate) else self.request_rate,
            "burstiness": self.burstiness, "input_len": lens(self.input_lens),
            "output_len": lens(self.output_lens), "seed": self.seed, "stream": self.stream,
            "warmup": self.warmup, "temperature": self.temperature, "top_p": self.top_p,
            "processes": "auto" if self.processes is None else self.processes,
        }  # fmt: skip


@dataclass
class Server:
    """What the load generator learned about the server before measuring."""

    model: str
    health: dict | None
    chat: ChatCalibration = field(default_factory=ChatCalibration)


class SetupError(RuntimeError):
    """The run cannot start as asked (the workload does not fit what the server counts)."""


async def discover(settings: RunSettings) -> Server:
    """The server's model, health and chat calibration; SetupError where the chat prompts cannot be
    --input-len tokens long. Its requests wait up to the run's request timeout (a server compiling on its
    first request took longer than httpx's 5 s default: no run started, a review)."""
    async with httpx.AsyncClient(timeout=settings.timeout_s) as client:
        health = await fetch_json(client, settings.base_url, "/health", settings.api_key)
        model = settings.model
        if model is None:
            models = await fetch_json(client, settings.base_url, "/v1/models", settings.api_key) or {}
            ids = [m.get("id") for m in models.get("data") or [] if m.get("id")]
            model = ids[0] if ids else "default"
        server = Server(model=model, health=health)
        if settings.endpoint == "chat":
            server.chat = await calibrate_chat(client, client_config(settings, model))
    if settings.endpoint == "chat":
        try:
            server.chat.letters(settings.input_lens.low)
        except ValueError as e:
            raise SetupError(str(e)) from None
        if server.chat.per_char != 1.0:
            Console(stderr=True).print(
                f"[yellow]the server's tokenizer is not byte-level:[/] {server.chat.per_char:.3f} prompt "
                f"tokens a letter; chat prompts have the letters that make about --input-len tokens "
                f"(the report's input tokens are the server's count)")
    return server


def client_config(settings: RunSettings, model: str) -> ClientConfig:
    return ClientConfig(
        base_url=settings.base_url, model=model, endpoint=settings.endpoint, stream=settings.stream,
        api_key=settings.api_key, temperature=settings.temperature, top_p=settings.top_p,
        timeout_s=settings.timeout_s,
        return_token_ids=settings.return_token_ids,
    )  # fmt: skip


async def warm_up(settings: RunSettings, server: Server, concurrency: int,
                  stop: asyncio.Event | None = None) -> list[RequestRecord]:
    """`settings.warmup` requests of the same shape (a different seed), not measured; `stop` (the first
    Ctrl-C) ends them as it ends a measured run."""
    if settings.warmup <= 0:
        return []
    specs = build_workload(settings.warmup, settings.input_lens, settings.output_lens, settings.seed + 7919,
                           settings.endpoint, settings.vocab_range, server.chat)  # fmt: skip
    level = min(concurrency, settings.warmup)
    cfg = client_config(settings, server.model)
    run = await run_workload(specs, cfg, level, [0.0] * len(specs), settings.processes_for(concurrency),
                             stop)
    return run.records


async def measure(
    settings: RunSettings,
    server: Server,
    concurrency: int | None,
    stop: asyncio.Event | None = None,
    console: Console | None = None,
) -> tuple[BenchmarkRun, dict]:
    """Run the workload once at `concurrency`; returns the raw run and its report."""
    level = concurrency or settings.num_requests
    specs = build_workload(settings.num_requests, settings.input_lens, settings.output_lens, settings.seed,
                           settings.endpoint, settings.vocab_range, server.chat)  # fmt: skip
    offsets = arrival_offsets(len(specs), settings.request_rate, settings.burstiness, settings.seed)
    cfg = client_config(settings, server.model)
    progress = Progress(
        TextColumn(f"[bold]c={level}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[failed]} failed"), TimeElapsedColumn(),
        console=console or Console(stderr=True), disable=not settings.progress, transient=True,
    )  # fmt: skip
    with progress:
        task = progress.add_task("requests", total=len(specs), failed=0)
        failed = 0

        def on_record(rec: RequestRecord) -> None:
            nonlocal failed
            failed += not rec.success
            progress.update(task, advance=1, failed=failed)

        async with httpx.AsyncClient() as client:
            metrics_before = await fetch_text(client, settings.base_url, "/metrics", settings.api_key)
        run = await run_workload(specs, cfg, level, offsets, settings.processes_for(level), stop, on_record)
    async with httpx.AsyncClient() as client:
        health_after = await fetch_json(client, settings.base_url, "/health", settings.api_key)
        metrics_after = await fetch_text(client, settings.base_url, "/metrics", settings.api_key)
    metrics = compute_metrics(run.records, run.duration_s, settings.slo)
    config = settings.config_dict(level) | {"model": server.model}
    if settings.endpoint == "chat":
        config["chat_template_tokens"] = server.chat.template
        config["chat_tokens_per_letter"] = server.chat.per_char
    report = build_report(run, metrics, config, settings.command, server.health, settings.detailed)
    report["server_health_after"] = health_after
    before, after = metrics_before or "", metrics_after or ""
    report["server_prefix_cache_hit_rate"] = hit_rate(parse_counters(before), parse_counters(after))
    report.update(step_fields(parse_steps(before), parse_steps(after)))
    return run, report
