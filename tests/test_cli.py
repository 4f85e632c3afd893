"""`pagewalk serve` flags: vLLM's spellings, defaults in --help, one-line start-up errors."""

from __future__ import annotations

import argparse

import pytest
import torch

from server.cli import build_parser, debug_endpoints, engine_config, main, parse_serve_args
from server.model.loader import resolve_dtype


def serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def test_model_positional_or_flag():
    assert parse_serve_args(["serve"]).model == "tiny"
    assert parse_serve_args(["serve", "/ckpt/llama"]).model == "/ckpt/llama"
    assert parse_serve_args(["serve", "--model", "/ckpt/llama"]).model == "/ckpt/llama"
    assert parse_serve_args(["serve", "bench", "--model", "bench"]).model == "bench"
    with pytest.raises(SystemExit):
        parse_serve_args(["serve", "tiny", "--model", "bench"])


@pytest.mark.parametrize("flag,dtype", [("half", torch.float16), ("float16", torch.float16),
                                        ("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16),
                                        ("float", torch.float32), ("float32", torch.float32)])
def test_dtype_spellings_reach_the_loader(flag, dtype):
    config = engine_config(parse_serve_args(["serve", "--dtype", flag]))
    assert resolve_dtype(config.dtype, torch.device("cpu")) == dtype
    assert engine_config(parse_serve_args(["serve"])).dtype is None  # auto


def test_vllm_flags_reach_the_engine_config():
    args = parse_serve_args(["serve", "tiny", "--served-model-name", "my-model", "alias", "--seed", "7",
                             "--tokenizer", "/tok", "--chat-template", "{{ 1 }}",
                             "--gpu-memory-utilization", "0.5", "--no-enable-prefix-caching"])
    config = engine_config(args)
    assert config.served_model_name == ("my-model", "alias") and config.seed == 7
    assert (config.tokenizer, config.chat_template) == ("/tok", "{{ 1 }}")
    assert config.gpu_memory_utilization == 0.5 and config.enable_prefix_caching is False
    defaults = engine_config(parse_serve_args(["serve"]))
    assert defaults.served_model_name == () and defaults.seed is None and defaults.enable_prefix_caching


@pytest.mark.parametrize("argv,message", [
    (["--gpu-memory-utilization", "1.5"], "must be a fraction in (0, 1]"),
    (["--kv-cache-memory", "0.9"], "--kv-cache-memory is retired: use --gpu-memory-utilization"),
    (["--dtype", "int8"], "invalid choice"),
    (["--api-server-count", "0"], "--api-server-count must be at least 1"),
    (["--api-server-count", "2", "--engine-in-process"], "excludes --api-server-count"),
    (["--max-num-batched-tokens", "0"], "must be an integer >= 1, got 0"),  # every request hung
    (["--max-num-seqs", "-1"], "must be an integer >= 1, got -1"),
    (["--max-num-seqs", "100000000"], "must be at most 65536"),  # never finished starting
    (["--max-waiting", "0"], "must be an integer >= 1"),
    (["--max-connections", "0"], "must be an integer >= 1"),
    (["--max-model-len", "0"], "must be a whole number of tokens >= 2"),
    (["--max-model-len", "1"], "must be a whole number of tokens >= 2"),  # served nothing (a review)
    (["--max-model-len", "32kb"], "expected a token count"),
    (["--max-model-len", "0.0005k"], "must be a whole number of tokens"),
    (["--served-model-name", ""], "a served model name must not be empty"),  # an id no client can use
    (["--max-seqs", "4"], "unrecognized arguments: --max-seqs"),  # meant --max-seqs-per-request
    (["--allowed-origins", '["*"]', "--allow-credentials"], "name the origins"),  # reflected any (a review)
    (["tiny", "--served-model-name", " "], "a served model name must not be empty"),
    (["--max-body-bytes", "0"], "must be an integer >= 1"),
    (["--port", "70000"], "must be a port number in [0, 65535]"),
    (["--max-stop-strings", "-1"], "must be an integer >= 1"),  # every request was refused
    (["--max-prompts", "0"], "must be an integer >= 1"),
    (["--max-choices", "0"], "must be an integer >= 1"),
    (["--max-logprob-entries", "0"], "must be an integer >= 1"),
    (["--max-request-tokens", "0"], "must be an integer >= 1"),
    (["--max-stop-string-length", "0"], "must be an integer >= 1"),
    (["--max-seqs-per-request", "0"], "must be an integer >= 1"),  # silently meant the default
    (["--timeout-keep-alive", "0"], "must be an integer >= 1"),
    (["--header-timeout", "-1"], "must be a number of seconds > 0"),  # every request was a 408
    (["--client-stall-timeout", "nan"], "must be a number of seconds > 0"),
    (["--shutdown-timeout", "-1"], "must be a number of seconds >= 0"),  # a drain aborted everything
    (["--shutdown-timeout", "inf"], "must be a number of seconds >= 0"),
    (["--seed", str(2**64)], "must be in [-2**63, 2**63)"),
])
def test_bad_flags_are_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        parse_serve_args(["serve", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("value, tokens", [("4096", 4096), ("1k", 1000), ("2K", 2048), ("25.6k", 25600),
                                          ("1.1k", 1100), ("1M", 1 << 20)])
def test_max_model_len_takes_vllms_spellings(value, tokens):
    assert parse_serve_args(["serve", "--max-model-len", value]).max_model_len == tokens


def test_a_served_name_given_twice_is_listed_once():
    args = parse_serve_args(["serve", "tiny", "--served-model-name", "a", "b", "a"])
    assert args.served_model_name == ["a", "b"]


def test_the_url_of_every_interface_is_one_a_client_can_use():
    from server.cli import http_url

    assert (http_url("", 8000), http_url("::", 8000)) == ("http://0.0.0.0:8000", "http://[::]:8000")


def test_api_key_defaults_to_the_environment_but_help_never_shows_it(monkeypatch):
    monkeypatch.setenv("PAGEWALK_API_KEY", "sekrit")
    assert parse_serve_args(["serve"]).api_key == "sekrit"
    assert parse_serve_args(["serve", "--api-key", "other"]).api_key == "other"
    assert "sekrit" not in serve_parser().format_help()


def test_an_api_key_is_what_a_client_can_send(monkeypatch, capsys):
    """A secret file's trailing newline is not part of the key (the client's token is stripped too); a key
    no HTTP header can carry is refused at start-up (a review: both started servers that answered 401 to
    every request)."""
    monkeypatch.setenv("PAGEWALK_API_KEY", "abc123\n")
    assert parse_serve_args(["serve"]).api_key == "abc123"
    for key in ("clé-secrète", " \n", "tab\tkey"):
        with pytest.raises(SystemExit) as e:
            parse_serve_args(["serve", "--api-key", key])
        assert e.value.code == 2 and "must be printable ASCII" in capsys.readouterr().err
    monkeypatch.setenv("PAGEWALK_API_KEY", "")
    assert parse_serve_args(["serve"]).api_key == ""  # empty: auth off, as vLLM


def test_help_has_text_and_defaults_for_every_flag():
    parser = serve_parser()
    for action in parser._actions:
        assert action.help, f"{action.option_strings or action.dest} has no help"
    text = " ".join(parser.format_help().split())
    for default in ("(default: 16)", "(default: auto)", "(default: 2048)", "(default: 127.0.0.1)",
                    "(default: 8000)", "(default: True)", "(default: tiny)"):
        assert default in text


@pytest.mark.parametrize("argv,message", [
    (["meta-llama/Llama-3.1-8B"], "does not download from the Hugging Face Hub"),
    (["/no/such/dir"], "neither a preset (tiny, bench) nor a checkpoint directory"),
    (["tiny", "--chat-template", "{% if %}"], "chat template from --chat-template does not compile"),
    (["tiny", "--chat-template", "/no/template.jinja"], "neither a file nor a jinja template"),
    (["tiny", "--tokenizer", "/no/tokenizer"], "is not a directory holding tokenizer.json"),
    (["tiny", "--num-blocks", "1"], "num_blocks must be >= 2"),  # raised by the engine core
    (["tiny", "--max-model-len", "100000"], "exceeds the model's max_position_embeddings (2048)"),
])
def test_start_up_errors_are_one_line(capsys, argv, message):
    assert main(["serve", *argv, "--device", "cpu", "--engine-in-process", "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("pagewalk serve: error: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_one_api_server_loads_its_tokenizer_once(capsys, monkeypatch):
    """Start-up loads the tokenizer to check it before binding the port; the engine reuses that one."""
    import server.api.async_engine as async_engine
    import server.model.loader as loader

    loads = []
    real = loader.load_tokenizer

    def counted(*args, **kwargs):
        loads.append(args)
        return real(*args, **kwargs)

    def stop_after_the_tokenizer(model):
        raise ValueError("stopped after the tokenizer")

    monkeypatch.setattr(loader, "load_tokenizer", counted)
    monkeypatch.setattr(async_engine, "load_tokenizer", counted)
    monkeypatch.setattr(async_engine, "sampling_defaults", stop_after_the_tokenizer)
    assert main(["serve", "tiny", "--device", "cpu", "--engine-in-process", "--port", "0"]) == 1
    assert "stopped after the tokenizer" in capsys.readouterr().err
    assert len(loads) == 1


@pytest.mark.parametrize("argv,message", [
    (["/no/such/dir"], "neither a preset (tiny, bench) nor a checkpoint directory"),  # the supervisor's check
    (["tiny", "--num-blocks", "1"], "num_blocks must be >= 2"),  # raised by the engine core
])
def test_start_up_errors_with_several_api_servers_are_one_line(capsys, argv, message):
    assert main(["serve", *argv, "--device", "cpu", "--api-server-count", "2", "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("pagewalk serve: error: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_seed_makes_unseeded_sampling_repeat_across_restarts():
    from server.engine.sampling_params import SamplingParams
    from tests.engine_helpers import make_engine, run_one

    def sample(seed: int) -> list[int]:
        engine = make_engine(seed=seed)
        try:
            params = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)  # no request seed
            return run_one(engine, "r", engine.tokenizer.encode("seeded"), params).choices[0].token_ids
        finally:
            engine.shutdown(timeout=5)

    first = sample(7)
    assert sample(7) == first and sample(8) != first


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_device_is_one_line(capsys):
    assert main(["serve", "tiny", "--device", "cuda", "--engine-in-process", "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("pagewalk serve: error: --device cuda: no CUDA device") and err.count("\n") == 1


def test_the_open_file_limit_is_raised_to_the_hard_one(monkeypatch, caplog):
    """At a soft limit of 1024 the API process ran out of descriptors below --max-connections: new clients
    hung instead of getting the cap's 503 (a review). Start-up raises it to the hard limit, and warns where
    the connections still do not fit."""
    import resource

    from server.cli import raise_open_file_limit

    limits = {"now": (1024, 4096)}
    monkeypatch.setattr(resource, "getrlimit", lambda which: limits["now"])
    monkeypatch.setattr(resource, "setrlimit", lambda which, value: limits.update(now=value))
    with caplog.at_level("WARNING", logger="pagewalk"):
        raise_open_file_limit(1024)
    assert limits["now"] == (4096, 4096) and not caplog.records
    limits["now"] = (1024, 1024)
    with caplog.at_level("WARNING", logger="pagewalk"):
        raise_open_file_limit(1024)
    assert "below --max-connections 1024" in caplog.text


@pytest.mark.parametrize("argv, on", [
    ([], True), (["--host", "127.0.0.1"], True), (["--host", "::1"], True),
    (["--host", "0.0.0.0"], False), (["--host", ""], False),
    (["--host", "0.0.0.0", "--debug-endpoints"], True), (["--no-debug-endpoints"], False),
])
def test_debug_endpoints_default_to_a_server_on_loopback_only(argv, on):
    assert debug_endpoints(parse_serve_args(["serve", *argv])) is on
