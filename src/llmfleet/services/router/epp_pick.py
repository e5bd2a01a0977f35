"""What the endpoint picker (epp.py) asks of the router: the worker for an OpenAI request.

    picker = EndpointPicker(router, target_port=8000, keys=keyring)
    pick = await picker.pick("/v1/completions", body, headers)   # Pick: worker, address, ...

`openai_prompt` reads the prompt of an OpenAI body: `/v1/completions` `prompt` (a string, token
ids, or a batch of one of those), `/v1/chat/completions` `messages` and `add_generation_prompt`,
as the gateway turns them into a Generate call; a malformed body is a `ValidationError` naming
the field. Other paths carry no prompt: their pick is by load alone. The picker then does what
the router does with that call up to its routing decision: tokenize (prompt.py; the tokenizer
renders chat with the model's chat template), hash the prompt's blocks with the call's salt
(its tenant's, with API keys) and let the router's policy choose among the workers of the
serving role (aggregated: unified, disaggregated: decode) with its prefix knowledge
(`Placement.pick`). It admits nothing: no request, no leg, no session remembered. The pick
names the worker's registered address and `<its host>:<target_port>`, the HTTP server
beside it (in a pod, the gateway sidecar).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llmfleet.services.router.orchestrator import Router
from llmfleet.services.router.prompt import prompt_token_ids
from llmfleet.services.router.routing import RouteDecision
from llmfleet.shared.core.api_keys import KeyRing, bearer_secret, tenant_salt
from llmfleet.shared.core.block_hash import HashContext, hash_block_chain
from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.core.multimodal import ImageRef, mm_spans
from llmfleet.shared.wire.service import Unavailable
from llmfleet.v1 import common_pb2, generation_pb2

logger = logging.getLogger(__name__)

SESSION_HEADER = "x-session-id"  # the conversation, as the gateway reads it (over `user`)
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


@dataclass(frozen=True)
class Pick:
    worker_id: str
    address: str  # the worker's registered gRPC address (what a pin names)
    endpoint: str  # `<worker host>:<target port>`: where the proxy sends the request
    decision: RouteDecision


def _field(body: Mapping[str, Any], name: str, kind: type | tuple[type, ...], what: str) -> Any:
    value = body.get(name)
    if value is None or isinstance(value, bool) or not isinstance(value, kind):
        raise ValidationError(name, f"must be {what}")
    return value


def _token_ids(name: str, values: list[Any]) -> list[int]:
    for i, t in enumerate(values):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValidationError(name, f"item {i} is not a token id: {t!r}")
    return values


def _chat(body: Mapping[str, Any]) -> common_pb2.ChatPrompt:
    messages = _field(body, "messages", list, "a non-empty list of messages")
    if not messages:
        raise ValidationError("messages", "must be a non-empty list of messages")
    chat = common_pb2.ChatPrompt()
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValidationError(f"messages[{i}].role", "must be a string")
        content = m.get("content")
        if isinstance(content, list):  # parts: only text ones (as the gateway serves them)
            texts = [p.get("text") if isinstance(p, dict) else None for p in content]
            if not all(isinstance(t, str) for t in texts):
                raise ValidationError(f"messages[{i}].content", "only text parts are supported")
            content = "".join(texts)
        elif content is None and m["role"] == "assistant":
            content = ""
        elif not isinstance(content, str):
            raise ValidationError(f"messages[{i}].content", "must be a string or a list of parts")
        role = "system" if m["role"] == "developer" else m["role"]
        pb = chat.messages.add(role=role, content=content)
        _tool_fields(m, pb)
    chat.tools.extend(_tools(body.get("tools")))
    add = body.get("add_generation_prompt", True)
    if not isinstance(add, bool):
        raise ValidationError("add_generation_prompt", "must be a boolean")
    chat.add_generation_prompt = add
    return chat


_NO_PARAMETERS = {"type": "object", "properties": {}}  # what the gateway sends for none


def _tool_fields(m: Mapping[str, Any], pb: common_pb2.ChatMessage) -> None:
    """A message's tool calls and tool-result id, as the gateway passes them (best effort: the
    pick only needs the prompt Generate will render; the gateway refuses malformed ones)."""
    for call in m.get("tool_calls") or ():
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            args = fn.get("arguments", "{}")
            pb.tool_calls.add(
                id=str(call.get("id") or ""),
                name=fn["name"],
                arguments=args if isinstance(args, str) else json.dumps(args),
            )
    for key in ("tool_call_id", "name"):
        if isinstance(m.get(key), str):
            setattr(pb, key, m[key])


def _tools(tools: Any) -> list[common_pb2.Tool]:
    """The body's function tools (best effort, as `_tool_fields`)."""
    out = []
    for t in tools if isinstance(tools, list) else ():
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            continue
        params = fn.get("parameters")
        out.append(
            common_pb2.Tool(
                name=fn["name"],
                description=fn.get("description") if isinstance(fn.get("description"), str) else "",
                parameters=json.dumps(params if isinstance(params, dict) else _NO_PARAMETERS),
            )
        )
    return out


