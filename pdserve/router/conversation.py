"""Who a turn's conversation is, said once per turn (identity.py has the rules): the keys to look its entry up
under, the keys to keep the reply under, and whether a match proves D's prefix. Everything that asks
"an explicit id, or the history?" asks it here."""

from __future__ import annotations

import asyncio
from typing import Any

from pdserve.router import identity
from pdserve.router.identity import Key

OFF_LOOP_MESSAGES = 2000   # histories longer than this are hashed in a worker thread
EXPLICIT, HISTORY, NONE = "explicit", "history", "none"   # how it was found (pdserve_router_identity_total)


class Conversation:
    """Made when the turn is (Flow); its lookup keys are hashed at most once, when the turn looks them up."""

    __slots__ = ("tenant", "explicit", "messages", "digest", "root")

    def __init__(self, tenant: str, explicit: Key | None, messages: list[Any] | None, root: str | None = None):
        self.tenant = tenant
        self.explicit = explicit          # conversation_id / X-Session-ID (identity.explicit_key)
        self.messages = messages          # the history as chat-like items (fmt.history), for automatic detection
        self.root = root                  # the root session, a subagent's parent's (identity.root_session)
        self.digest: bytes | None = None  # of `messages`, once hashed for the lookup

    @property
    def tracked(self) -> bool:
        """Something to keep a finished turn under: an id, or a history."""
        return self.explicit is not None or self.messages is not None

    @property
    def by_history(self) -> bool:
        """Found by its history, not by an id: its next key is the history with the reply, so the reply's
        text is wanted (a stream keeps its lines)."""
        return self.explicit is None

    def proves_prefix(self, by_prompt: bool) -> bool:
        """An entry matched by the reply's key (history, not an id; not by the prompt alone: the client kept
        the reply) proves every earlier message and the reply are the ones D computed: D's prefix cache holds
        them. Under an explicit id the history may have been edited."""
        return self.explicit is None and not by_prompt

    async def lookup_keys(self) -> tuple[list[Key], str]:
        """The keys its entry may be under, longest history first, and how it was found (EXPLICIT, HISTORY,
        NONE)."""
        if self.explicit is not None:
            return [self.explicit], EXPLICIT
        keys: list[Key] = []
        if self.messages and len(self.messages) > OFF_LOOP_MESSAGES:
            # Hashing a long history is pure Python and slow: off the event loop.
            keys, self.digest = await asyncio.to_thread(identity.history, self.tenant, self.messages)
        elif self.messages:
            keys, self.digest = identity.history(self.tenant, self.messages)
        return keys, HISTORY if keys else NONE

    def store_keys(self, reply: list[dict[str, Any]]) -> tuple[Key, Key | None]:
        """Where a finished turn is kept: the conversation it names; or its history with the `reply`'s items,
        and (the alias) its history alone, for a client that sends the reply back rewritten."""
        if self.explicit is not None:
            return self.explicit, None
        messages = self.messages or []
        digest = self.digest if self.digest is not None else identity.prompt_digest(messages)
        key = identity.reply_key(self.tenant, messages, reply, digest)
        return key, identity.prompt_key(self.tenant, digest) if digest else None
