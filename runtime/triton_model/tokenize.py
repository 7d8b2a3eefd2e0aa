"""The `llm` model's tokenizer door (the request contract's `tokenize` field): a prompt's token ids, or token ids'
text, from the engine's own tokenizer and chat template, with no generation. The gateway's /tokenize and
/detokenize (vLLM's routes) and its echo of token-id prompts come here, so a client counts exactly the
tokens the engine will (the gateway never loads a tokenizer: it may run where the engine's files are not).
"""

from __future__ import annotations

import json

from runtime import AsyncLLM, RequestOutput
from runtime.triton_model.inputs import ParsedRequest


async def tokenizer_answer(engine: AsyncLLM, parsed: ParsedRequest, request_id: str) -> RequestOutput:
    """ "encode": text_output is `{"tokens": [...], "max_model_len": N}` and prompt_tokens their count;
    "decode": text_output is the ids' text (special tokens kept, so that it encodes back to them)."""
    if parsed.tokenize == "decode":
        assert isinstance(parsed.prompt, list)  # parse_request: decode takes input_ids
        text = await engine.detokenize(parsed.prompt)
        return RequestOutput(request_id, text, [], finished=True, finish_reason="stop")
    tokens = await engine.tokenize(parsed.prompt)
    text = json.dumps({"tokens": tokens, "max_model_len": engine.context_tokens})
    return RequestOutput(request_id, text, [], finished=True, finish_reason="stop", num_prompt_tokens=len(tokens))
