"""Start-up refusals that are one clear line, not a traceback or a server that fails later: an engine built
in-process that cannot start, a TMPDIR too long for the core's socket, EOS ids that are not tokens, a chat
template file that is not UTF-8; and a shutdown timeout longer than threading can wait."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from engine_helpers import collect, make_engine

from server.engine import core_client
from server.engine.core_client import CoreStartupError, ThreadCoreClient
from server.engine.engine import EngineConfig, _checked_eos_ids
from server.engine.sampling_params import SamplingParams
from server.model.chat_template import load_chat_template


def test_an_in_process_engine_that_cannot_be_built_is_a_startup_error():
    config = EngineConfig(model="tiny", device="cpu", attention_backend="torch", num_blocks=10**11)
    with pytest.raises(CoreStartupError, match="RuntimeError|MemoryError|ValueError"):
        ThreadCoreClient(config)


def test_a_tmpdir_too_long_for_a_socket_falls_back_to_tmp(tmp_path, monkeypatch):
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    monkeypatch.setattr(core_client.tempfile, "tempdir", str(deep))
    path = core_client._socket_dir()
    try:
        assert path.parent == Path("/tmp") and len(bytes(path / "core")) <= core_client.SUN_PATH_MAX
        assert not list(deep.iterdir())  # the long one was removed
    finally:
        path.rmdir()


def test_no_directory_for_the_socket_is_a_clear_error(tmp_path, monkeypatch):
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    real = core_client.tempfile.mkdtemp
    monkeypatch.setattr(core_client.tempfile, "tempdir", str(deep))
    monkeypatch.setattr(core_client.tempfile, "mkdtemp",
                        lambda prefix, dir=None: real(prefix=prefix, dir=dir) if dir is None else
                        (_ for _ in ()).throw(PermissionError(13, "Permission denied", dir)))
    with pytest.raises(ValueError, match="TMPDIR"):
        core_client._socket_dir()
    assert not list(deep.iterdir())


@pytest.mark.parametrize("ids", [[100000], [2, 5000], [-1], ["2"], [True]])
def test_eos_ids_must_be_tokens_of_the_model(ids):
    with pytest.raises(ValueError, match="eos_token_id"):
        _checked_eos_ids(ids, vocab_size=300)
    assert _checked_eos_ids([0, 2, 299], vocab_size=300) == [0, 2, 299]


def test_a_chat_template_file_that_is_not_utf8_is_named(tmp_path):
    bad = tmp_path / "template.jinja"
    bad.write_bytes(b"\xff\xfe{{ messages }}")
    with pytest.raises(ValueError, match="template.jinja"):
        load_chat_template(str(bad))


def test_a_shutdown_timeout_beyond_threadings_wait_still_drains():
    """--shutdown-timeout 1e10 overflowed Condition.wait: the drain raised and the request got a 503."""
    e = make_engine()
    try:
        async def main():
            params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
            task = asyncio.create_task(collect(e, "long", [1, 5, 6], params))
            while e.health()["running"] < 1:
                await asyncio.sleep(0.01)
            await asyncio.to_thread(e.shutdown, timeout=1e10)
            return await task

        out = asyncio.run(main())
        assert out.choices[0].finish_reason == "length" and len(out.choices[0].token_ids) == 40
    finally:
        e.shutdown(timeout=5)
