"""Large JSON answers parsed with the event loop running (router/legs/bigjson.py): the same result as json.loads, and
no long stall for a 2M-id answer (issue 35 item 7)."""

from __future__ import annotations

import asyncio
import json

from pdserve.router.legs import bigjson


def test_the_result_is_json_loads_whatever_the_shape():
    ids = list(range(200_000))
    answers = [
        {"id": "x", "prompt_token_ids": ids, "choices": [{"index": 0, "token_ids": ids[:5], "text": "a"}]},
        {"choices": [{"prompt_token_ids": ids, "token_ids": ids, "text": '"token_ids": [1, 2]'}], "n": None},
        {"kv_transfer_params": {"pdserve_token_ids": ids}, "token_ids": [], "x": "\u0000pdserve-ids-00:0"},
        {"padding": "y" * (2 << 20), "token_ids": [1, 2, 3]},
        {'a "token_ids': ids, "b": '"token_ids": [' + "1," * 200_000 + "1]", "token_ids": ids + [-1]},
    ]
    for answer in answers:
        for raw in (json.dumps(answer).encode(), json.dumps(answer, separators=(",", ":")).encode()):
            assert asyncio.run(bigjson.loads(raw)) == json.loads(raw)


def test_a_long_id_answer_leaves_the_loop_running():
    raw = json.dumps({"id": "x", "prompt_token_ids": [1000 + i % 30000 for i in range(600_000)],
                      "choices": [{"index": 0, "message": {"content": "w"}}]}).encode()

    async def turns_while(parse) -> int:
        """Turns of the loop another task got while `parse` ran (json.loads alone: none)."""
        turns = [0]

        async def tick() -> None:
            while True:
                await asyncio.sleep(0)
                turns[0] += 1

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0)
        before = turns[0]
        data = await parse()
        ticker.cancel()
        assert len(data["prompt_token_ids"]) == 600_000 and data["choices"][0]["index"] == 0
        return turns[0] - before

    async def plain():
        return json.loads(raw)

    assert asyncio.run(turns_while(plain)) <= 1
    assert asyncio.run(turns_while(lambda: bigjson.loads(raw))) >= len(raw) // bigjson.SLICE // 2