def openai_param(field: str) -> str:
    """The body's name of a Generate prompt field: "chat.messages[0].role" -> "messages[0].role"."""
    if field.startswith("chat."):
        return field.removeprefix("chat.")
    return {"text": "prompt", "tokens.token_ids": "prompt", "chat": "messages"}.get(field, field)


def openai_prompt(path: str, body: bytes) -> generation_pb2.GenerateRequest:
    """The prompt (and session) of an OpenAI request body, as the gateway would send it; a
    request without a prompt for paths other than completions and chat."""
    path = path.split("?", 1)[0].rstrip("/")
    if path not in (CHAT_PATH, COMPLETIONS_PATH):
        return generation_pb2.GenerateRequest()
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValidationError("body", f"the body is not valid JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise ValidationError("body", "must be a JSON object")
    req = generation_pb2.GenerateRequest(session_id=str(parsed.get("user") or ""))
    if path == CHAT_PATH:
        req.chat.CopyFrom(_chat(parsed))
        return req
    prompt = _field(parsed, "prompt", (str, list), "a string, a list of token ids or a batch")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ValidationError("prompt", "batched prompts are not supported")
        prompt = prompt[0]
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.tokens.token_ids.extend(_token_ids("prompt", prompt))
    return req


class EndpointPicker:
    def __init__(self, router: Router, target_port: int, keys: KeyRing | None = None) -> None:
        self.router = router
        self.target_port = target_port
        self.keys = keys or KeyRing()

    async def pick(self, path: str, body: bytes, headers: Mapping[str, str]) -> Pick:
        """The worker for this request (headers: lower-case names). Raises ValidationError
        for a malformed body or prompt, Unavailable when no worker serves."""
        req = openai_prompt(path, body)
        router = self.router
        model = router.model()
        if router.draining or model is None or not router.usable():
            raise Unavailable("no live worker serves requests")
        session = headers.get(SESSION_HEADER) or req.session_id
        kind = req.WhichOneof("prompt")
        ids: list[int] = []
        images: tuple[ImageRef, ...] = ()
        if kind is not None:
            try:
                ids, images = await prompt_token_ids(router.tokenizer, req, kind, model)
            except ValidationError as exc:  # named as the Generate field: name the body's
                raise ValidationError(openai_param(exc.field), exc.message) from None
        hashes: list[bytes] = []
        if router.policy.needs_prefix:
            ctx = HashContext(model.model_id, self._salt(headers))
            hashes = hash_block_chain(ids, model.block_size, ctx, mm_spans(images))
        placement = router.placement
        decision, _ = placement.pick(
            placement.serving_role, hashes, len(ids), model.block_size, session_id=session
        )
        info = router.registry.get(decision.worker_id)
        if info is None:  # (no await since the pick: only for the type checker)
            raise Unavailable(f"worker {decision.worker_id} left the fleet")
        host = info.address.rsplit(":", 1)[0]
        logger.debug(
            "picked %s for %s (%s, %s, prefix %d tokens)",
            info.address,
            path,
            decision.policy,
            decision.outcome,
            decision.matched_prefix_tokens,
        )
        return Pick(info.worker_id, info.address, f"{host}:{self.target_port}", decision)

    def _salt(self, headers: Mapping[str, str]) -> str:
        """The salt the router gives the call: its tenant's with API keys (tenancy.py)."""
        if not self.keys.enabled:
            return ""
        tenant = self.keys.tenant_of(bearer_secret(headers.get("authorization")))
        return tenant_salt(tenant, "") if tenant is not None else ""
