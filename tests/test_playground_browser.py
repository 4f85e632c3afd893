"""The playground page in headless Chromium (the system's package, driven by Playwright) against a real
`pagewalk serve` (uvicorn) of the tiny preset: it loads cleanly, streams a prompt, and its block map shows
used blocks while a request runs, shared blocks for two requests with a common prefix (and for forked
choices), none after, and preemptions when the cache is too small; a GPU-sized map is drawn aggregated.

Skipped, with the reason, when Playwright or a Chromium binary is missing; `.ci/run` installs both.
PLAYGROUND_SCREENSHOT=docs/playground.png writes the README's screenshot there (default: a temp dir).
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from server_helpers import Server

pytestmark = pytest.mark.timeout(180)

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
# As root, in a sandbox with no network: no sandboxing, no GPU, none of the background fetches
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
PREFIX = "Paged attention keeps each sequence's keys and values in fixed blocks; "  # > 4 blocks of 16 bytes
FREE_RGB = (0x26, 0x2C, 0x37)  # COLOURS.free in kvmap.js


def find_browser() -> str | None:
    found = [p for name in BROWSERS if (p := shutil.which(name))]
    return found[0] if found else None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("playground"), "--num-blocks", "160", "--max-num-seqs", "8")
    yield srv.url
    srv.stop()


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason="Playwright is not installed (.ci/run installs it)")
    path = find_browser()
    if path is None:
        pytest.skip(f"no Chromium binary on PATH (looked for {', '.join(BROWSERS)}); "
                    ".ci/run installs Debian's chromium")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)
        yield b
        b.close()


@contextmanager
def open_page(browser, url: str, bypass_csp: bool = True):
    """A fresh browser context on the playground at `url`, its stream live; `.problems` collects console
    errors and uncaught exceptions. The page's CSP forbids eval, which Playwright's wait_for_function uses:
    the tests bypass it, but test_the_page_runs_under_its_own_csp."""
    context = browser.new_context(viewport={"width": 1280, "height": 860}, bypass_csp=bypass_csp)
    pg = context.new_page()
    problems: list[str] = []
    pg.on("console", lambda m: problems.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
    pg.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    pg.goto(url)
    pg.wait_for_selector("#kv-status:text-is('live')", timeout=15_000)
    pg.problems = problems
    try:
        yield pg
    finally:
        context.close()


@pytest.fixture
def page(browser, server):
    with open_page(browser, server) as pg:
        yield pg


def count(pg, name: str) -> int:
    return int(pg.inner_text(f"#kv-{name}"))


def wait_count(pg, name: str, op: str, value: int, timeout_ms: int = 30_000) -> None:
    pg.wait_for_function(f"Number(document.getElementById('kv-{name}').textContent) {op} {value}",
                         timeout=timeout_ms)


def set_controls(pg, max_tokens: int, n: int = 1) -> None:
    pg.fill("#temperature", "0")
    pg.fill("#max_tokens", str(max_tokens))
    pg.fill("#n", str(n))
    pg.check("#ignore_eos")


def run_prompt(pg, text: str) -> None:
    """Run one prompt: the first prompt box holds `text`, every other box is removed."""
    while pg.locator("#prompts .prompt").count() > 1:
        pg.locator("#prompts .prompt .remove").last.click()
    pg.locator("#prompts textarea").first.fill(text)
    pg.click("#run")


def block_pixel(pg, block_id: int) -> tuple[int, int, int]:
    return tuple(pg.evaluate(
        """(id) => { const m = window.playground.kvmap, c = m.cellCentre(id);
                     return Array.from(m.ctx.getImageData(c.x, c.y, 1, 1).data.slice(0, 3)); }""", block_id))


def blocks_in(pg, state: str) -> list[int]:
    """Block ids the page's map holds in `state`: "used" (ref count 1), "shared", "cached" or "free"."""
    return pg.evaluate("(name) => window.playground.kvmap.idsIn(name)", state)


def test_page_loads_without_console_errors(page, server):
    # the page names the model once its /v1/models fetch answers, which may come after the stream is live
    page.wait_for_function("document.getElementById('model').textContent !== 'model: ?'", timeout=15_000)
    assert page.inner_text("#model") == "model: tiny"
    health = httpx.get(f"{server}/health").json()
    assert count(page, "total") == health["kv_cache"]["num_blocks"] == 160
    assert count(page, "used") == 0 and count(page, "free") == 159
    assert page.inner_text("#kv-scale") == "1 cell = 1 block"
    assert page.evaluate("document.getElementById('kv-map').height") > 0
    assert page.problems == []


def test_the_page_runs_under_its_own_csp(browser, server):
    """Its Content-Security-Policy (script, style and connections from its own server alone; no eval): the
    page loads, names the model, streams a prompt to its finish and shows the map, with no console error (a
    blocked script, style or fetch logs one)."""
    with open_page(browser, server, bypass_csp=False) as pg:
        pg.wait_for_selector("#model:text-is('model: tiny')", timeout=15_000)
        set_controls(pg, max_tokens=12)
        run_prompt(pg, "Under the CSP: ")
        pg.wait_for_selector(".output.done .state:text-is('finish: length')", timeout=30_000)
        assert len(pg.inner_text(".output .completion")) > 0 and count(pg, "total") == 160
        assert pg.problems == []


