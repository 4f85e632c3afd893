"""POST /tokenize and /detokenize, in vLLM's shapes: text or chat messages -> the ids the server would run,
and ids -> text. Outside /v1, as in vLLM (the bearer-token check guards /v1/* only).

A body may hold a megabyte of text or a quarter million ids: the tokenizer runs on a worker thread (its own:
these routes are open without the key, request_work.run_utility_work) and the
answer is serialised by pydantic's own JSON, not FastAPI's encoder, so the event loop keeps serving the
streams (a review: one client's large /tokenize bodies made every other stream's TPOT 17x). In process, tiny
preset, this 2-core box: a 1 MB /tokenize held the loop for its whole 130-350 ms before, its longest pause is
~65 ms now (parsing the body); a 250K-id /detokenize: 100-140 ms before, 6 ms now."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from server.api.openapi_bodies import request_body
from server.api.parsing import check_model, parse_body
from server.api.prompts import chat_prompt_ids, template_variables
from server.api.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from server.api.request_work import run_utility_work
from server.api.sampling import check_token_ids

router = APIRouter()


@router.post("/tokenize", openapi_extra=request_body(TokenizeRequest, {"prompt": "Hello"}),
             response_model=TokenizeResponse)  # the schema's (a Response returned passes as it is)
async def tokenize(request: Request) -> Response:
    engine = request.app.state.engine
    req = await parse_body(request, TokenizeRequest)
    check_model(engine, req.model)
    tok = engine.tokenizer
    if req.prompt is not None:
        ids = await run_utility_work(tok.encode, req.prompt, add_bos=req.add_special_tokens is not False)
    else:
        ids = await run_utility_work(chat_prompt_ids, tok, req.messages, req.add_generation_prompt,
                                     req.add_special_tokens,
                                     template_variables(req.chat_template_kwargs, req.tools))
    body = TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids)
    return Response(body.model_dump_json(), media_type="application/json")


@router.post("/detokenize", openapi_extra=request_body(DetokenizeRequest), response_model=DetokenizeResponse)
async def detokenize(request: Request) -> Response:
    engine = request.app.state.engine
    req = await parse_body(request, DetokenizeRequest)
    check_model(engine, req.model)
    check_token_ids(req.tokens, engine.tokenizer.vocab_size, "tokens")
    # special tokens are kept, as vLLM's /detokenize keeps them: the text tokenizes back to the same ids
    text = await run_utility_work(engine.tokenizer.decode, req.tokens, skip_special_tokens=False)
    return Response(DetokenizeResponse(prompt=text).model_dump_json(), media_type="application/json")
