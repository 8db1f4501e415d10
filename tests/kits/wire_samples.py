"""Sample answers and streams of the wire formats (Anthropic Messages, OpenAI Responses), D's handles and
token ids in them, as the router's format and relay tests feed them."""

from __future__ import annotations

import json

from pdserve.router.wire import TOKENS_KEY

D_PARAMS = {"remote_block_ids": [[3, 4]], "remote_num_tokens": 9, TOKENS_KEY: list(range(10))}


def event(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()


# -- Anthropic Messages
STREAM = (event("message_start", {"type": "message_start", "message": {"id": "msg_1", "content": []}})
          + event("content_block_start", {"type": "content_block_start", "index": 0,
                                          "content_block": {"type": "text", "text": ""}})
          + event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                          "delta": {"type": "text_delta", "text": "Let me "}})
          + event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                          "delta": {"type": "text_delta", "text": "look."}})
          + event("content_block_start", {"type": "content_block_start", "index": 1, "content_block":
                                          {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {}}})
          + event("content_block_delta", {"type": "content_block_delta", "index": 1, "delta":
                                          {"type": "input_json_delta", "partial_json": '{"command": "ls", '}})
          + event("content_block_delta", {"type": "content_block_delta", "index": 1, "delta":
                                          {"type": "input_json_delta", "partial_json": '"timeout": 5}'}})
          + event("message_delta", {"type": "message_delta", "delta": {"stop_reason": "tool_use"}})
          + event("message_stop", {"type": "message_stop", "kv_transfer_params": D_PARAMS}))


# -- OpenAI Responses
OUTPUT = [{"type": "reasoning", "id": "rs_1", "summary": []},
          {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
           "content": [{"type": "output_text", "text": "Running it.", "annotations": []}]},
          {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "shell",
           "arguments": '{"cmd": ["ls"]}', "status": "completed"}]
R_STREAM = (event("response.created", {"type": "response.created",
                                       "response": {"id": "resp_1", "output": [], "kv_transfer_params": None}})
            + event("response.output_text.delta", {"type": "response.output_text.delta", "delta": "Running it."})
            + event("response.completed", {"type": "response.completed", "response": {
                "id": "resp_1", "output": OUTPUT, "kv_transfer_params": D_PARAMS}}))
