"""OutputChannel: the per-request FIFO the engine thread fills (call_soon_threadsafe) and generate drains."""

from __future__ import annotations

import asyncio

import pytest

from server.api.output_channel import OutputChannel


def test_fifo_wakes_the_reader_and_survives_a_cancelled_read():
    async def main():
        ch = OutputChannel(asyncio.get_running_loop())
        ch.put("a")
        ch.put("b")
        assert [await ch.get(), await ch.get()] == ["a", "b"]
        reader = asyncio.ensure_future(ch.get())
        await asyncio.sleep(0)
        assert not reader.done()
        ch.put("c")
        assert await asyncio.wait_for(reader, 1) == "c"
        cancelled = asyncio.ensure_future(ch.get())
        await asyncio.sleep(0)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        ch.put("d")  # the cancelled reader's waiter is done: no InvalidStateError
        ch.put("e")
        assert [await ch.get(), await ch.get()] == ["d", "e"]

    asyncio.run(main())


def test_a_reader_that_fell_behind_gets_one_merged_output():
    from server.api.outputs import ChoiceDelta, RequestOutput, TokenLogprob

    lp = [TokenLogprob(7, "b", -0.5)]
    outs = [RequestOutput("r", [1], [ChoiceDelta(0, "a", [6], None), ChoiceDelta(1, "x", [9], None)], False),
            RequestOutput("r", [1], [ChoiceDelta(0, "b", [7], lp, "length")], False),
            RequestOutput("r", [1], [ChoiceDelta(1, "", [], None, "abort")], True)]

    async def main():
        ch = OutputChannel(asyncio.get_running_loop())
        for o in outs:
            ch.put(o)
        return await ch.get_merged(), ch.items

    merged, left = asyncio.run(main())
    assert not left and merged.finished and merged.error is None
    assert [(d.index, d.text, d.token_ids, d.finish_reason) for d in merged.deltas] == \
        [(0, "ab", [6, 7], "length"), (1, "x", [9], "abort")]
    assert merged.deltas[0].logprobs == lp and outs[0].deltas[0].token_ids == [6]  # inputs untouched


def test_put_merged_leaves_what_get_merged_would_return():
    from server.api.outputs import ChoiceDelta, RequestOutput, TokenLogprob

    def outs():
        lp = [TokenLogprob(7, "b", -0.5)]
        return [RequestOutput("r", [1], [ChoiceDelta(0, "a", [6], None, prompt_logprobs=[None])], False),
                RequestOutput("r", [1], [ChoiceDelta(1, "x", [9], None)], False, "boom"),
                RequestOutput("r", [1], [ChoiceDelta(0, "b", [7], lp, "length")], False, "later"),
                RequestOutput("r", [1], [ChoiceDelta(1, "", [], None, "abort")], True)]

    def fields(out):
        return (out.request_id, out.prompt_token_ids, out.finished, out.error,
                [(d.index, d.text, d.token_ids, d.logprobs, d.finish_reason, d.stop_reason, d.prompt_logprobs)
                 for d in out.deltas])

    async def drain(put_merged_from: int):
        ch = OutputChannel(asyncio.get_running_loop())
        inputs = outs()
        for i, o in enumerate(inputs):
            (ch.put_merged if i >= put_merged_from else ch.put)(o)
        waiting = len(ch.items)
        return await ch.get_merged(), waiting, inputs

    plain, _, _ = asyncio.run(drain(len(outs())))
    for start in range(len(outs())):
        merged, waiting, inputs = asyncio.run(drain(start))
        assert fields(merged) == fields(plain)
        assert waiting == max(1, start)  # everything put_merged joined the output waiting before it
        assert [fields(o) for o in inputs] == [fields(o) for o in outs()]  # inputs untouched


def test_put_merged_wakes_a_waiting_reader_and_starts_anew_once_read():
    from server.api.outputs import ChoiceDelta, RequestOutput

    async def main():
        ch = OutputChannel(asyncio.get_running_loop())
        reader = asyncio.ensure_future(ch.get_merged())
        await asyncio.sleep(0)
        ch.put_merged(RequestOutput("r", [1], [ChoiceDelta(0, "a", [6], None)], False))
        first = await asyncio.wait_for(reader, 1)
        ch.put_merged(RequestOutput("r", [1], [ChoiceDelta(0, "b", [7], None)], False))
        ch.put_merged(RequestOutput("r", [1], [ChoiceDelta(0, "c", [8], None)], True))
        second = await ch.get_merged()
        return first, second

    first, second = asyncio.run(main())
    assert [(d.text, d.token_ids) for d in first.deltas] == [("a", [6])]
    assert [(d.text, d.token_ids) for d in second.deltas] == [("bc", [7, 8])] and second.finished