def test_prompt_streams_and_the_map_shows_its_blocks_until_it_ends(page):
    set_controls(page, max_tokens=1500)
    run_prompt(page, "Hello from the browser: ")
    page.wait_for_function(
        "document.querySelector('.output .completion') && "
        "document.querySelector('.output .completion').textContent.length > 20", timeout=30_000)
    wait_count(page, "used", ">", 1)
    assert "TTFT" in page.inner_text(".output .stats") and "tok/s" in page.inner_text(".output .stats")
    owner = page.get_attribute(".output .who .sw", "title")  # the response id, as the map names the seq
    assert owner.startswith("cmpl-") and owner in page.inner_text("#kv-seqs")
    used = blocks_in(page, "used")
    assert used and block_pixel(page, used[0]) != FREE_RGB
    tip = hover_block(page, used[0])
    assert f"block {used[0]}" in tip and "ref count 1" in tip and "/16 tokens" in tip
    page.click("#stop")
    wait_count(page, "used", "==", 0)
    page.wait_for_selector(".output.done")
    assert "stopped" in page.inner_text(".output pre")
    assert page.problems == []


def test_an_error_ends_only_the_choices_still_running_and_a_cut_stream_ends_them_all(page):
    """Two choices from a stream the test serves itself: choice 0 finishes, then an error event comes; choice
    0 keeps its finish, choice 1 shows the error (before, the error overwrote finished choices too). A stream
    that closes without [DONE] and without finishes leaves no card "streaming" (a review)."""
    def sse(*events: dict | str) -> str:
        return "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events)

    def chunk(index: int, text: str, finish: str | None = None) -> dict:
        return {"id": "cmpl-fake", "choices": [{"index": index, "text": text, "finish_reason": finish}]}

    bodies = [sse(chunk(0, "done here", "stop"), chunk(1, "half"), {"error": {"message": "boom"}}, "[DONE]"),
              sse(chunk(0, "cut"), chunk(1, "off"))]

    def serve(body: str):
        sse_type = {"Content-Type": "text/event-stream"}
        return lambda route: route.fulfill(status=200, headers=sse_type, body=body)

    for body in bodies:
        page.route("**/v1/completions", serve(body))
        set_controls(page, max_tokens=8, n=2)
        run_prompt(page, "fake")
        page.wait_for_function("document.querySelectorAll('.output.running').length === 0", timeout=10_000)
        page.unroute("**/v1/completions")
    states = page.eval_on_selector_all(".output .state", "nodes => nodes.map(n => n.textContent)")
    assert states == ["error", "error", "error", "finish: stop"], states  # newest first, choice 1 over 0
    texts = page.eval_on_selector_all(".output pre", "nodes => nodes.map(n => n.textContent)")
    assert "[boom]" in texts[2] and "[boom]" not in texts[3]
    assert all("ended before its choices finished" in t for t in texts[:2])


def test_chat_mode_streams_to_the_finish(page):
    set_controls(page, max_tokens=40)
    page.check("input[name=mode][value=chat]")
    page.locator("#prompts textarea").first.fill("Say something")
    page.locator("#prompts textarea").first.press("Control+Enter")
    page.wait_for_selector(".output.done", timeout=30_000)
    assert "finish: length" in page.inner_text(".output .head")
    assert len(page.inner_text(".output .completion")) > 0
    assert page.problems == []


def hover_block(pg, block_id: int) -> str:
    box = pg.locator("#kv-map").bounding_box()
    c = pg.evaluate("(id) => window.playground.kvmap.cellCentre(id)", block_id)
    pg.mouse.move(box["x"] + c["x"], box["y"] + c["y"])
    pg.wait_for_selector("#kv-tip:not([hidden])")
    return pg.inner_text("#kv-tip")


def test_common_prefix_shares_blocks_then_everything_is_freed(page, tmp_path):
    set_controls(page, max_tokens=900)
    run_prompt(page, PREFIX + "first")
    page.wait_for_function("document.querySelectorAll('.output .completion')[0].textContent.length > 5",
                           timeout=30_000)  # its prompt blocks are computed and in the prefix cache
    run_prompt(page, PREFIX + "second")
    wait_count(page, "shared", ">=", 4)
    shared = blocks_in(page, "shared")
    tip = hover_block(page, shared[0])
    assert "ref count 2" in tip and "16/16 tokens" in tip and tip.count("(seq ") == 2, tip
    assert block_pixel(page, shared[0]) == (0xF2, 0xC1, 0x4E)  # COLOURS.shared
    shot = Path(os.environ.get("PLAYGROUND_SCREENSHOT") or tmp_path / "playground.png")
    box = page.locator("main").bounding_box()
    page.screenshot(path=str(shot), clip={"x": 0, "y": 0, "width": 1280, "height": box["y"] + box["height"]})
    assert shot.stat().st_size > 10_000
    page.click("#stop")
    wait_count(page, "used", "==", 0)
    assert count(page, "cached") >= 4  # the ended requests' full blocks stay reusable
    assert blocks_in(page, "cached") and block_pixel(page, blocks_in(page, "cached")[0]) == (0x59, 0x6A, 0x80)
    assert page.problems == []


