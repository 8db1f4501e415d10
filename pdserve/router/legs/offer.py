"""What of D's blocks P may read for a turn: the taken entry checked against the new prompt, by P's /tokenize
(reuse.decide) or left to P's engine (reuse.engine_checked), and the facts that check needs (P's block size,
which prefill servers' engines check an offer themselves)."""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any

from pdserve.router.api import WireFormat
from pdserve.router.api.completions import prompt_ids_if_given
from pdserve.router.config import RouterConfig
from pdserve.router.errors import UpstreamError
from pdserve.router.kv.reuse import MISS, Decision, ReuseEntry, decide, engine_checked, held
from pdserve.router.kv.reuse import below_threshold as too_few_to_read
from pdserve.router.legs.upstream import Upstream
from pdserve.router.route.backends import Pool

log = logging.getLogger("pdserve.router")
BLOCK_SIZE_RE = re.compile(r'vllm:cache_config_info\{[^}]*block_size="(\d+)"')


class Offers:
    def __init__(self, cfg: RouterConfig, upstream: Upstream, pool: Pool, decode: Pool):
        self.cfg = cfg
        self.upstream = upstream
        self.pool = pool                     # the prefill servers
        self.decode = decode
        self.block_size: int | None = None   # P's KV block size, read once from its /metrics
        self.unrendered: set[str] = set()    # APIs whose render endpoint P refused (said once)
        # Prefill servers seen answering with pdserve's connector counts (PULLED_KEY): their engine cuts an
        # offer to the common token prefix itself (wire.EXPECT_KEY). Only they get engine-checked offers.
        self.engine_checks: set[str] = set()

    def holds(self, entry: ReuseEntry) -> bool:
        """The entry's decode server is usable and still the process that made it (reuse.held)."""
        return held(entry, **self._holder(entry))

    def _holder(self, entry: ReuseEntry) -> dict[str, Any]:
        holder = self.decode.by_name(entry.decode)
        return {"holder_healthy": bool(holder and holder.healthy),
                "holder_generation": holder.generation if holder else -1}

    def engine_check(self, entry: ReuseEntry, prompt_tokens: int | None) -> Decision:
        """The offer with D's sequence for P's engine to cut (reuse.engine_checked), without P's /tokenize."""
        return dataclasses.replace(engine_checked(entry, **self._holder(entry), threshold=self.cfg.kv_recompute_threshold),
                                   holder=entry.decode, prompt_tokens=prompt_tokens)

    async def count_tokens(self, text: str) -> int | None:
        """P's token count of `text` alone (/tokenize of a plain prompt, no special tokens); None if P
        cannot say."""
        backend = self.pool.least_loaded()
        if backend is None:
            return None
        body = {"model": self.cfg.model, "prompt": text, "add_special_tokens": False}
        try:
            status, data = await self.upstream.post_json(self.pool, backend, "/tokenize", body, {}, blame=False)
        except UpstreamError:
            return None
        tokens = data.get("tokens") if status == 200 and isinstance(data, dict) else None
        return len(tokens) if isinstance(tokens, list) else None

    def engines_check(self) -> bool:
        """Every prefill server has answered with pdserve's counts: its engine cuts an offer itself."""
        return all(b.name in self.engine_checks for b in self.pool.backends)

    def below_threshold(self, entry: ReuseEntry) -> bool:
        """Too few tokens held to be worth reading (kv_recompute_threshold), whatever the new prompt is."""
        return too_few_to_read(entry.num_tokens, self.cfg.kv_recompute_threshold)

    async def decide(self, entry: ReuseEntry | None, why: str, fmt: WireFormat, body: dict[str, Any]) -> Decision:
        """What of the taken entry P may read for this prompt, verified against P's /tokenize of it."""
        if entry is None:
            return Decision(MISS, why)
        if self.below_threshold(entry):
            # Too little to pull whatever the new prompt is: no /tokenize (its cost grows with the prompt,
            # docs/gpu.md) for a turn that recomputes anyway.
            return Decision(MISS, "below_threshold", holder=entry.decode)
        new_prompt = await self._prompt_ids(fmt, body) if entry.sequence is not None else None
        if new_prompt is None and fmt.render_path and entry.sequence is not None:
            # No render endpoint on P (vLLM 0.26 has none for messages and responses): P's engine checks.
            return self.engine_check(entry, None)
        decision = decide(entry, **self._holder(entry), threshold=self.cfg.kv_recompute_threshold,
                          new_prompt=new_prompt, block_size=await self.read_block_size())
        return dataclasses.replace(decision, holder=entry.decode,
                                   prompt_tokens=len(new_prompt) if new_prompt is not None else None)

    async def _prompt_ids(self, fmt: WireFormat, body: dict[str, Any]) -> list[int] | None:
        """The token ids P will prefill for this request (P's own tokenizer and chat template): its
        /tokenize, or the format's render endpoint."""
        given = prompt_ids_if_given(body) if fmt.native_token_ids else None
        if given is not None:
            return given
        tok = fmt.tokenize_body(body, self.cfg.model)
        backend = self.pool.least_loaded()   # no rotation: tokenizing must not shift where prefills go
        if tok is None or backend is None:
            return None
        try:
            # The client's content again: a failure here says nothing sure about P (its prefill follows).
            status, data = await self.upstream.post_json(self.pool, backend, fmt.render_path or "/tokenize", tok,
                                                         {}, blame=False)
        except UpstreamError:
            return None
        if status != 200:
            if fmt.render_path and fmt.api not in self.unrendered:
                self.unrendered.add(fmt.api)     # said once: every turn of this API recomputes (unverifiable)
                log.warning("%s on %s answered HTTP %d: %s turns cannot be checked for reuse and recompute; "
                            "prefill servers need --enable-scale-out (pdserve's entry adds it where vLLM has it)",
                            fmt.render_path, backend.name, status, fmt.api)
            return None
        return fmt.prompt_ids(data)

    async def read_block_size(self) -> int | None:
        for backend in self.pool.backends if self.block_size is None else []:
            m = BLOCK_SIZE_RE.search(await self.upstream.get_text(backend, "/metrics") or "")
            if m:
                self.block_size = int(m.group(1))
                break
        return self.block_size
