"""The block map names each choice as its client sees it: the playground (server/api/playground/app.js
RequestView.identify) colours each card by `${chunk.id}#${i}`, and the map's owner of that choice carries the
same key (kvmap.js ownerKey: `${request_id}#${index}`), though the engine knows the request by the response
id + 16 random hex digits (request_ids.engine_request_id; a review found the map naming those), and a
completion's prompt i by that + "-{i}", its choices at i x n + their index."""

from __future__ import annotations

import asyncio
import json
import threading
from types import SimpleNamespace

import httpx
import pytest

from server.api.app import create_app
from server.api.async_engine import AsyncEngine
from server.engine.sampling_params import SamplingParams
from tests.engine_helpers import started_engine

pytestmark = pytest.mark.timeout(180)


def block_map_owners(body: dict, choices: int) -> tuple[str, set[tuple[str, int]]]:
    """-> the streamed response's id, and the (request_id, index) owners the block map showed meanwhile
    (until it showed `choices` of them)."""
    with started_engine(model="tiny", device="cpu", attention_backend="torch", num_blocks=256) as eng:
        app = create_app(eng)

        async def go():
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                task = asyncio.create_task(c.post("/v1/completions", json=body, timeout=120))
                owners = set()
                for _ in range(200):
                    await asyncio.sleep(0.05)
                    snap = (await c.get("/debug/kvcache")).json()
                    owners |= {(s["request_id"], s["index"]) for s in snap["seqs"]}
                    if len(owners) >= choices:
                        break
                r = await task
                first = json.loads(r.text.split("\n\n")[0].removeprefix("data: "))
                return first["id"], owners

        return asyncio.run(go())


def test_block_map_owner_is_the_streamed_response_id():
    body = {"prompt": "Hi there", "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
    response_id, owners = block_map_owners(body, 1)
    assert owners == {(response_id, 0)}, (response_id, owners)


def test_block_map_names_a_completions_prompts_by_its_choice_indices():
    body = {"prompt": ["Hi there", "And you"], "n": 2, "max_tokens": 200, "temperature": 0.5,
            "ignore_eos": True, "stream": True}
    response_id, owners = block_map_owners(body, 4)
    assert owners == {(response_id, i) for i in range(4)}, (response_id, owners)


def test_two_requests_under_one_client_id_are_told_apart_in_the_block_map():
    """Two live requests under one client request_id keep their engine ids in the map (one key each)."""
    body = {"prompt": "Hi there", "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True,
            "request_id": "same"}
    with started_engine(model="tiny", device="cpu", attention_backend="torch", num_blocks=256) as eng:
        app = create_app(eng)

        async def go():
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                tasks = [asyncio.create_task(c.post("/v1/completions", json=body, timeout=120))
                         for _ in range(2)]
                seqs = []
                for _ in range(200):
                    await asyncio.sleep(0.05)
                    seqs = (await c.get("/debug/kvcache")).json()["seqs"]
                    if len(seqs) >= 2:
                        break
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                return seqs

        seqs = asyncio.run(go())
    assert len(seqs) == 2, seqs
    keys = [f"{s['request_id']}#{s['index']}" for s in seqs]  # kvmap.js ownerKey
    assert len(set(keys)) == 2, keys


ENGINE_ID = "cmpl-abc-0123456789abcdef-1"  # prompt 1 of a completion, as merged_outputs names it
LABEL = ("cmpl-abc", 2)  # its response id, and its choice 0's index there (n = 2)


def test_a_seq_whose_request_ends_after_the_reply_keeps_its_label():
    """The core answers before its next step; the request may end before the reply reaches the event loop:
    its label, taken when the map was asked for, still names it (a review saw its engine id)."""
    with started_engine(model="tiny", device="cpu", dtype="float32", attention_backend="torch",
                        num_blocks=256) as eng:
        real_query = eng._query

        async def go():
            params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
            gen = eng.generate(ENGINE_ID, [1, 5, 6, 7], params, group="cmpl-abc-0123456789abcdef",
                               label=LABEL)
            await gen.__anext__()  # running in the core

            async def drain():
                async for _ in gen:
                    pass

            async def late_query(name):
                reply = await real_query(name)
                # the event loop reaches this continuation a little later (busy streaming); meanwhile
                # the request's last tokens arrive on the client thread
                while ENGINE_ID in eng._live:
                    await asyncio.sleep(0.005)
                return reply

            eng._query = late_query
            task = asyncio.create_task(drain())
            snap = await eng.kv_snapshot()
            await task
            return snap

        snap = asyncio.run(go())
    owners = {(s.get("request_id"), s.get("index")) for s in snap["seqs"]}
    assert owners == {LABEL}, owners


def test_two_requests_under_one_client_id_keep_distinct_keys():
    """Two live completions under one client id: A's prompt 1 (label ("cmpl-same", 1)) and B's n = 2 (label
    ("cmpl-same", 0)) would both name a choice "cmpl-same"#1: both keep their engine ids (a review found
    the labels counted, not the names they make)."""
    eng = AsyncEngine.__new__(AsyncEngine)
    eng._lock = threading.Lock()
    eng._live = {"cmpl-same-aaaa-1": SimpleNamespace(label=("cmpl-same", 1)),
                 "cmpl-same-bbbb": SimpleNamespace(label=("cmpl-same", 0))}

    async def query(name):
        assert name == "kv_snapshot"
        return {"seqs": [{"seq_id": 1, "request_id": "cmpl-same-aaaa-1", "index": 0},
                         {"seq_id": 2, "request_id": "cmpl-same-bbbb", "index": 0},
                         {"seq_id": 3, "request_id": "cmpl-same-bbbb", "index": 1}]}

    eng._query = query
    snap = asyncio.run(eng.kv_snapshot())
    keys = [f"{s['request_id']}#{s['index']}" for s in snap["seqs"]]  # kvmap.js ownerKey
    assert len(set(keys)) == 3, keys
