"""Who is asking, and which earlier turn a request continues.

A reuse key is (tenant, conversation). The tenant is a hash of the caller's credentials, so one caller
can never replay another's conversation id to make P read their blocks. The conversation is named by the
first of SESSION_SOURCES the request carries (pdserve's own field, then vLLM's session identity in vLLM's
order, then what gateways and coding agents send), or found by automatic detection: the router remembers
a hash of each chat history it answered *including the reply it returned*, so an unmodified OpenAI client
that sends that history back (plus new messages) is recognised; and of the prompt alone, so a client that
rewrote the reply still reuses the prompt. A false match is harmless: the token-level continuation check
still decides what P may read.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import json
from json.encoder import encode_basestring_ascii as _json_str   # json.dumps' own text for a str
from typing import Any

from aiohttp import web

Key = tuple[str, str]
MAX_CONVERSATION_ID = 256


def credential(request: web.Request) -> str:
    """The caller's credential as `Authorization` carries it; Anthropic clients' `x-api-key: K` counts as
    `Authorization: Bearer K` (the same key is the same tenant whichever header carries it)."""
    auth = request.headers.get("Authorization", "")
    if not auth and request.headers.get("x-api-key"):
        auth = "Bearer " + request.headers["x-api-key"]
    return auth


def tenant(request: web.Request) -> str:
    """The caller's credential, hashed ("" for a caller without one): admission's tenant."""
    auth = credential(request)
    # Non-UTF-8 header bytes arrive as surrogate escapes: hash the original bytes.
    return hashlib.sha256(auth.encode("utf-8", "surrogateescape")).hexdigest()[:16] if auth else ""


def reuse_scope(request: web.Request) -> str:
    """Whose conversations a request may continue (the first half of every reuse key): its caller's
    credential, or for a caller without one its network address (client_address), so that anonymous clients
    on different hosts never continue each other's conversations: a guessed conversation id or a common
    history prefix would otherwise let one read (and time) another's KV. Behind a proxy every anonymous
    client has the proxy's address: give them keys (router.api_key_env) to keep them apart."""
    return tenant(request) or _anonymous_scope(client_address(request))


@functools.lru_cache(maxsize=4096)
def _anonymous_scope(address: str) -> str:
    """An anonymous client's scope by its address (hashed once per address, not once per request)."""
    return "anon-" + hashlib.sha256(address.encode()).hexdigest()[:16]


def client_address(request: web.Request) -> str:
    """Who is asking, by network address, for per-client limits: an IPv4 address, or an IPv6 address's /64
    (what one host or subscriber is usually given: its addresses are one client)."""
    peer = request.remote or ""
    if ":" not in peer:
        return peer
    try:
        address = ipaddress.IPv6Address(peer.split("%", 1)[0])
    except ValueError:
        return peer
    if address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(ipaddress.IPv6Network((address, 64), strict=False))


# (where, name) in precedence order; "body" fields are top-level keys, "xargs" is vLLM's `vllm_xargs`.
SESSION_SOURCES = (
    ("body", "conversation_id"),            # pdserve's own (stripped before the backends)
    ("body", "session_id"),                 # vLLM's session identity (PR #48048), in vLLM's own order:
    ("header", "X-Session-ID"),             #   body, header, vllm_xargs; OpenCode sends this header too
    ("xargs", "session_id"),
    ("header", "x-session-affinity"),       # OpenCode
    ("header", "X-Dynamo-Session-ID"),      # NVIDIA Dynamo's canonical header
    ("header", "X-Claude-Code-Session-Id"),  # Claude Code (a subagent adds X-Claude-Code-Agent-Id)
    ("header", "thread-id"),                # Codex (newer releases)
    ("header", "session-id"),               # Codex (earlier releases)
    ("header", "session_id"),               # Codex (earliest releases)
    ("body", "prompt_cache_key"),           # OpenAI Responses (Codex sets it to its session id)
)
# A subagent shares its parent's session id; its own chain is told apart by this header.
CHILD_HEADERS = {"X-Claude-Code-Session-Id": "X-Claude-Code-Agent-Id",
                 **{name: "x-openai-subagent" for name in ("thread-id", "session-id", "session_id",
                                                           "prompt_cache_key")}}


# A chain's parent session, where the header family that named the chain sends one: Dynamo's canonical pair,
# OpenCode's, Codex's. Claude Code needs none: its session id is the root of every subagent under it.
PARENT_HEADERS = {"X-Dynamo-Session-ID": "X-Dynamo-Parent-Session-ID", "X-Session-ID": "x-parent-session-id",
                  "x-session-affinity": "x-parent-session-id", "thread-id": "x-codex-parent-thread-id"}


def _named(request: web.Request, body: dict[str, Any]) -> tuple[str, str] | None:
    """(value, source name) of the first session source the request carries."""
    headers, xargs = request.headers, body.get("vllm_xargs")
    for where, name in SESSION_SOURCES:    # _source's lookups inline: 11 sources, twice a request
        if where == "header":
            value = headers.get(name)
        elif where == "body":
            value = body.get(name)
        else:
            value = xargs.get(name) if isinstance(xargs, dict) else None
        if isinstance(value, str) and value:
            return value, name
    return None


def session_id(request: web.Request, body: dict[str, Any]) -> str | None:
    """The conversation id the request names, from the first source present (None if none is)."""
    named = _named(request, body)
    if named is None:
        return None
    value, name = named
    child = request.headers.get(CHILD_HEADERS[name], "") if name in CHILD_HEADERS else ""
    return f"{value}/{child}" if child else value


