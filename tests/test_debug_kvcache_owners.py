"""The block map names each choice as its client sees it: the playground (server/api/playground/app.js
RequestView.identify) colours each card by `${chunk.id}#${i}`, and the map's owner of that choice carries the
same key (kvmap.js ownerKey: `${request_id}#${index}`), though the engine knows the request by the response
id + 16 random hex digits (request_ids.engine_request_id; a review found the map naming those), and a
completion's prompt i by that + "-{i}", its choices at i x n + their index."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from server.api.app import create_app
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
