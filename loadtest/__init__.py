"""pagewalk's load generator: `python -m loadtest` (or `pagewalk loadtest`) measures an OpenAI-compatible
server the way serving benchmarks do (vLLM `bench serve` definitions of TTFT, TPOT, ITL, E2EL, goodput).

workload.py  prompts of exact token lengths + Poisson/gamma arrival offsets
client.py    one timed request, failures as records    sse.py  the per-event path (SSE bytes -> chunk times)
benchmark.py concurrency-limited driver, Ctrl-C stop
processes.py --processes: the driver spread over worker processes, records merged
cpu.py       the generator's own CPU use (client_cpu_*), the "may be the bottleneck" warning
metrics.py   the arithmetic          report.py  JSON, tables, compare
session.py   one measured run        sweep.py   --sweep-concurrency
plot.py      PNGs                    cli.py     flags
mock_server.py  scripted SSE server with known timing (tests, dry runs)
"""
