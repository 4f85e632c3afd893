"""The messages between the API process and the engine-core process, and their msgpack codecs.

To the core: Hello (a client's first message), EngineRequest (add), Abort, Query, Shutdown (and Gone, which
the core's receiver makes up for a client whose process ended). From the core:
Ready (the answer to Hello, once the core is built) or StartupFailed, then StepUpdates and Replies. Every
message is a tagged msgspec Struct, so one decoder per direction reads them all.
"""

from __future__ import annotations

import msgspec

from server.engine.outputs import EngineRequest, StepUpdate


class CoreInfo(msgspec.Struct):
    """Static facts of a started core: what /health, /v1/models and admission need."""

    model: str
    device: str
    dtype: str
    attention_backend: str
    cuda_graphs: bool
    block_size: int
    num_blocks: int  # the null block 0 included
    capacity_tokens: int  # usable blocks x block_size
    max_model_len: int
    vocab_size: int
    decoder_ops: str = "torch"  # "fused": the decoder's Triton kernels (server/model/fused_forward.py)
    kernels_refused: tuple[str, ...] = ()  # fused kernels a start-up check turned off on this device


class Hello(msgspec.Struct, tag="hello"):
    """A client's first message: the core answers Ready (or StartupFailed) and from then on sends it a
    StepUpdate every step, with the updates of the requests it added (`updates` False: a client that only
    controls the core, the supervisor of several API servers, gets none)."""

    updates: bool = True
    pid: int = 0  # the client's process (0: none to watch, as in-process): its end ends its requests


class Ping(msgspec.Struct, tag="ping"):
    """A client's sign of life, sent once a HEARTBEAT_S when it has sent nothing else: the core takes a client
    that takes StepUpdates and is silent for SILENT_S as hung (core_process.ClientWatch) and ends it."""


HEARTBEAT_S = 1.0
SILENT_S = 15.0  # a process whose every thread stood still this long (SIGSTOP, a deadlock, swapping)


class Gone(msgspec.Struct, tag="gone"):
    """No message on the wire: the core's receiver reports a client whose process has ended (an API server
    killed), so the core aborts its requests rather than run them for nobody."""


class Abort(msgspec.Struct, tag="abort"):
    request_id: str
    index: int | None = None  # one choice (a stop string ended it); None: every choice


class Query(msgspec.Struct, tag="query"):
    """Ask the core for one of its read-only views ("stats" | "kv_snapshot"); answered by a Reply."""

    call_id: int
    name: str


class Shutdown(msgspec.Struct, tag="shutdown"):
    """Stop the core loop (the API process has drained or aborted every request first)."""


class Ready(msgspec.Struct, tag="ready"):
    info: CoreInfo


class StartupFailed(msgspec.Struct, tag="startup_failed"):
    error: str  # exception type, message and the traceback's last lines


class Reply(msgspec.Struct, tag="reply"):
    call_id: int
    value: dict


ToCore = Hello | EngineRequest | Abort | Query | Shutdown | Gone | Ping
FromCore = StepUpdate | Reply | Ready | StartupFailed


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def to_core_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(ToCore)


def from_core_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(FromCore)