def root_session(request: web.Request, body: dict[str, Any]) -> str | None:
    """The session a request's chain belongs to, for prefill affinity: a subagent's parent session (its
    PARENT_HEADERS value; for Claude Code and Codex's x-openai-subagent, the session id the subagent shares),
    else the chain's own session id; None when no session is named (or it is too long to name one). Siblings
    and their parent share it, so they share one P, whose prefix cache holds the prefix they share."""
    named = _named(request, body)
    if named is None:
        return None
    value, name = named
    parent = request.headers.get(PARENT_HEADERS[name], "") if name in PARENT_HEADERS else ""
    root = parent or value
    return root if len(root) <= MAX_CONVERSATION_ID else None


def explicit_key(request: web.Request, body: dict[str, Any], fingerprint: str = "") -> Key | None:
    """The conversation the request names. `fingerprint` (the wire format's: model, system prompt, tools)
    is folded in, so a side request under the same session id (an agent's title or summary call on a
    small model, a review with other instructions) never takes the main chain's entry."""
    conv = session_id(request, body)
    if conv is None or len(conv) > MAX_CONVERSATION_ID:
        return None
    if fingerprint:
        conv += "#" + hashlib.sha256(fingerprint.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return reuse_scope(request), "id:" + conv


def _content(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)   # [{"type": "text"}] parts == the plain string
    return content if isinstance(content, str) else json.dumps(content, sort_keys=True)


def _arguments(arguments: Any) -> str:
    """Tool-call arguments as canonical JSON: a client that re-serialises them (spacing, key order)
    still matches the reply the router returned."""
    if not isinstance(arguments, str):
        return json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    return json.dumps(parsed, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _canonical(message: Any) -> bytes:
    """What identifies a message for matching: role, text and tool calls (ids and reasoning left out,
    since clients commonly rewrite or drop them; arguments as canonical JSON)."""
    if not isinstance(message, dict):
        return json.dumps(message, sort_keys=True, default=str).encode()
    calls = []
    tool_calls = message.get("tool_calls")
    for call in tool_calls if isinstance(tool_calls, list) else []:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict):
            calls.append([fn.get("name") or "", _arguments(fn.get("arguments") or "")])
    role, text = message.get("role"), _content(message.get("content"))
    if isinstance(role, str) and not calls:
        # The bytes json.dumps gives [role, text, []] (the same C string encoder), without its per-call
        # encoder: made for every message of every request, twice for a stored turn.
        return f"[{_json_str(role)}, {_json_str(text)}, []]".encode()
    return json.dumps([role, text, calls]).encode()


def _chain(messages: list[Any], digest: bytes = b"") -> list[bytes]:
    """Hash of every prefix of the history: digests[i] covers messages[: i + 1] (after `digest`'s)."""
    out = []
    for message in messages:
        digest = hashlib.sha256(digest + _canonical(message)).digest()
        out.append(digest)
    return out


def history_keys(tenant_id: str, messages: list[Any]) -> list[Key]:
    """Candidate keys for an automatic match, longest history first (history's)."""
    return history(tenant_id, messages)[0]


def history(tenant_id: str, messages: list[Any]) -> tuple[list[Key], bytes]:
    """Candidate keys for an automatic match, longest history first, and the digest of the whole history (for
    reply_key: one hash more, not a pass again). Every prefix ending with an assistant message could be a reply
    this router returned (its reply key); every prefix ending where a reply would start could be a prompt it
    answered (its prompt key: found when the client rewrote the reply, or the reply had no items)."""
    digests = _chain(messages)
    keys: list[Key] = []
    for i in range(len(messages) - 1, -1, -1):
        role = _role(messages[i])
        if role == "assistant":
            keys.append((tenant_id, "auto:" + digests[i].hex()))
        elif i + 1 < len(messages) and _reply_starts(role, _role(messages[i + 1])):
            keys.append(prompt_key(tenant_id, digests[i]))
    return keys, digests[-1] if digests else b""


def _role(message: Any) -> Any:
    return message.get("role") if isinstance(message, dict) else None


def _reply_starts(last: Any, following: Any) -> bool:
    """A turn's prompt may end after `last` and the next turn's input begin with `following`: where a reply
    starts, or (a reply with no items) where the client's next message follows its last input at once."""
    return following == "assistant" or (following == "user" and last in ("user", "tool"))


def prompt_key(tenant_id: str, digest: bytes) -> Key:
    """A finished turn's second key, by its prompt alone (`digest`: the prompt history's): the next turn finds
    the entry though the client rewrote the reply (whitespace, a dropped reasoning part, a re-serialised tool
    call), and the token-level check (reuse.decide) cuts what P reads at the first token that differs."""
    return tenant_id, "prompt:" + digest.hex()


def prompt_digest(messages: list[Any]) -> bytes | None:
    return _chain(messages)[-1] if messages else None


def reply_key(tenant_id: str, messages: list[Any], reply: list[dict[str, Any]], digest: bytes | None = None) -> Key:
    """The key under which a finished turn is stored: its history (or `digest`, history's) plus the reply's
    items (one assistant message in chat; a message and function calls, each an item, in Responses)."""
    if digest is None:
        digest = _chain(messages)[-1] if messages else b""
    return tenant_id, "auto:" + (_chain(reply, digest)[-1] if reply else digest).hex()
