"""POST /tokenize and /detokenize, in vLLM's shapes: text or chat messages -> the ids the server would run,
and ids -> text. Outside /v1, as in vLLM (the bearer-token check guards /v1/* only)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from server.api.openapi_bodies import request_body
from server.api.parsing import check_model, parse_body
from server.api.prompts import chat_prompt_ids, template_variables
from server.api.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from server.api.sampling import check_token_ids

router = APIRouter()


@router.post("/tokenize", openapi_extra=request_body(TokenizeRequest, {"prompt": "Hello"}))
async def tokenize(request: Request) -> dict:
    engine = request.app.state.engine
    req = await parse_body(request, TokenizeRequest)
    check_model(engine, req.model)
    tok = engine.tokenizer
    if req.prompt is not None:
        ids = tok.encode(req.prompt, add_bos=req.add_special_tokens is not False)
    else:
        ids = chat_prompt_ids(tok, req.messages, req.add_generation_prompt, req.add_special_tokens,
                              template_variables(req.chat_template_kwargs, req.tools))
    return TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids).model_dump()


@router.post("/detokenize", openapi_extra=request_body(DetokenizeRequest))
async def detokenize(request: Request) -> dict:
    engine = request.app.state.engine
    req = await parse_body(request, DetokenizeRequest)
    check_model(engine, req.model)
    check_token_ids(req.tokens, engine.tokenizer.vocab_size, "tokens")
    # special tokens are kept, as vLLM's /detokenize keeps them: the text tokenizes back to the same ids
    text = engine.tokenizer.decode(req.tokens, skip_special_tokens=False)
    return DetokenizeResponse(prompt=text).model_dump()