def test_forked_choices_share_the_prompt_blocks(page):
    set_controls(page, max_tokens=900, n=2)
    run_prompt(page, PREFIX)  # 73 tokens with BOS: 4 full blocks shared, the partial one copied per choice
    wait_count(page, "shared", ">=", 4)
    shared = blocks_in(page, "shared")
    tip = hover_block(page, shared[0])
    assert "ref count 2" in tip and "#0 (seq" in tip and "#1 (seq" in tip, tip
    page.click("#stop")
    wait_count(page, "used", "==", 0)
    assert page.problems == []


SYNTHETIC_MAP = """() => {
    const n = 400000, seqs = [];
    for (let k = 0; k < 8; k++) {  // 8 sequences of 12,500 blocks each: blocks 1..100,000
        seqs.push({seq_id: k, request_id: `cmpl-${k}`, index: 0, num_tokens: 16 * 12500,
                   blocks: [[1 + k * 12500, 12500]]});
    }
    const every50 = [];
    for (let b = 50; b <= 100000; b += 50) every50.push([b, 1]);
    seqs.push({seq_id: 8, request_id: "cmpl-x", index: 0, num_tokens: 16 * every50.length, blocks: every50});
    const snap = {block_size: 16, num_blocks: n, free_blocks: n - 1 - 150000, used_blocks: 100000,
                  cached_blocks: 50000, seqs, cached: [[200000, 50000]], running: 9, waiting: 0};
    const start = performance.now();
    window.playground.showSnapshot(snap);
    return performance.now() - start;
}"""


def test_a_gpu_sized_cache_aggregates_cells_and_says_so(page):
    page.uncheck("#live")
    page.wait_for_selector("#kv-status:text-is('paused')")
    ms = page.evaluate(SYNTHETIC_MAP)
    assert ms < 3000, f"{ms:.0f} ms to draw 400K blocks"
    assert page.inner_text("#kv-scale") == "1 cell = 16 blocks"  # 186 x 140 cells of 3 px
    assert count(page, "total") == 400000 and count(page, "shared") == 2000
    assert page.evaluate("document.getElementById('kv-map').height") <= 420
    tip = hover_block(page, 16 * 1000)
    assert tip.startswith("blocks 16000–16015 (1 cell = 16 blocks)\n15 used · 1 shared · 0 cached-free"), tip
    assert block_pixel(page, 250000 + 32) == FREE_RGB
    page.check("#live")  # the stream resumes and the server's map replaces the synthetic one
    wait_count(page, "total", "==", 160)
    assert page.inner_text("#kv-status") == "live" and page.inner_text("#kv-scale") == "1 cell = 1 block"
    assert page.problems == []


def test_preemption_shows_when_the_cache_is_too_small(browser, tmp_path):
    # 23 usable blocks of 16 (368 slots) cannot hold 6 x ~120 tokens at once: some sequences are preempted
    srv = Server(tmp_path, "--num-blocks", "24", "--max-num-seqs", "8")
    try:
        with open_page(browser, srv.url) as pg:
            set_controls(pg, max_tokens=90)
            pg.locator("#prompts textarea").first.fill("prompt 0: the quick brown fox")
            for i in range(1, 6):
                pg.evaluate(f"window.playground.addPrompt('prompt {i}: the quick brown fox')")
            pg.click("#run")
            pg.wait_for_function("document.querySelectorAll('.output.done').length >= 6", timeout=60_000)
            preempted = srv.metric("pagewalk_num_preemptions_total")   # final: every request is done
            assert preempted > 0
            # the page shows the map stream's latest snapshot, which may still be one from before the last
            # preemption on a loaded machine: wait for it to catch up rather than read it once
            wait_count(pg, "preemptions", "==", int(preempted))
            wait_count(pg, "used", "==", 0)
            assert pg.problems == []
    finally:
        srv.stop()


def test_the_first_run_after_typing_the_key_is_served(browser, tmp_path):
    """On a server with --api-key the page learns the model name only once the key is in; a Run right after
    typing it sends no model (the server's own) instead of a made-up name (it got a 404)."""
    srv = Server(tmp_path, "--num-blocks", "64", "--api-key", "k3y")
    try:
        context = browser.new_context(viewport={"width": 1280, "height": 860})
        pg = context.new_page()
        pg.goto(srv.url)
        set_controls(pg, max_tokens=8)
        pg.locator("#prompts textarea").first.fill("Hello: ")
        pg.fill("#api-key", "k3y")
        pg.click("#run")  # the key's change event (its blur) starts the model lookup: Run comes first
        pg.wait_for_selector(".output.done", timeout=30_000)
        text = pg.inner_text(".output")
        assert "404" not in text and "does not exist" not in text, text
        assert len(pg.inner_text(".output .completion")) > 0
        context.close()
    finally:
        srv.stop()
